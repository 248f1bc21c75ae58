"""Adapters for the Hugging Face decoder-with-past convention (and GenAI's left-aligned variant)."""

from __future__ import annotations

import numpy as np

from gpudecode.backend import get_array_module


def hf_attention_inputs(prefix_length, past_time: int, num_new: int = 1, alignment: str = "right"):
    """``attention_mask`` [N, T+S] and ``position_ids`` [N, S] (int64) from prefix lengths [N].

    ``right``: the history is right-aligned in the T past positions (left padding), so the last
    ``prefix_length`` past positions and the S new ones are valid. ``left`` (GroupQueryAttention
    fed from the mask, as ONNX Runtime GenAI's exports): each row's history fills its first
    ``prefix_length`` positions, and the mask is ones over the row's first ``prefix_length + S``
    positions (the model derives each row's length from the mask's sum and writes the new steps
    right after the history). New token p sits at position ``prefix_length + p`` either way.
    Works on numpy and CuPy arrays alike.
    """
    xp = get_array_module(prefix_length)
    prefix = xp.asarray(prefix_length).astype(xp.int64)
    columns = xp.arange(past_time + num_new, dtype=xp.int64)
    if alignment == "left":
        attention_mask = (columns[None, :] < (prefix + num_new)[:, None]).astype(xp.int64)
    else:
        attention_mask = (columns[None, :] >= (past_time - prefix)[:, None]).astype(xp.int64)
    position_ids = prefix[:, None] + xp.arange(num_new, dtype=xp.int64)[None, :]
    return attention_mask, position_ids


#: the mask / position dtypes :func:`write_attention_inputs` writes in one launch, by kernel suffix
_STEP_INPUT_KERNELS = {np.dtype(np.int64): "i64", np.dtype(np.int32): "i32"}
_THREADS = 256


def write_attention_inputs(prefix_length, past_time: int, alignment: str, attention_mask=None, position_ids=None):
    """:func:`hf_attention_inputs` of one new step written into ``attention_mask`` [N, T+1] and
    ``position_ids`` [N, 1] (either may be None): on CuPy, int32 or int64 contiguous outputs of one
    dtype, one launch (``kernels/hf_inputs.cu``); anything else through the arrays."""
    outputs = [a for a in (attention_mask, position_ids) if a is not None]
    xp = get_array_module(prefix_length)
    kind = _STEP_INPUT_KERNELS.get(outputs[0].dtype) if outputs else None
    if (xp is np or kind is None or any(a.dtype != outputs[0].dtype or not a.flags.c_contiguous for a in outputs)
            or (attention_mask is not None and attention_mask.shape != (prefix_length.shape[0], past_time + 1))
            or (position_ids is not None and position_ids.shape != (prefix_length.shape[0], 1))):
        mask, positions = hf_attention_inputs(prefix_length, past_time, alignment=alignment)
        for out, value in ((attention_mask, mask), (position_ids, positions)):
            if out is not None:
                out[...] = value
        return
    from gpudecode.kernels import kernel_function

    rows = int(prefix_length.shape[0])
    count = rows * (past_time + 1 if attention_mask is not None else 1)
    if count == 0:
        return
    kernel_function("hf_inputs", f"hf_step_inputs_{kind}", prefix_length.device.id)((-(-count // _THREADS),), (_THREADS,), (
        xp.ascontiguousarray(prefix_length, dtype=np.int32), np.int64(rows), np.int64(past_time), np.int32(1),
        np.int32(alignment == "left"), np.uint64(0) if attention_mask is None else attention_mask,
        np.uint64(0) if position_ids is None else position_ids))


def hf_length_inputs(prefix_length, past_time: int, num_new: int = 1):
    """GroupQueryAttention's explicit length inputs, for a model that takes them: ``seqlens_k``
    [N] int32 (each row's valid positions minus one: history + new steps - 1) and
    ``total_sequence_length`` (a scalar int32, T + S, on the host)."""
    xp = get_array_module(prefix_length)
    seqlens = (xp.asarray(prefix_length).astype(xp.int32) + np.int32(num_new - 1)).astype(xp.int32)
    return seqlens, np.array(past_time + num_new, dtype=np.int32)


def new_step_states(present, prefix_length, time_axis: int, alignment: str, *, index_cache: dict | None = None):
    """The new step's states [.., 1, ..] of a state output holding the whole history plus the new
    step: at the last time position (``right``) or at each row's own length (``left``: the row's
    history first); an output of one time step is returned as it is. Batch axis 0.

    ``left`` on a C-contiguous output is one ``take`` of the new step's flat positions; those are
    computed once per output shape and kept in ``index_cache`` (a dict, for the outputs of one call:
    every layer's keys and values share one index)."""
    if present.shape[time_axis] == 1:
        return present
    if alignment != "left":
        index = [slice(None)] * present.ndim
        index[time_axis] = slice(-1, None)
        return present[tuple(index)]
    xp = get_array_module(present)
    if not present.flags.c_contiguous:
        shape = [1] * present.ndim
        shape[0] = present.shape[0]
        index = xp.asarray(prefix_length).astype(xp.int64).reshape(shape)
        return xp.take_along_axis(present, index, axis=time_axis)
    key = (tuple(present.shape), time_axis)
    flat = None if index_cache is None else index_cache.get(key)
    if flat is None:
        flat = _new_step_positions(xp, present.shape, prefix_length, time_axis)
        if index_cache is not None:
            index_cache[key] = flat
    return present.reshape(-1).take(flat)


def _new_step_positions(xp, shape, prefix_length, time_axis: int):
    """Flat positions [.., 1, ..] (int64) in a C-contiguous array of ``shape`` of each row's
    element at time ``prefix_length[row]`` (batch axis 0)."""
    strides = np.cumprod((1, *shape[:0:-1]))[::-1]  # element strides of a C-contiguous array
    out_shape = [*shape]
    out_shape[time_axis] = 1
    rows = xp.asarray(prefix_length).astype(xp.int64)[: shape[0]]
    along = [1] * len(shape)
    along[0] = shape[0]
    flat = (rows * int(strides[time_axis])).reshape(along)
    for axis, size in enumerate(shape):
        if axis == time_axis or size == 1:
            continue
        along = [1] * len(shape)
        along[axis] = size
        flat = flat + (xp.arange(size, dtype=xp.int64) * int(strides[axis])).reshape(along)
    return xp.ascontiguousarray(xp.broadcast_to(flat, out_shape))


def hf_encoder_attention_mask(sizes, time_size: int):
    """``encoder_attention_mask`` [U, S] (bool, True = valid) of encoder states ``sizes`` [U]
    padded to ``time_size`` frames, on the array module of ``sizes``."""
    xp = get_array_module(sizes)
    return xp.arange(time_size)[None, :] < sizes.reshape(-1, 1)
