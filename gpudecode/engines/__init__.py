"""Engines: where one decoding job runs.

- ``local``: this process (``gpudecode.run.run_decode`` itself), the embedded default;
- ``ray``: a pool of decoder actors on a Ray cluster (``gpudecode.engines.ray_engine``); needs
  the ``ray`` extra (``pip install 'gpudecode[ray]'``).

Both read the same config, decode with ``Decoder.decode_batch`` on the same length-bucketed
batches and write through the same ``ResultWriter``, so ``--resume`` works across engines.
Nothing here imports Ray until the ``ray`` engine is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpudecode.engines.base import EngineError, import_ray

__all__ = ["EngineError", "import_ray", "run_on_engine"]


def run_on_engine(config, *, done: set[str], resume: bool,
                  progress: Callable[[int, int], None] | None = None,
                  on_status: Callable[[Mapping], None] | None = None):
    """Run ``config`` on ``config.runtime.engine.type`` (any engine but ``local``); returns a
    ``RunSummary``. ``done``: utterance ids already in the output (skipped when resuming)."""
    if config.runtime.engine.type == "ray":
        from gpudecode.engines.ray_engine import run_decode_ray

        return run_decode_ray(config, done=done, resume=resume, progress=progress, on_status=on_status)
    raise AssertionError(f"engine {config.runtime.engine.type!r} has no runner (a bug in gpudecode.engines)")
