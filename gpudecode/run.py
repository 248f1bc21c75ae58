"""One decoding job: features from the config's source, results written incrementally.

Each utterance's results are written and flushed as soon as its batch finishes, so an
interrupted run loses nothing; with ``resume`` the utterances already in the output are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpudecode import backend, defaults
from gpudecode.config import Config, ConfigError, dump_resolved
from gpudecode.decoder import Decoder
from gpudecode.io import ResultWriter, UtteranceResult, open_features, read_done_ids, score_wer


@dataclass
class RunSummary:
    """What a run did: counts, time, throughput and (with references) WER/CER."""

    decoded: int = 0
    resumed: int = 0
    skipped: list[str] = field(default_factory=list)
    frames: int = 0
    seconds: float = 0.0
    frame_shift_s: float = 0.0
    wer: dict | None = None
    output: Path | None = None
    gpu_memory_bytes: int | None = None  # CuPy pool bytes at the end (GPU runs)
    retried_batches: int = 0  # batches split after running out of GPU memory

    @property
    def utterances_per_second(self) -> float:
        return self.decoded / self.seconds if self.seconds else 0.0

    @property
    def real_time_factor(self) -> float | None:
        """Decoding time ÷ audio duration (input frames × frame shift)."""
        audio = self.frames * self.frame_shift_s
        return self.seconds / audio if audio else None

    def rows(self) -> list[tuple[str, str]]:
        rows = [("utterances decoded", str(self.decoded)), ("resumed (already done)", str(self.resumed)),
                ("skipped (bad input)", str(len(self.skipped))), ("time", f"{self.seconds:.2f} s"),
                ("utterances/s", f"{self.utterances_per_second:.1f}")]
        if self.real_time_factor is not None:
            rows.append(("real-time factor", f"{self.real_time_factor:.4f}"))
        if self.wer is not None:
            w = self.wer
            errors = w["substitutions"] + w["deletions"] + w["insertions"]
            rows.append(("WER", f"{100 * w['wer']:.2f} % ({errors} errors / {w['num_ref_words']} words: "
                                f"{w['substitutions']} sub, {w['deletions']} del, {w['insertions']} ins)"))
            rows.append(("CER", f"{100 * self.wer['cer']:.2f} %"))
        if self.gpu_memory_bytes is not None:
            rows.append(("GPU memory (CuPy pool)", f"{self.gpu_memory_bytes / 2**20:.1f} MiB"))
        if self.retried_batches:
            rows.append(("batches split (out of GPU memory)", str(self.retried_batches)))
        rows.append(("output", str(self.output)))
        return rows


def run_decode(config: Config, *, resume: bool = False,
               progress: Callable[[int, int], None] | None = None,
               on_status: Callable[[Mapping], None] | None = None) -> RunSummary:
    """Decode every utterance of ``config.io.features`` into ``config.io.output``.

    ``progress(done, total, real_time_factor)`` is called after each batch. Without ``resume``, an output folder
    that already holds results is an error (results already written are never overwritten).
    With ``runtime.engine.type: ray`` the work runs on a Ray cluster (``gpudecode.engines``) and
    ``on_status(workers)`` gets each worker's status (worker name -> ``WorkerStatus``).
    """
    io = config.io
    if io.features is None:
        raise ConfigError("io.features: no features to decode (set io.features.path or pass --features)")
    output = Path(io.output)
    done = read_done_ids(output) if output.exists() else set()
    if done and not resume:
        raise ConfigError(
            f"io.output: {output} already holds results for {len(done)} utterance(s); "
            "pass --resume to continue that run, or choose another --output"
        )
    if config.runtime.engine.type != "local":
        from gpudecode.engines import run_on_engine

        return run_on_engine(config, done=done, resume=resume, progress=progress, on_status=on_status)
    decoder = Decoder(config)
    front_end = config.models.front_end
    summary = RunSummary(resumed=len(done), frame_shift_s=front_end.frame_shift_s, output=output)
    source = open_features(io.features.path, io.features.format, front_end,
                           num_features=io.features.num_features or decoder.encoder_num_features,
                           on_error=io.on_bad_input)
    dump_resolved(config, output / defaults.RESOLVED_CONFIG_FILE)
    start = time.perf_counter()
    try:
        with source, ResultWriter(output, decoder.vocabulary, formats=io.formats, word_merging=io.word_merging,
                                  frame_shift_s=front_end.frame_shift_s * decoder.subsampling,
                                  resume=resume) as writer:
            total = len([u for u in source.ids() if u not in done])
            for batch in source.batches(config.search.batch_size, exclude=done):
                for utterance, nbest in _decode_fitting(decoder, batch, summary, io.on_bad_input):
                    writer.write(UtteranceResult(id=utterance.id, nbest=nbest))
                    summary.frames += utterance.num_frames
                    summary.decoded += 1
                if progress:
                    summary.seconds = time.perf_counter() - start
                    progress(summary.decoded, total, summary.real_time_factor)
            summary.skipped = [str(error) for error in source.skipped] + summary.skipped
    finally:
        summary.seconds = time.perf_counter() - start
        if config.runtime.device == "cuda":
            summary.gpu_memory_bytes = backend.device_memory_in_use()
        decoder.close()
    if io.references is not None and "text" in io.formats:
        summary.wer = score_wer(output / defaults.TEXT_FILE, io.references, output / defaults.WER_FILE)
    return summary


class OutOfMemory(RuntimeError):
    """One utterance alone does not fit in GPU memory."""


def _decode_fitting(decoder: Decoder, batch, summary: RunSummary, on_bad_input: str):
    """(utterance, n-best) pairs of ``batch``; on GPU out-of-memory the cached free memory is
    released (never live states) and the batch is decoded in halves; an utterance that fails
    alone is reported (``stop``) or skipped (``skip``)."""
    try:
        nbests = decoder.decode_batch([u.id for u in batch], [u.features for u in batch])
    except Exception as error:
        if not backend.is_out_of_memory(error):
            raise
        backend.release_cached_memory()
        if len(batch) == 1:
            message = (f"utterance {batch[0].id!r} ({batch[0].num_frames} frames) does not fit in GPU memory "
                       f"even alone: {error}")
            if on_bad_input == "skip":
                summary.skipped.append(message)
                return
            raise OutOfMemory(message) from error
        summary.retried_batches += 1
        half = len(batch) // 2
        yield from _decode_fitting(decoder, batch[:half], summary, on_bad_input)
        yield from _decode_fitting(decoder, batch[half:], summary, on_bad_input)
        return
    yield from zip(batch, nbests)
