"""Adapters for the Hugging Face decoder-with-past convention."""

from __future__ import annotations

from gpudecode.backend import get_array_module


def hf_attention_inputs(prefix_length, past_time: int, num_new: int = 1):
    """``attention_mask`` [N, T+S] and ``position_ids`` [N, S] (int64) from prefix lengths [N].

    The history is right-aligned in the T past positions (left padding), so the last
    ``prefix_length`` past positions and the S new ones are valid; new token p sits at position
    ``prefix_length + p``. Works on numpy and CuPy arrays alike.
    """
    xp = get_array_module(prefix_length)
    prefix = xp.asarray(prefix_length).astype(xp.int64)
    columns = xp.arange(past_time + num_new, dtype=xp.int64)
    attention_mask = (columns[None, :] >= (past_time - prefix)[:, None]).astype(xp.int64)
    position_ids = prefix[:, None] + xp.arange(num_new, dtype=xp.int64)[None, :]
    return attention_mask, position_ids


def hf_encoder_attention_mask(sizes, time_size: int):
    """``encoder_attention_mask`` [U, S] (bool, True = valid) of encoder states ``sizes`` [U]
    padded to ``time_size`` frames, on the array module of ``sizes``."""
    xp = get_array_module(sizes)
    return xp.arange(time_size)[None, :] < sizes.reshape(-1, 1)
