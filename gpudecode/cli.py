"""The `gpudecode` command line."""

from __future__ import annotations

import click

from gpudecode import __version__


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


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v)
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


@main.group()
def bench() -> None:
    """Benchmarks; each measures its baseline in the same run and reports ratios (JSON + PNG)."""


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
    from gpudecode.backend import GpuUnavailableError
    from gpudecode.bench.state_copy import format_table, run_state_copy_bench

    try:
        results = run_state_copy_bench(
            hypotheses=_int_list(hypotheses), histories=_int_list(histories), storage_dtype=storage_dtype,
            repeats=repeats, output_dir=output,
        )
    except GpuUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_table(results))
    click.echo(f"written: {output}/state_copy.json, {output}/state_copy.png")
