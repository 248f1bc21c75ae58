"""Decoding on Ray: a pool of decoder actors fed by Ray Data; the driver writes the results.

    gpudecode decode CONFIG --engine ray [--address ADDRESS] [--workers N] [--gpus-per-worker G]

The driver (this process) lists the utterances (less those already in the output when
resuming), cuts them into the same length-bucketed search batches as the single-process run,
and groups consecutive batches into shards (Ray Data blocks of
``runtime.engine.batches_per_shard`` batches). ``Dataset.map_batches`` with a callable class,
:class:`DecodeWorker`, runs a fixed pool of actors: one per GPU (``runtime.engine.gpus_per_worker``;
a fraction lets workers share one) or, on the CPU path, one per ``runtime.engine.cpus_per_worker``
CPUs. Each actor loads its ``Decoder`` (sessions, state pools) and opens the features (and
prompts) once — from paths every worker can see — and decodes one search batch per call with the
single-process code path (``Decoder.decode_batch`` with the out-of-memory fallback). Each batch
comes back as one row; the driver writes it through the same ``ResultWriter``, so ``--resume``
works across engines both ways.

Fault tolerance is Ray's: an actor that dies (killed, out of host memory) is restarted
(``runtime.engine.max_restarts``) and the shards it had not returned are decoded again
(``runtime.engine.max_task_retries``). The driver de-duplicates by utterance id, so the output
holds every utterance exactly once, and checks at the end that every planned utterance came back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpudecode import backend, defaults
from gpudecode.config import Config, ConfigError, dump_resolved
from gpudecode.decoder import Decoder
from gpudecode.engines.base import EngineError, import_ray
from gpudecode.io import (
    FeatureError,
    InputError,
    ResultWriter,
    UtteranceResult,
    bucket_by_length,
    score_wer,
)
from gpudecode.io.wer import validate_references
from gpudecode.job import OutOfMemory, RunSummary, decode_fitting, open_utterances
from gpudecode.search import Hypothesis

__all__ = ["BatchResult", "DecodeWorker", "RaySummary", "WorkerStatus", "plan_shards", "run_decode_ray"]

log = logging.getLogger(__name__)

# Test-only failure injection, read by the driver: "N:PATH" makes the first worker that has
# decoded N utterances (and creates PATH, writing its pid there) kill itself with SIGKILL
# before returning its batch, as a crash or the kernel's out-of-memory killer would.
KILL_WORKER_ENV = "GPUDECODE_RAY_KILL_WORKER_AFTER"


# --- what travels between workers and the driver ---------------------------------------------

@dataclass
class BatchResult:
    """One search batch decoded by one worker (pickled into one Ray Data row)."""

    worker: str  # "node-ip:pid"
    ids: list[str]  # the batch as planned
    utterances: list[tuple[str, int, list[Hypothesis]]] = field(default_factory=list)  # (id, frames, n-best)
    skipped: list[str] = field(default_factory=list)  # bad input, or too long for GPU memory
    retried_batches: int = 0
    seconds: float = 0.0
    gpu_memory_bytes: int | None = None
    error: tuple[str, str, str] | None = None  # (kind, message, traceback): stops the run


@dataclass
class WorkerStatus:
    """What the driver knows about one worker process, from the batches it returned."""

    name: str
    decoded: int = 0  # utterances returned (duplicates of a retried shard included)
    batches: int = 0
    busy_seconds: float = 0.0
    gpu_memory_bytes: int | None = None
    last_result_s: float = 0.0  # time.monotonic() of its last batch

    @property
    def utterances_per_second(self) -> float:
        return self.decoded / self.busy_seconds if self.busy_seconds else 0.0

    def describe(self) -> str:
        text = (f"{self.decoded} utt in {self.batches} batches, "
                f"{self.utterances_per_second:.1f} utt/s while busy")
        if self.gpu_memory_bytes is not None:
            text += f", GPU {self.gpu_memory_bytes / 2**20:.0f} MiB"
        return text


@dataclass
class RaySummary(RunSummary):
    """A ``RunSummary`` plus the pool: one row per worker process, duplicates dropped."""

    engine: str = ""
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    duplicates: int = 0  # results of retried shards that were already written

    def rows(self) -> list[tuple[str, str]]:
        rows = super().rows()
        extra = [("engine", self.engine), ("worker processes", str(len(self.workers)))]
        if self.duplicates:
            extra.append(("duplicates dropped", str(self.duplicates)))
        extra += [(f"worker {w.name}", w.describe()) for w in sorted(self.workers.values(), key=lambda w: w.name)]
        return rows[:-1] + extra + rows[-1:]  # "output" stays last


# --- the worker --------------------------------------------------------------------------------

# Errors that carry their own clear message (the command line prints them without a traceback).
_KNOWN_ERRORS = (InputError, OutOfMemory, ConfigError, FileNotFoundError, backend.GpuUnavailableError)


def _describe(error: BaseException) -> tuple[str, str, str]:
    from gpudecode.session import ModelError, SessionError

    if isinstance(error, InputError):
        kind = "input"
    elif isinstance(error, OutOfMemory):
        kind = "out-of-memory"
    elif isinstance(error, ConfigError):
        kind = "config"
    elif isinstance(error, (*_KNOWN_ERRORS, ModelError, SessionError)):
        kind = "known"
    else:
        kind = type(error).__name__
    return kind, str(error), "".join(traceback.format_exception(error))


def _on_assigned_gpu(config: Config, gpu_ids: Sequence) -> Config:
    """Ray hides every GPU but the worker's own (CUDA_VISIBLE_DEVICES): it is device 0."""
    if config.runtime.device != "cuda" or not gpu_ids:
        return config
    return config.model_copy(update={"runtime": config.runtime.model_copy(update={"device_id": 0})})


class DecodeWorker:
    """One actor of the pool (a Ray Data ``map_batches`` callable class).

    Loads the ``Decoder`` and opens the features once; each call decodes the search batches of
    its rows (column ``ids``: JSON lists of utterance ids) and returns one row per batch (column
    ``result``: a pickled :class:`BatchResult`). Errors are sent back as results rather than
    raised, so a bad config or input stops the run with its own message instead of making Ray
    restart the actor again and again.
    """

    def __init__(self, config: Config, kill_after: str | None = None):
        import ray

        self.config = _on_assigned_gpu(config, ray.get_gpu_ids())
        self.name = f"{ray.util.get_node_ip_address()}:{os.getpid()}"
        self.kill_after = kill_after
        self.num_decoded = 0
        self.decoder: Decoder | None = None
        self.error: tuple[str, str, str] | None = None
        try:
            self.decoder = Decoder(self.config)
            self.source = open_utterances(self.config, self.decoder.vocabulary,
                                          encoder=self.decoder.encoder is not None,
                                          num_features=self.decoder.encoder_num_features)
        except Exception as error:  # reported with the first batch
            self.error = _describe(error)

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = [pickle.dumps(self.decode_ids(json.loads(ids))) for ids in rows["ids"]]
        return {"result": np.array(results, dtype=object)}

    def decode_ids(self, ids: list[str]) -> BatchResult:
        """Decode one search batch, as the single-process run does."""
        start = time.perf_counter()
        result = BatchResult(worker=self.name, ids=ids, error=self.error)
        if result.error is None:
            try:
                self._decode(ids, result)
            except Exception as error:
                result.error = _describe(error)
        result.seconds = time.perf_counter() - start
        if self.config.runtime.device == "cuda":
            result.gpu_memory_bytes = backend.device_memory_in_use()
        self.num_decoded += len(result.utterances)
        self._maybe_kill_for_test()
        return result

    def _decode(self, ids: list[str], result: BatchResult) -> None:
        on_bad_input = self.config.io.on_bad_input
        utterances = []
        for utt_id in ids:
            try:
                utterances.append(self.source.read(utt_id))
            except FeatureError as error:
                if on_bad_input == "stop":
                    raise
                log.warning("skipping: %s", error)
                result.skipped.append(str(error))
        if not utterances:
            return
        scratch = RunSummary()
        for utterance, nbest in decode_fitting(self.decoder, utterances, scratch, on_bad_input):
            result.utterances.append((utterance.id, utterance.num_frames, list(nbest)))
        result.skipped += scratch.skipped
        result.retried_batches = scratch.retried_batches

    def _maybe_kill_for_test(self) -> None:
        if not self.kill_after:
            return
        count, _, marker = self.kill_after.partition(":")
        if self.num_decoded < int(count):
            return
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another worker (or this one's predecessor) died already
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    def __del__(self) -> None:
        if getattr(self, "decoder", None) is not None:
            self.decoder.close()


# --- the driver --------------------------------------------------------------------------------

def plan_shards(batches: Sequence[Sequence[str]], batches_per_shard: int, num_workers: int) -> int:
    """Number of shards for ``batches``: ``batches_per_shard`` batches each, but at least one
    per worker while there are batches enough."""
    num_shards = math.ceil(len(batches) / batches_per_shard)
    return max(num_shards, min(len(batches), num_workers))


def _connect(ray, address: str | None) -> bool:
    """Connect to (or start) the cluster; True if this call did, so the run shuts it down."""
    if ray.is_initialized():
        if address not in (None, "auto"):
            log.warning("Ray is already initialised in this process; runtime.engine.address %r is not used",
                        address)
        return False
    try:
        ray.init(address=address, include_dashboard=False)
    except ConnectionError as error:
        raise EngineError(f"runtime.engine.address {address!r}: cannot connect to a Ray cluster: "
                          f"{error}") from error
    return True


def _pool_size(ray, config: Config, num_batches: int) -> tuple[int, float, str]:
    """(workers, GPUs per worker, a description) that fit the cluster."""
    engine = config.runtime.engine
    gpus = engine.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if config.runtime.device == "cuda" else 0.0
    cluster = ray.cluster_resources()
    have_cpus, have_gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    capacity = int(have_cpus / engine.cpus_per_worker + 1e-9)
    if gpus > 0:
        capacity = min(capacity, int(have_gpus / gpus + 1e-9))
    workers = engine.workers or capacity
    per_worker = f"{engine.cpus_per_worker:g} CPU" + (f", {gpus:g} GPU" if gpus else "")
    if workers < 1 or workers > capacity:
        raise EngineError(
            f"runtime.engine.workers: {workers or 'any'} worker(s) of {per_worker} each do not fit the Ray "
            f"cluster ({have_cpus:g} CPU, {have_gpus:g} GPU); set --workers, --gpus-per-worker or "
            "runtime.engine.cpus_per_worker, or add nodes")
    workers = min(workers, max(num_batches, 1))
    return workers, gpus, f"ray, {workers} worker(s) × ({per_worker})"


def _stream(ray, config: Config, batches: list[list[str]], num_workers: int, gpus: float) -> Iterator[BatchResult]:
    """Decode ``batches`` on a pool of ``num_workers`` actors; results in order of arrival."""
    engine = config.runtime.engine
    context = ray.data.DataContext.get_current()
    saved = context.enable_progress_bars, context.print_on_execution_start
    context.enable_progress_bars, context.print_on_execution_start = False, False  # ours instead
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
    try:
        num_shards = plan_shards(batches, engine.batches_per_shard, num_workers)
        dataset = ray.data.from_items([{"ids": json.dumps(ids)} for ids in batches],
                                      override_num_blocks=num_shards)
        with warnings.catch_warnings():
            # Ray 2.60 takes max_restarts / max_task_retries only as (deprecated) extra remote args.
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            decoded = dataset.map_batches(
                DecodeWorker,
                fn_constructor_kwargs={"config": config, "kill_after": os.environ.get(KILL_WORKER_ENV)},
                batch_size=1, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=2),
                num_cpus=engine.cpus_per_worker, num_gpus=gpus or None,
                max_restarts=engine.max_restarts, max_task_retries=engine.max_task_retries,
            )
    finally:
        context.enable_progress_bars, context.print_on_execution_start = saved
    rows = iter(decoded.iter_rows())
    try:
        for row in rows:
            yield pickle.loads(row["result"])
    finally:
        getattr(rows, "close", lambda: None)()  # an interrupted run stops the pipeline and its actors


def _raise_worker_error(result: BatchResult) -> None:
    kind, message, trace = result.error
    if kind == "input":
        raise InputError(message)
    if kind == "out-of-memory":
        raise OutOfMemory(message)
    if kind == "config":
        raise ConfigError(message)
    if kind == "known":
        raise EngineError(f"worker {result.worker}: {message}")
    raise EngineError(f"worker {result.worker} failed:\n{trace}")


def run_decode_ray(config: Config, *, done: set[str], resume: bool,
                   progress: Callable[[int, int], None] | None = None,
                   on_status: Callable[[Mapping[str, WorkerStatus]], None] | None = None) -> RaySummary:
    """``run_decode`` on a Ray cluster (see the module docstring); ``done``: ids already written."""
    ray = import_ray()
    io, front_end = config.io, config.models.front_end
    output = Path(io.output)
    vocabulary = config.models.vocabulary.load()
    summary = RaySummary(resumed=len(done), frame_shift_s=front_end.frame_shift_s, output=output)
    with open_utterances(config, vocabulary, encoder=config.models.encoder is not None) as source:
        if io.references is not None and "text" in io.formats:  # before decoding: bad references stop here
            validate_references(io.references, source.ids())
        lengths = [(u, n) for u, n in source.lengths().items() if u not in done]
        summary.skipped = [str(error) for error in source.skipped]
    batches = bucket_by_length(lengths, config.batch_sizing)  # as the single-process run batches
    dump_resolved(config, output / defaults.RESOLVED_CONFIG_FILE)
    engine = config.runtime.engine
    started_ray = _connect(ray, engine.address)
    start = time.perf_counter()
    returned: set[str] = set()
    try:
        frame_shift_s = front_end.frame_shift_s
        if "ctm" in io.formats:  # label frames are encoder frames
            from gpudecode.decoder import encoder_subsampling

            frame_shift_s *= encoder_subsampling(config)
        with ResultWriter(output, vocabulary, formats=io.formats, word_merging=io.word_merging,
                          frame_shift_s=frame_shift_s, resume=resume) as writer:
            num_workers, gpus, summary.engine = _pool_size(ray, config, len(batches))
            log.info("decoding %d utterances in %d batches on %s", len(lengths), len(batches), summary.engine)
            with contextlib.closing(_stream(ray, config, batches, num_workers, gpus)) as results:
                try:
                    for result in results:
                        if result.error is not None:
                            _raise_worker_error(result)
                        _take(result, writer, summary)
                        returned.update(result.ids)
                        if on_status:
                            on_status(summary.workers)
                        if progress:
                            progress(summary.decoded, len(lengths))
                except ray.exceptions.RayError as error:  # retries used up, cluster gone
                    raise EngineError(
                        f"decoding on Ray failed after {summary.decoded} utterance(s) were written "
                        f"(runtime.engine.max_restarts {engine.max_restarts}, runtime.engine.max_task_retries "
                        f"{engine.max_task_retries}): {type(error).__name__}: {str(error)[:500]}\n"
                        "what was written is kept; run again with --resume to decode the rest") from error
    finally:
        summary.seconds = time.perf_counter() - start
        if started_ray:
            ray.shutdown()
    lost = [u for u, _ in lengths if u not in returned]
    if lost:  # Ray returns every block once; this is the check that it did
        raise EngineError(f"{len(lost)} utterance(s) never came back from the workers (first: {lost[0]!r}); "
                          "run again with --resume to decode them")
    if io.references is not None and "text" in io.formats:
        summary.wer = score_wer(output / defaults.TEXT_FILE, io.references, output / defaults.WER_FILE)
    return summary


def _take(result: BatchResult, writer: ResultWriter, summary: RaySummary) -> None:
    """Write a batch's new utterances (each id once), update the worker's status."""
    status = summary.workers.setdefault(result.worker, WorkerStatus(result.worker))
    status.batches += 1
    status.decoded += len(result.utterances)
    status.busy_seconds += result.seconds
    status.gpu_memory_bytes = result.gpu_memory_bytes
    status.last_result_s = time.monotonic()
    for utt_id, num_frames, nbest in result.utterances:
        if utt_id in writer.done_ids:
            summary.duplicates += 1
            continue
        writer.write(UtteranceResult(id=utt_id, nbest=nbest))
        summary.frames += num_frames
        summary.decoded += 1
        summary.count_truncated(utt_id, nbest)
    summary.skipped += result.skipped
    summary.retried_batches += result.retried_batches
    if result.gpu_memory_bytes is not None:
        summary.gpu_memory_bytes = max(summary.gpu_memory_bytes or 0, result.gpu_memory_bytes)
