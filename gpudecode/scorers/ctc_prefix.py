"""``ctc-prefix``: the CTC prefix score of label-synchronous hypotheses (Watanabe et al. 2017).

For joint CTC/attention decoding (ESPnet's CTCPrefixScorer, RASR's ``ctc-prefix``): the score of
label ``c`` after hypothesis ``g`` is ``log ψ(g + c) − log ψ(g)``, where ψ(h) is the probability
that the CTC label sequence starts with ``h`` (the sum over all alignments whose label sequence
has prefix h). For ``c = sentence_end`` it is the full-sequence probability ``log P(g | x) −
log ψ(g)``, so a terminated hypothesis has accumulated exactly ``log P(g | x)``; blank scores
−inf (it is no label).

Per lane the context keeps the forward variables of its prefix over all frames: ``r_label`` and
``r_blank`` [T + 1, N] (alignments of frames 0..t that spell g and end in its last label / in
blank; row 0 is "before frame 0"), ``ψ(g)`` and the last label. Scoring K candidate labels runs
the recursion over the frames for all N × K (lane, label) pairs at once and keeps the candidates'
forward variables, so ``extend`` is a gather. On numpy (the oracle) this is a Python loop over
frames of array operations; on CuPy ``score_candidates`` and ``extend`` are one launch each of
``kernels/ctc_prefix_score.cu`` (a thread per pair runs the frames), with no host synchronisation.

Per-utterance input: frame log-probs ``UtteranceBatch.inputs["log-probs"]`` [U, T, V] with
their sizes (``UtteranceBatch.size_of``), written once per lane group at ``admit`` (a
time-major [T, G, V] buffer; every lane reads its group's rows, so nothing is copied per lane or
per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpudecode.backend import to_host
from gpudecode.scorers.base import Context, LabelScorer, LaneLayout, UtteranceBatch
from gpudecode.scorers.registry import register_scorer
from gpudecode.sizes import next_power_of_two

_NEG_INF = np.float32(-np.inf)
_THREADS = 128  # PREFIX_THREADS of kernels/ctc_prefix_score.cu


@dataclass
class CtcPrefixContext:
    """Per lane: forward variables of the prefix (time-major, row 0 = before frame 0)."""

    r_label: Any  # [T + 1, N] float32
    r_blank: Any  # [T + 1, N] float32
    prefix_logp: Any  # [N] float32, log ψ(g)
    last: Any  # [N] int64, last label (-1: empty prefix)
    # set by score()/score_candidates(): (labels [N, K], r_label [T+1, N, K], r_blank, ψ [N, K])
    scored: tuple | None = None


@register_scorer("ctc-prefix")
class CtcPrefixScorer(LabelScorer):
    """CTC prefix scores of label extensions, from per-utterance frame log-probs.

    ``vocab_size``: V of the frame log-probs (shared with the other scorers); ``blank``: the CTC
    blank index; ``sentence_end``: the label that ends a hypothesis (scored with the full-sequence
    probability); ``input_name``: the per-utterance input holding the log-probs [U, T, V].
    """

    #: Scored only on the pre-beam candidates of the other scorers (``score_candidates``).
    partial_scoring = True

    def __init__(self, *, vocab_size: int, sentence_end: int, blank: int = 0,
                 input_name: str = "log-probs") -> None:
        for name, value in (("blank", blank), ("sentence_end", sentence_end)):
            if not 0 <= value < vocab_size:
                raise ValueError(f"ctc-prefix: {name} {value} is outside the vocabulary [0, {vocab_size})")
        if blank == sentence_end:
            raise ValueError(f"ctc-prefix: blank and sentence_end must differ, both are {blank}")
        self.vocab_size = int(vocab_size)
        self.blank = int(blank)
        self.sentence_end = int(sentence_end)
        self.input_name = input_name

    # --- lifecycle -----------------------------------------------------------------------------
    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        xp = layout.xp
        self._log_probs = xp.zeros((1, layout.num_groups, self.vocab_size), dtype=np.float32)  # [T, G, V]
        self._sizes = xp.zeros(layout.num_groups, dtype=np.int64)  # [G]
        self._group = layout.lane_groups()  # [N]

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Writes each utterance's frame log-probs [T, V] and size into its group (once)."""
        xp = self.layout.xp
        if self.input_name not in utterances.inputs:
            raise ValueError(f"ctc-prefix: the utterances bring no input {self.input_name!r} "
                             f"(they have {sorted(utterances.inputs)})")
        data = xp.asarray(utterances.inputs[self.input_name]).astype(np.float32, copy=False)
        if data.ndim != 3 or data.shape[2] != self.vocab_size:
            raise ValueError(f"ctc-prefix: input {self.input_name!r} must be [U, T, V={self.vocab_size}], "
                             f"got shape {tuple(data.shape)}")
        num_frames = data.shape[1]
        if num_frames > self._log_probs.shape[0]:  # grow the time axis, rounded up
            grown = xp.zeros((next_power_of_two(num_frames), self.layout.num_groups, self.vocab_size), np.float32)
            grown[: self._log_probs.shape[0]] = self._log_probs
            self._log_probs = grown
        groups_dev = xp.asarray(np.asarray(groups, dtype=np.int64))
        self._log_probs[:, groups_dev] = 0
        self._log_probs[:num_frames, groups_dev] = data.transpose(1, 0, 2)
        sizes = np.asarray(to_host(utterances.size_of(self.input_name)), dtype=np.int64)
        if ((sizes < 0) | (sizes > num_frames)).any():
            raise ValueError(f"ctc-prefix: sizes of {self.input_name!r} must lie in [0, {num_frames}], "
                             f"got {sizes.tolist()}")
        self._sizes[groups_dev] = xp.asarray(sizes)

    # --- scoring -------------------------------------------------------------------------------
    def _frames(self):
        """(valid [T, N] bool, blank log-probs [T, N]) for every lane's utterance."""
        xp = self.layout.xp
        num_frames = self._log_probs.shape[0]
        valid = xp.arange(num_frames)[:, None] < self._sizes[self._group][None, :]
        blank = self._log_probs[:, self._group, self.blank]  # [T, N]
        return valid, blank

    def initial_context(self, groups, ctx: Context | None = None) -> CtcPrefixContext:
        """The empty prefix on every lane: only blanks so far."""
        if ctx is not None:
            raise NotImplementedError("admitting into a running search comes with continuous batching")
        xp = self.layout.xp
        valid, blank = self._frames()
        num_lanes = self.layout.num_lanes
        r_blank = xp.concatenate([xp.zeros((1, num_lanes), np.float32),
                                  xp.cumsum(xp.where(valid, blank, np.float32(0)), axis=0)])
        r_label = xp.full(r_blank.shape, _NEG_INF, dtype=np.float32)
        return CtcPrefixContext(r_label=r_label, r_blank=r_blank.astype(np.float32),
                                prefix_logp=xp.zeros(num_lanes, np.float32),
                                last=xp.full(num_lanes, -1, dtype=np.int64))

    def score(self, ctx: CtcPrefixContext):
        """[N, V] prefix-score increments for every label (costs [T, N, V] memory: small V only;
        a search over a large vocabulary calls :meth:`score_candidates`)."""
        xp = self.layout.xp
        labels = xp.broadcast_to(xp.arange(self.vocab_size, dtype=np.int64),
                                 (self.layout.num_lanes, self.vocab_size))
        return self.score_candidates(ctx, labels)

    def score_candidates(self, ctx: CtcPrefixContext, candidate_labels):
        """[N, K] float32: ``log ψ(g + c) − log ψ(g)`` for the labels ``candidate_labels`` [N, K]."""
        xp = self.layout.xp
        labels = xp.asarray(candidate_labels).astype(np.int64, copy=False)
        if xp is not np:  # the scores come with the forward variables, from the same launch
            *forward, scores = self._forward_kernel(ctx, labels)
            ctx.scored = (labels, *forward)
            return scores
        r_label, r_blank, prefix_logp = self._forward(ctx, labels)
        ctx.scored = (labels, r_label, r_blank, prefix_logp)
        possible = xp.isfinite(ctx.prefix_logp)  # ψ(g) = 0: every extension is impossible too
        increment = prefix_logp - xp.where(possible, ctx.prefix_logp, np.float32(0))[:, None]
        return xp.where(possible[:, None], increment, _NEG_INF).astype(np.float32)

    def _forward(self, ctx: CtcPrefixContext, labels):
        """Forward variables [T+1, N, K] and log ψ [N, K] of every (lane, label) extension."""
        xp = self.layout.xp
        if xp is not np:
            return self._forward_kernel(ctx, labels)[:3]
        num_frames = self._log_probs.shape[0]
        valid, blank = self._frames()
        safe = xp.where(labels == self.blank, 0, labels)
        x_label = self._log_probs[:, self._group[:, None], safe]  # [T, N, K]
        repeat = (labels == ctx.last[:, None])[None]  # [1, N, K]
        # φ: alignments of g that a new label c may follow (only blank-ended ones when c repeats)
        phi = xp.where(repeat, ctx.r_blank[:, :, None],
                       xp.logaddexp(ctx.r_blank, ctx.r_label)[:, :, None])  # [T+1, N, K]
        r_label = xp.full((num_frames + 1,) + labels.shape, _NEG_INF, dtype=np.float32)
        r_blank = xp.full_like(r_label, _NEG_INF)
        prefix = xp.full(labels.shape, _NEG_INF, dtype=np.float32)
        for t in range(num_frames):  # row t of phi is "after frame t - 1"
            ok = valid[t][:, None]
            new_label = xp.logaddexp(r_label[t], phi[t]) + x_label[t]
            new_blank = xp.logaddexp(r_blank[t], r_label[t]) + blank[t][:, None]
            prefix = xp.where(ok, xp.logaddexp(prefix, phi[t] + x_label[t]), prefix)
            r_label[t + 1] = xp.where(ok, new_label, r_label[t])
            r_blank[t + 1] = xp.where(ok, new_blank, r_blank[t])
        full = xp.logaddexp(ctx.r_blank[-1], ctx.r_label[-1])  # [N]: log P(g | x)
        prefix = xp.where(labels == self.sentence_end, full[:, None], prefix)
        prefix = xp.where(labels == self.blank, _NEG_INF, prefix)
        return r_label, r_blank, prefix

    def _forward_kernel(self, ctx: CtcPrefixContext, labels):
        """:meth:`_forward`'s three arrays and :meth:`score_candidates`' scores [N, K], from one launch
        of ``ctc_prefix_forward`` (CuPy)."""
        cupy = self.layout.xp
        labels = cupy.ascontiguousarray(labels, dtype=np.int64)
        num_lanes, num_candidates = labels.shape
        assert num_lanes == ctx.r_label.shape[1] == self.layout.num_lanes, "ctc-prefix: candidates of other lanes"
        r_label = cupy.empty((self._log_probs.shape[0] + 1, num_lanes, num_candidates), dtype=np.float32)
        r_blank = cupy.empty_like(r_label)
        prefix = cupy.empty((num_lanes, num_candidates), dtype=np.float32)
        scores = cupy.empty_like(prefix)
        self._launch("ctc_prefix_forward", num_lanes * num_candidates, (
            *self._frame_args(), *self._context_args(ctx), labels, *self._shape_args(num_lanes),
            np.int64(num_candidates), np.int64(self.blank), np.int64(self.sentence_end), r_label, r_blank, prefix,
            scores))
        return r_label, r_blank, prefix, scores

    def _frame_args(self):
        cupy = self.layout.xp
        return (cupy.ascontiguousarray(self._log_probs, dtype=np.float32),
                cupy.ascontiguousarray(self._sizes, dtype=np.int64),
                cupy.ascontiguousarray(self._group, dtype=np.int64))

    def _context_args(self, ctx: CtcPrefixContext):
        cupy = self.layout.xp
        return (*(cupy.ascontiguousarray(a, dtype=np.float32) for a in (ctx.r_label, ctx.r_blank, ctx.prefix_logp)),
                cupy.ascontiguousarray(ctx.last, dtype=np.int64))

    def _shape_args(self, num_lanes: int):
        """(T, G, V, N) as the kernels' int64 scalars."""
        return (np.int64(self._log_probs.shape[0]), np.int64(self._log_probs.shape[1]), np.int64(self.vocab_size),
                np.int64(num_lanes))

    def _launch(self, name: str, num_threads: int, args) -> None:
        from gpudecode.kernels import load_module

        assert self._group.shape[0] == self.layout.num_lanes, "ctc-prefix: lanes and lane groups disagree"
        if num_threads == 0:
            return
        module = load_module("ctc_prefix_score", (), self._log_probs.device.id)
        module.get_function(name)((-(-num_threads // _THREADS),), (_THREADS,), args)

    def extend(self, ctx: CtcPrefixContext, parents, labels) -> CtcPrefixContext:
        """Children keep the forward variables of (parent, label) from the last scoring call;
        ``labels[i] == -1`` carries the parent's context."""
        xp = self.layout.xp
        if xp is not np:
            return self._extend_kernel(ctx, parents, labels)
        parents = xp.asarray(parents).astype(np.int64, copy=False)
        labels = xp.asarray(labels).astype(np.int64, copy=False)
        carry = labels < 0
        child_label, child_blank, child_prefix = self._children(ctx, parents, labels, carry)
        return CtcPrefixContext(
            r_label=xp.where(carry[None], ctx.r_label[:, parents], child_label),
            r_blank=xp.where(carry[None], ctx.r_blank[:, parents], child_blank),
            prefix_logp=xp.where(carry, ctx.prefix_logp[parents], child_prefix),
            last=xp.where(carry, ctx.last[parents], labels),
        )

    def _children(self, ctx: CtcPrefixContext, parents, labels, carry):
        xp = self.layout.xp
        num_lanes = parents.shape[0]
        found = xp.zeros(num_lanes, dtype=bool)
        child = (ctx.r_label[:, parents], ctx.r_blank[:, parents], ctx.prefix_logp[parents])  # carried
        if ctx.scored is not None:
            scored_labels, r_label, r_blank, prefix = ctx.scored
            hit = scored_labels[parents] == labels[:, None]  # [N, K]
            k = hit.astype(np.int8).argmax(axis=1)
            found = hit.any(axis=1)
            child = (r_label[:, parents, k], r_blank[:, parents, k], prefix[parents, k])
        if bool(to_host((found | carry).all())):
            return child
        # labels that were not among the scored candidates: run the recursion for them
        parent_ctx = CtcPrefixContext(r_label=ctx.r_label[:, parents], r_blank=ctx.r_blank[:, parents],
                                      prefix_logp=ctx.prefix_logp[parents], last=ctx.last[parents])
        fresh_label, fresh_blank, fresh_prefix = self._forward(parent_ctx, xp.maximum(labels, 0)[:, None])
        if ctx.scored is None:
            return fresh_label[:, :, 0], fresh_blank[:, :, 0], fresh_prefix[:, 0]
        return (xp.where(found[None], child[0], fresh_label[:, :, 0]),
                xp.where(found[None], child[1], fresh_blank[:, :, 0]),
                xp.where(found, child[2], fresh_prefix[:, 0]))

    def _extend_kernel(self, ctx: CtcPrefixContext, parents, labels) -> CtcPrefixContext:
        """:meth:`extend` as one launch of ``ctc_prefix_extend`` (CuPy): no host synchronisation."""
        cupy = self.layout.xp
        parents = cupy.ascontiguousarray(cupy.asarray(parents), dtype=np.int64)
        labels = cupy.ascontiguousarray(cupy.asarray(labels), dtype=np.int64)
        num_lanes = parents.shape[0]
        assert num_lanes == labels.shape[0] == ctx.r_label.shape[1] == self.layout.num_lanes, \
            "ctc-prefix: parents, labels and lanes disagree"
        if ctx.scored is None:  # nothing scored: every label runs the recursion (never read below)
            scored = (labels, ctx.prefix_logp, ctx.prefix_logp, ctx.prefix_logp)
        else:
            scored = ctx.scored
        scored = (cupy.ascontiguousarray(scored[0], dtype=np.int64),
                  *(cupy.ascontiguousarray(a, dtype=np.float32) for a in scored[1:]))
        num_scored = 0 if ctx.scored is None else scored[0].shape[1]
        out = CtcPrefixContext(r_label=cupy.empty((self._log_probs.shape[0] + 1, num_lanes), dtype=np.float32),
                               r_blank=cupy.empty((self._log_probs.shape[0] + 1, num_lanes), dtype=np.float32),
                               prefix_logp=cupy.empty(num_lanes, dtype=np.float32),
                               last=cupy.empty(num_lanes, dtype=np.int64))
        self._launch("ctc_prefix_extend", num_lanes, (
            *self._frame_args(), *self._context_args(ctx), parents, labels, *scored,
            np.int64(num_scored), *self._shape_args(num_lanes), np.int64(self.blank), np.int64(self.sentence_end),
            out.r_label, out.r_blank, out.prefix_logp, out.last))
        return out
