"""Random feeds for any model, from its declared inputs (symbolic dims get the sizes given)."""

import numpy as np

from gpudecode.session import from_onnx_model


def random_feeds(model, *, batch=3, past=5, frames=7, vocab=12, seed=0):
    """Feeds with ragged prefix and encoder lengths; the padding holds garbage on purpose."""
    rng = np.random.default_rng(seed)
    feeds = {}
    prefix = rng.integers(0, past + 1, batch).astype(np.int32)
    prefix[0] = past
    sizes = rng.integers(1, frames + 1, batch).astype(np.int32)
    sizes[0] = frames
    for info in from_onnx_model(model, "model").inputs:
        dims = []
        for axis, d in enumerate(info.shape):
            if isinstance(d, int):
                dims.append(d)
            elif axis == 0:
                dims.append(batch)
            elif d in ("time", "past", "past_time"):
                dims.append(past)
            elif str(d).startswith("total") or d == "time+1":
                dims.append(past + 1)
            else:
                dims.append(frames)
        if info.name in ("prefix-length",):
            value = prefix
        elif info.name == "encoder-states-size" or info.name == "features-size":
            value = sizes
        elif info.name == "token-length":
            value = np.ones(batch, np.int32)
        elif info.dtype.kind in "iu":
            value = rng.integers(0, vocab, dims)
        else:
            value = rng.standard_normal(dims)
        feeds[info.name] = np.asarray(value).astype(info.dtype)
    return feeds
