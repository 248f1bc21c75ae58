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
