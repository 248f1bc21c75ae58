"""The `gpudecode` command line."""

from __future__ import annotations

import sys

import click

from gpudecode import __version__, defaults


def _parse_pairs(pairs: tuple[str, ...], option: str) -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected NAME=VALUE, got {pair!r}", param_hint=option)
        parsed[key] = value
    return parsed


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpudecode")
def main() -> None:
    """Beam-search decoding of ONNX sequence models with decoder states on the GPU."""


#: Exit statuses of ``gpudecode decode`` (docs/reliability.md): success; an ``Error:`` line; a usage
#: error (click's own); stopped by SIGINT (Ctrl-C) or SIGTERM (128 + the signal's number, as shells say).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the run stops the same way (what was written is kept)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


class _Failed(click.ClickException):
    """An ``Error:`` line with its own exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


def _written(output) -> int:
    """How many utterances ``output`` holds (for the messages; 0 where it cannot be read)."""
    try:  # (an import interrupted by Ctrl-C cannot be imported again)
        from gpudecode.io import read_done_ids

        return len(read_done_ids(output)) if output is not None and output.exists() else 0
    except Exception:  # noqa: BLE001 - a count for a message must not hide the error it explains
        return 0


def _then_resume(output, first_step: str) -> str:
    """What to do next: ``first_step``, then resume where results exist (they are kept)."""
    done = _written(output)
    if not done:
        return f"no result was written yet: {first_step} and run the command again"
    return (f"the {done} utterance(s) written to {output} are kept: {first_step}, then run the same command "
            "with --resume to decode the rest")


def _os_error_message(exc: OSError, output) -> str:
    """One line for an ``OSError`` (or a chain of them, as a failed write and then a failed close
    raise): the file, the problem, and what to do."""
    import errno

    chain, seen = [], exc
    while isinstance(seen, BaseException) and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    errors = [e for e in chain if isinstance(e, OSError)]
    full = next((e for e in errors if e.errno in (errno.ENOSPC, errno.EDQUOT)), None)
    first = full or errors[0]
    where = next((e.filename for e in [first, *errors] if e.filename), None) or output
    if full is not None:
        return f"{where}: no space left on device; {_then_resume(output, 'free space')}"
    if first.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{where}: {first.strerror} (a read-only folder or file?); "
                f"{_then_resume(output, 'make it writable (or choose another --output)')}")
    return f"{where}: {first.strerror or first}; {_then_resume(output, 'fix that')}"


def _interrupted_message(exc: KeyboardInterrupt, output) -> str:
    name = "SIGTERM" if isinstance(exc, _Terminated) else "SIGINT"
    done = _written(output)
    if not done:
        return f"interrupted ({name}) before any result was written"
    return (f"interrupted ({name}); the {done} utterance(s) written to {output} are kept: run the same command "
            "with --resume to decode the rest")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--features", type=click.Path(), default=None, help="Feature file or folder (overrides io.features.path).")
@click.option("--prompts", type=click.Path(dir_okay=False), default=None,
              help="Token prompts 'utt-id label ...' per line (overrides io.prompts); without features and "
                   "without an encoder, the prompts are the utterances (text generation).")
@click.option("--prompts-format", type=click.Choice(defaults.PROMPT_FORMATS), default=None,
              help="How the prompt file writes labels (overrides io.prompts_format): 'ids' (label indices) or "
                   "'text' (labels of the vocabulary).")
@click.option("--output", type=click.Path(file_okay=False), default=None, help="Output folder (overrides io.output).")
@click.option("--references", type=click.Path(dir_okay=False), default=None,
              help="Reference transcripts 'utt-id words...' for WER/CER (overrides io.references).")
@click.option("-o", "--override", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override any config key, e.g. -o search.beam_size=8 -o runtime.device=cuda.")
@click.option("--resume", is_flag=True, help="Continue a stopped run: skip utterances already in the output. "
                                             "Refused where the output's results come from another config, "
                                             "other model files or another gpudecode version.")
@click.option("--force", is_flag=True, help="With --resume: continue even where the run differs (the earlier "
                                            "resolved config and identity are kept, numbered).")
@click.option("--engine", type=click.Choice(defaults.ENGINES), default=None,
              help=f"Where to decode (overrides runtime.engine.type; default {defaults.ENGINE}): this "
                   "process, or a pool of decoder actors on a Ray cluster (needs the `ray` extra).")
@click.option("--address", default=None,
              help="Ray cluster to use (overrides runtime.engine.address): host:port of a head started "
                   "with `ray start --head`, 'auto', or 'local' for a new local cluster.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Decoder actors on Ray (overrides runtime.engine.workers; default: one per GPU, or per "
                   "CPU, of the cluster).")
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=None,
              help="GPUs per Ray worker (overrides runtime.engine.gpus_per_worker; 0.5: two workers share "
                   "a GPU).")
@click.option("--timings", type=click.Path(dir_okay=False), default=None, hidden=True,
              help="Write the run's counts and timings (RunTimings) as JSON to this file (for bench e2e).")
def decode(config: str, features: str | None, prompts: str | None, prompts_format: str | None,
           output: str | None, references: str | None, overrides: tuple[str, ...], resume: bool, force: bool,
           engine: str | None, address: str | None, workers: int | None, gpus_per_worker: float | None,
           timings: str | None) -> None:
    """Decode the features (or token prompts) named by CONFIG (YAML) and write text / n-best / CTM results.

    Exit status: 0 done, 1 an error (one 'Error:' line), 2 a usage error, 130 interrupted by SIGINT
    (Ctrl-C), 143 by SIGTERM; what was written is kept and --resume continues.
    """
    import json
    import signal
    import threading
    from pathlib import Path

    if force and not resume:
        raise click.UsageError("--force only applies with --resume")
    settings = []  # the command line's own options, as config keys
    for key, value in (("io.features.path", features), ("io.prompts", prompts), ("io.output", output),
                       ("io.references", references)):
        if value is not None:  # command-line paths are relative to the working directory
            settings.append(f"{key}={Path(value).resolve()}")
    if prompts_format is not None:
        settings.append(f"io.prompts_format={prompts_format}")
    for key, value in (("type", engine), ("address", address), ("workers", workers),
                       ("gpus_per_worker", gpus_per_worker)):
        if value is not None:  # JSON is YAML: an address like host:port stays a string
            settings.append(f"runtime.engine.{key}={json.dumps(value)}")
    where = {"output": Path(output).resolve() if output is not None else None}  # for the messages
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        _decode(config, overrides, settings, resume=resume, force=force, where=where, timings=timings)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (_Terminated)
        code = EXIT_SIGTERM if isinstance(exc, _Terminated) else EXIT_SIGINT
        raise _Failed(_interrupted_message(exc, where["output"]), code) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _decode(config: str, overrides: tuple[str, ...], settings: list[str], *, resume: bool, force: bool,
            where: dict, timings: str | None = None) -> None:
    """``decode`` once the command line is read: the run, its summary, and an ``Error:`` line for each
    failure; ``where["output"]``: the output folder, once known; ``timings``: a file for the run's
    counts and timings (JSON)."""
    import contextlib
    import time
    from pathlib import Path

    from gpudecode.backend import GpuUnavailableError, device_memory_in_use
    from gpudecode.config import ConfigError, check_paths, load_config
    from gpudecode.engines import EngineError
    from gpudecode.io import InputError
    from gpudecode.run import OutOfMemory, SummaryNotSaved, run_decode
    from gpudecode.session import ModelError, SessionError

    try:
        with contextlib.ExitStack() as stack:
            loaded = load_config(config, overrides, settings=settings)
            where["output"] = Path(loaded.io.output)
            check_paths(loaded, source=config)
            bar = None  # opened when decoding starts: no "decoding" before an early error
            started = 0.0
            pool = ""  # per-worker counts on Ray

            def progress(done: int, total: int, real_time_factor: float | None = None) -> None:
                nonlocal bar, started
                if bar is None:
                    bar = stack.enter_context(click.progressbar(length=max(total, 1), label="decoding",
                                                                show_pos=True, file=sys.stderr))
                    started = time.perf_counter()
                if not sys.stderr.isatty():  # a log: the label once, not a line per update
                    return
                rate = done / max(time.perf_counter() - started, 1e-9)
                on_ray = loaded.runtime.engine.type != "local"
                memory = device_memory_in_use() if loaded.runtime.device == "cuda" and not on_ray else None
                bar.label = (f"decoding, {rate:.1f} utt/s"
                             + (f", RTF {real_time_factor:.4f}" if real_time_factor is not None else "")
                             + (f", GPU {memory / 2**20:.0f} MiB" if memory else "") + pool)
                bar.length = max(total, 1)
                bar.update(done - bar.pos)

            def on_status(workers) -> None:
                nonlocal pool
                counts = [f"{w.decoded}" for w in sorted(workers.values(), key=lambda w: w.name)]
                pool = f", workers: {' '.join(counts[:8])}{' ...' if len(counts) > 8 else ''} utt"

            summary = run_decode(loaded, resume=resume, force=force, progress=progress, on_status=on_status)
    except (ConfigError, InputError, ModelError, SessionError, GpuUnavailableError, FileNotFoundError,
            OutOfMemory, EngineError) as exc:
        raise click.ClickException(str(exc)) from exc
    except SummaryNotSaved as exc:  # every result is written; show the summary, then why its file is not
        _echo_summary(exc.summary)
        raise _Failed(f"{exc.error.filename}: {exc.error.strerror or exc.error}; every result is written and the "
                      "WER is shown above, but this file is not saved") from exc
    except OSError as exc:  # disk full, read-only output, ...
        raise _Failed(_os_error_message(exc, where["output"])) from exc
    _echo_summary(summary)
    if timings is not None:
        import json

        Path(timings).write_text(json.dumps({
            "decoded": summary.decoded, "frames": summary.frames, "frame_shift_s": summary.frame_shift_s,
            "seconds": summary.seconds, "timings": summary.timings.to_dict()}, indent=2), encoding="utf-8")


def _echo_summary(summary) -> None:
    width = max(len(k) for k, _ in summary.rows())
    for key, value in summary.rows():
        click.echo(f"{key:<{width}}  {value}")
    for problem in summary.skipped:
        click.echo(f"skipped: {problem}", err=True)
    for line in summary.warnings():
        click.echo(line, err=True)


@main.command()
@click.argument("model", type=click.Path())  # a file, or a GenAI model folder
@click.option("--io-map", "io_map", multiple=True, metavar="LOGICAL=NAME",
              help="Map a logical tensor name (token, prefix-length, scores, ...) to the model's own.")
def inspect(model: str, io_map: tuple[str, ...]) -> None:
    """Show MODEL's inputs, outputs, state variables with time axes, and its convention."""
    from gpudecode.inspect import describe_model
    from gpudecode.session.discovery import ModelError

    try:
        click.echo(describe_model(model, _parse_pairs(io_map, "--io-map")))
    except (FileNotFoundError, ModelError) as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the prepared model.")
@click.option("--float16", is_flag=True, help="Weights and activations in float16, logits float32.")
@click.option("--attention", type=click.Choice(["auto", "gqa", "none"]), default="auto", show_default=True,
              help="Fuse the self-attention as GroupQueryAttention over a left-aligned cache (auto, gqa) or leave it.")
@click.option("--check", is_flag=True, help="Prove the prepared model equals the original (steps and a short decode).")
@click.option("--prefill-model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The prompt model for --check's decode (default: decoder_model.onnx next to a one-label step model).")
def prepare(model: str, output: str, float16: bool, attention: str, check: bool, prefill_model: str | None) -> None:
    """Rewrite MODEL (a decoder step export) into the form the fast path uses; print what was done."""
    from gpudecode.prepare.api import prepare_model

    try:
        report = prepare_model(model, output, float16=float16, attention=attention, check=check,
                               prefill_model=prefill_model)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(report.table())
    if attention == "gqa" and not report.fused:
        raise _Failed(f"{model}: --attention gqa: the attention stayed unfused ({report.reason})")
    if not report.passed:
        raise _Failed(f"{model}: --check failed: the prepared model differs from the original")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v)
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


def _stop_test(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or min(values) < 1:
        raise click.BadParameter(f"expected LAG,EVERY, two integers >= 1, got {text!r}", param_hint="--stop-test")
    return values


@main.group()
def bench() -> None:
    """Benchmarks; each measures its baseline in the same run and reports ratios (JSON + PNG)."""


#: Options of both decoder benches.
_DECODER_EXPORT = click.option(
    "--decoder-export", "export", type=click.Choice(["new-step", "fused", "dmmha", "fused-gqa", "full-history",
                                                      "ragged", "gqa"]),
    default="new-step", show_default=True,
    help="The decoder's state outputs: the new step alone with fused QKV, the same as ONNX Runtime's transformer "
         "optimizer writes it (SkipLayerNormalization, cross-attention as MultiHeadAttention, left-aligned "
         "histories; *-fused.json), fused with ONNX Runtime's DecoderMaskedMultiHeadAttention (CUDA; its in-place "
         "caches are the state outputs; *-dmmha.json) or GroupQueryAttention (float16, CUDA; *-fused-gqa.json), the past with the new step appended "
         "(*-full-history.json), or new-step with attention over each row's own history: ONNX Attention "
         "(*-ragged.json) or ONNX Runtime's GroupQueryAttention, float16 on CUDA (*-gqa.json).")
_DTYPE = click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
                      help="The decoder's float type (*-float16.json).")
_HOST_WAIT = click.option("--host-wait", type=click.Choice(["nap", "block", "spin"]), default="nap",
                          show_default=True,
                          help="How the host waits for the GPU: poll with naps between polls, 100 µs doubling up to "
                               "1 ms (the library's default), sleep in the driver (*-block.json), or poll (*-spin.json).")


def _run_bench(module: str, function: str, **options) -> None:
    """Runs ``gpudecode.bench.<module>.<function>(**options)`` and prints its table; a missing GPU
    is a clean CLI error."""
    import importlib

    from gpudecode.backend import GpuUnavailableError

    bench_module = importlib.import_module(f"gpudecode.bench.{module}")
    try:
        results = getattr(bench_module, function)(**options)
    except GpuUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(bench_module.format_table(results))


@bench.command("state-copy")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for state_copy.json and state_copy.png.")
@click.option("--hypotheses", default="64,256,1024,4096", show_default=True, help="Comma-separated.")
@click.option("--histories", default="16,64,128,512", show_default=True, help="Comma-separated token counts.")
@click.option("--storage-dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="Pool storage dtype (default: the model's).")
@click.option("--repeats", type=int, default=10, show_default=True)
def bench_state_copy(output: str, hypotheses: str, histories: str, storage_dtype: str | None, repeats: int) -> None:
    """Merge and split GB/s against a plain device-to-device copy of the same bytes (fragmented pool)."""
    _run_bench("state_copy", "run_state_copy_bench", hypotheses=_int_list(hypotheses),
               histories=_int_list(histories), storage_dtype=storage_dtype, repeats=repeats,
               output_dir=output)
    click.echo(f"written: {output}/state_copy.json, {output}/state_copy.png")


@bench.command("decode")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for decode.json and decode.png.")
@click.option("--utterances", type=int, default=64, show_default=True)
@click.option("--encoder-length", type=int, default=200, show_default=True)
@click.option("--labels", "num_labels", type=int, default=50, show_default=True, help="Output labels per utterance.")
@click.option("--quick", is_flag=True, help="A small decoder (for a smoke test), not the reference sizes.")
@click.option("--cuda-graphs", is_flag=True, help="Run the CUDA-manager cells with CUDA graphs (decode-graphs.json).")
@click.option("--utterance-rows", type=click.Choice(["utterance", "lane"]), default="utterance", show_default=True,
              help="The decoder's cross-attention keys/values: one row per utterance, or per hypothesis (*-lane.json).")
@click.option("--tf32", is_flag=True, help="The decoder's matrix products on TF32 tensor cores (*-tf32.json); "
              "off by default, as in the library.")
@_HOST_WAIT
@click.option("--beams", default="1,4,8,16", show_default=True, help="Comma-separated; must include 1 and 8.")
@click.option("--control-delay-ms", type=float, default=0.0, show_default=True,
              help="Add a control cell: beam 1 with this GPU delay per step, so the host waits as at 4,096 "
                   "hypotheses (0: none).")
@click.option("--rounds", type=int, default=5, show_default=True,
              help="Timed rounds per CUDA-manager cell, interleaved across the cells; each cell's fastest counts.")
@click.option("--graph-time-step", type=int, default=None,
              help="History bucket step of the CUDA graphs (default: the library's; *-step<N>.json).")
@click.option("--stop-test", default=None, metavar="LAG,EVERY",
              help="Read the search's stop flag LAG posts late and post it every EVERY steps "
                   "(*-stop<LAG>x<EVERY>.json); default: the library's (2,1).")
@_DECODER_EXPORT
@_DTYPE
def bench_decode(output: str, utterances: int, encoder_length: int, num_labels: int, quick: bool,
                 cuda_graphs: bool, utterance_rows: str, tf32: bool, host_wait: str, beams: str,
                 control_delay_ms: float, rounds: int, graph_time_step: int | None, stop_test: str | None,
                 export: str, dtype: str) -> None:
    """Attention-decoder search: CUDA vs CPU state manager, beam 8 vs 1, host time 4,096 vs 64 hypotheses."""
    _run_bench("decode", "run_decode_bench", num_utts=utterances, encoder_length=encoder_length,
               num_labels=num_labels, output_dir=output, quick=quick, cuda_graphs=cuda_graphs,
               utterance_rows=utterance_rows, tf32=tf32, host_wait=host_wait, beams=_int_list(beams),
               rounds=rounds, export=export, control_delay_ms=control_delay_ms, dtype=dtype,
               graph_time_step=graph_time_step, stop_test=None if stop_test is None else _stop_test(stop_test))


@bench.command("graphs")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for graphs.json and graphs.png.")
@click.option("--small", "small_utts", type=int, default=4, show_default=True, help="Utterances of the small batch.")
@click.option("--large", "large_utts", type=int, default=128, show_default=True, help="Utterances of the large batch.")
@click.option("--beam", type=int, default=8, show_default=True)
@click.option("--labels", "num_labels", type=int, default=50, show_default=True, help="Output labels per utterance.")
@click.option("--quick", is_flag=True, help="A small decoder (for a smoke test), not the reference sizes.")
def bench_graphs(output: str, small_utts: int, large_utts: int, beam: int, num_labels: int, quick: bool) -> None:
    """CUDA graphs off vs on: time per step at <= 32 and >= 1,024 hypotheses; graph memory with
    shared vs per-bucket buffers."""
    _run_bench("graphs", "run_graphs_bench", small_utts=small_utts, large_utts=large_utts,
               beam=beam, num_labels=num_labels, output_dir=output, quick=quick)


@bench.command("batching")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for batching.json and batching.png.")
@click.option("--utterances", type=int, default=512, show_default=True)
@click.option("--max-active", type=int, default=64, show_default=True, help="Utterances in flight.")
@click.option("--beam", type=int, default=8, show_default=True)
@click.option("--quick", is_flag=True, help="A small decoder (for a smoke test), not the reference sizes.")
@click.option("--cuda-graphs", is_flag=True, help="Decoder step as CUDA graphs in both modes (batching-graphs.json).")
@click.option("--max-batch-size", type=int, default=None,
              help="Lanes per decoder call (each call pads to its own longest history; "
                   "batching-calls<N>.json); default: all lanes.")
@click.option("--utterance-rows", type=click.Choice(["utterance", "lane"]), default="utterance", show_default=True,
              help="The decoder's cross-attention keys/values: one row per utterance, or per hypothesis (*-lane.json).")
@_DECODER_EXPORT
@_DTYPE
@click.option("--rounds", type=int, default=5, show_default=True,
              help="Timed rounds of both modes, the order alternating; each mode's fastest counts.")
@_HOST_WAIT
def bench_batching(output: str, utterances: int, max_active: int, beam: int, quick: bool, cuda_graphs: bool,
                   max_batch_size: int | None, utterance_rows: str, export: str, dtype: str, rounds: int,
                   host_wait: str) -> None:
    """Continuous vs static batching on varied output lengths (utterances/s, steps, lane occupancy)."""
    _run_bench("batching", "run_batching_bench", num_utts=utterances, max_active=max_active,
               beam=beam, quick=quick, output_dir=output, cuda_graphs=cuda_graphs, max_batch_size=max_batch_size,
               utterance_rows=utterance_rows, export=export, dtype=dtype, rounds=rounds, host_wait=host_wait)


@bench.command("ctc")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for ctc.json and ctc.png.")
@click.option("--utterances", type=int, default=64, show_default=True)
@click.option("--frames", type=int, default=10_000, show_default=True, help="Frames of log-probs per utterance.")
@click.option("--vocab-sizes", default="1000,5000", show_default=True, help="Comma-separated.")
@click.option("--beams", default="1,8,16", show_default=True, help="Comma-separated.")
@click.option("--encoder-frames", type=int, default=1000, show_default=True,
              help="Input frames per utterance for the end-to-end beam ÷ greedy with the pinned encoder.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed runs per cell; the fastest counts.")
def bench_ctc(output: str, utterances: int, frames: int, vocab_sizes: str, beams: str, encoder_frames: int,
              repeats: int) -> None:
    """CTC prefix search frames/s (with and without an LSTM LM) and end-to-end beam 8 ÷ greedy."""
    _run_bench("ctc", "run_ctc_bench", num_utts=utterances, num_frames=frames,
               vocab_sizes=_int_list(vocab_sizes), beams=_int_list(beams),
               encoder_frames=encoder_frames, repeats=repeats, output_dir=output)


@bench.command("cpu")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for cpu.json and cpu.png.")
@click.option("--utterances", type=int, default=64, show_default=True, help="CTC log-prob matrices.")
@click.option("--frames", type=int, default=500, show_default=True, help="Frames per CTC matrix.")
@click.option("--classes", type=int, default=80, show_default=True, help="CTC classes (blank included).")
@click.option("--beams", default="8,25", show_default=True, help="CTC beams, comma-separated.")
@click.option("--ctc-inputs", default="peaky,flat", show_default=True,
              help="CTC log-probs, comma-separated: peaky (like a trained model's), flat (bench ctc's random ones).")
@click.option("--prompts", type=int, default=16, show_default=True, help="Prompts of the LM comparisons.")
@click.option("--parts", default="ctc,genai,gpt2", show_default=True,
              help="Comma-separated: ctc (pyctcdecode), genai (ONNX Runtime GenAI), gpt2 (transformers generate).")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed runs per cell; the fastest counts.")
def bench_cpu(output: str, utterances: int, frames: int, classes: int, beams: str, ctc_inputs: str, prompts: int,
              parts: str, repeats: int) -> None:
    """The CPU path against pyctcdecode, ONNX Runtime GenAI and transformers generate, one thread each side
    (each peer where it imports)."""
    _run_bench("cpu", "run_cpu_bench", num_utts=utterances, num_frames=frames, vocab_size=classes,
               beams=_int_list(beams), ctc_inputs=tuple(i.strip() for i in ctc_inputs.split(",") if i.strip()),
               lm_prompts=prompts,
               parts=tuple(p.strip() for p in parts.split(",") if p.strip()), repeats=repeats, output_dir=output)


@bench.command("peers")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for peers.json and peers.png (peers-cpu.*, *-float16.*: the CPU, float16 runs).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--shapes", default="6x512,12x768x50000", show_default=True,
              help="LAYERSxWIDTH[xVOCAB], comma-separated (widths: multiples of 64, heads of 64).")
@click.option("--vocab", type=int, default=10000, show_default=True, help="The vocabulary of a shape without one.")
@click.option("--beams", default="1,8", show_default=True, help="Comma-separated.")
@click.option("--prompts", default="64,256", show_default=True, help="Prompt counts, comma-separated.")
@click.option("--genai-prompts", type=int, default=32, show_default=True,
              help="Prompts of the GenAI cells (its search takes at most 32).")
@click.option("--new-tokens", type=int, default=48, show_default=True, help="Labels every side decodes (EOS masked).")
@click.option("--prompt-length", type=int, default=8, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--families", default="gpt2,llama", show_default=True, help="Comma-separated: gpt2, llama.")
@click.option("--compile/--no-compile", "compile_", default=False, show_default=True,
              help="Also generate with a static cache and torch.compile.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True, help="The toolkit's, on CUDA.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed runs per cell; the fastest counts.")
@click.option("--threads", type=int, default=0, show_default=True,
              help="CPU threads of every side (torch, ONNX Runtime, GenAI); 0: each library's default.")
def bench_peers(output: str, device: str, shapes: str, vocab: int, beams: str, prompts: str, genai_prompts: int,
                new_tokens: int, prompt_length: int, dtype: str, families: str, compile_: bool, cuda_graphs: bool,
                repeats: int, threads: int) -> None:
    """The toolkit (on the standard export and on the prepared one) against transformers generate and
    ONNX Runtime GenAI on the same random-initialised weights and prompts (extra bench-peers)."""
    from gpudecode.bench.peers import options_from_text, output_name

    try:
        options = options_from_text(device=device, shapes=shapes, vocab=vocab, beams=beams, prompts=prompts,
                                    genai_prompts=genai_prompts, new_tokens=new_tokens, prompt_length=prompt_length,
                                    dtype=dtype, families=families, compile=compile_, graphs=cuda_graphs,
                                    repeats=repeats, threads=threads)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    _run_bench("peers", "run_peers_bench", options=options, output_dir=output, name=output_name(options))


@bench.command("transducer")
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for transducer.json and transducer.png.")
@click.option("--utterances", type=int, default=64, show_default=True)
@click.option("--encoder-frames", type=int, default=1000, show_default=True, help="Input frames per utterance.")
@click.option("--beams", default="1,4,8", show_default=True, help="Comma-separated.")
@click.option("--max-symbols-per-frame", type=int, default=1, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed runs per cell; the fastest counts.")
@click.option("--lm-beam", type=click.IntRange(min=0), default=8, show_default=True,
              help="Beam of the cell with an LSTM LM fused (its cost against the same beam without); 0: none.")
def bench_transducer(output: str, utterances: int, encoder_frames: int, beams: str, max_symbols_per_frame: int,
                     repeats: int, lm_beam: int) -> None:
    """Transducer search frames/s at several beams, with an LSTM LM fused at one, and end-to-end
    beam 8 ÷ greedy (pinned encoder)."""
    _run_bench("transducer", "run_transducer_bench", num_utts=utterances,
               encoder_frames=encoder_frames, beams=_int_list(beams),
               max_symbols_per_frame=max_symbols_per_frame, lm_beam=lm_beam or None, repeats=repeats,
               output_dir=output)


@bench.command("e2e")
@click.argument("configs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--output", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Folder for <name>.json and <name>.png.")
@click.option("--name", default="e2e", show_default=True, help="Name of the JSON and PNG files.")
@click.option("--features", type=click.Path(exists=True), default=None,
              help="The corpus (default: each config's io.features), e.g. examples/fsdd/data/test/feats.h5.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Decode the corpus N times, under ids <id>-r1 .. <id>-rN.")
@click.option("--devices", default=None, help="Comma-separated: cuda, cpu (default: cuda,cpu where a GPU is "
                                              "usable, else cpu); each in its own process.")
@click.option("-o", "--override", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="A config override of every run (as for decode).")
@click.option("--results", type=click.Path(file_okay=False), default=None,
              help="Keep each run's results in RESULTS/<config stem>/<device> (default: a temporary folder).")
@click.option("--warm-up", type=click.IntRange(min=0), default=None,
              help="Utterances of an untimed run of each config and device before its measured run, so "
                   "that kernels compiled once per machine are not measured (0: none; default: a few dozen).")
def bench_e2e(configs: tuple[str, ...], output: str, name: str, features: str | None, repeat: int,
              devices: str | None, overrides: tuple[str, ...], results: str | None, warm_up: int | None) -> None:
    """`gpudecode decode` of a corpus end to end, each CONFIG on each device in a fresh process:
    utterances/s, RTFx (start-up excluded), time to first result, start-up and where the time goes."""
    from gpudecode.bench.e2e import E2eError, E2eOptions, default_devices

    try:
        options = E2eOptions(configs=configs, features=features, repeat=repeat, overrides=overrides,
                             devices=default_devices() if devices is None
                             else tuple(d.strip() for d in devices.split(",") if d.strip()), results=results,
                             **({} if warm_up is None else {"warm_up": warm_up}))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    try:
        _run_bench("e2e", "run_e2e_bench", options=options, output_dir=output, name=name)
    except E2eError as exc:
        raise click.ClickException(str(exc)) from exc
