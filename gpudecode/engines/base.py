"""What the engines share: their error, and importing Ray only when an engine needs it."""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine that cannot run (Ray not installed, a cluster without the resources asked
    for), or a worker that failed in a way the engine cannot recover from."""


def import_ray():
    """The ``ray`` module (with Ray Data), or an ``EngineError`` naming the extra to install."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise EngineError(
            "runtime.engine.type 'ray' needs Ray (with Ray Data), which cannot be imported here: "
            f"{exc}. Install the `ray` extra: pip install 'gpudecode[ray]'") from exc
    return ray
