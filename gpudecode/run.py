"""One decoding job: features from the config's source, results written incrementally.

Each utterance's results are written and flushed as soon as its batch finishes, so an
interrupted run loses nothing; with ``resume`` the utterances already in the output are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gpudecode import backend, defaults
from gpudecode.config import Config, ConfigError, dump_resolved
from gpudecode.decoder import Decoder
from gpudecode.io import ResultWriter, UtteranceResult, read_done_ids, score_wer
from gpudecode.job import OutOfMemory, RunSummary, decode_fitting, open_utterances

__all__ = ["OutOfMemory", "RunSummary", "run_decode"]


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
    if io.features is None and io.prompts is None:
        raise ConfigError("io.features: no features to decode (set io.features.path or pass --features; "
                          "for a model without an encoder, io.prompts or --prompts)")
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
    try:
        source = open_utterances(config, decoder.vocabulary, encoder=decoder.encoder is not None,
                                 num_features=decoder.encoder_num_features)
    except BaseException:
        decoder.close()
        raise
    dump_resolved(config, output / defaults.RESOLVED_CONFIG_FILE)
    start = time.perf_counter()
    try:
        with source, ResultWriter(output, decoder.vocabulary, formats=io.formats, word_merging=io.word_merging,
                                  frame_shift_s=front_end.frame_shift_s * decoder.subsampling,
                                  resume=resume) as writer:
            total = len([u for u in source.ids() if u not in done])
            for batch in source.batches(config.search.batch_size, exclude=done):
                for utterance, nbest in decode_fitting(decoder, batch, summary, io.on_bad_input):
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
