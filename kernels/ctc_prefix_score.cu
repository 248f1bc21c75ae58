// The ctc-prefix scorer's per-step work in ONE launch each (gpudecode/scorers/ctc_prefix.py; the
// array versions are CtcPrefixScorer._forward and CtcPrefixScorer.extend on numpy). Per lane the
// scorer keeps the forward variables of its prefix g over all frames; a candidate label c extends
// them by the recursion of Watanabe et al. (2017), run here over the frames sequentially by one
// thread per (lane, label) pair, with the array version's operations in the same order:
//   φ(t)        = r_blank(g, t)                          if c is the lane's last label (a repeat)
//                 logaddexp(r_blank(g, t), r_label(g, t)) otherwise        (row t: after frame t-1)
//   r_label' = logaddexp(r_label, φ(t)) + x_c(t),  r_blank' = logaddexp(r_blank, r_label) + x_blank(t)
//   ψ        = logaddexp(ψ, φ(t) + x_c(t))
// on the frames t < the utterance's size (later rows repeat the last one); then ψ of sentence_end
// is the full-sequence probability logaddexp(r_blank(g, T), r_label(g, T)) and ψ of blank -inf.
// The blank candidate reads label 0's log-probs for its (unused) forward variables, as the array
// version does.
//   ctc_prefix_forward  one thread per (lane n, candidate k): the forward variables and ψ of every
//                       candidate, and the score log ψ(g + c) − log ψ(g) (-inf where ψ(g) is not
//                       finite) (score_candidates)
//   ctc_prefix_extend   one thread per new lane n: the context of (parent, label) — the parent's
//                       own (label -1: carried), the scored candidate's (the first k whose label
//                       matches), else the recursion run for that label (extend)
//
// Memory layout (all contiguous; N lanes, K candidates, G lane groups, T frames, V labels)
// -------------
//   log_probs     [T, G, V] float32: frame t of lane group g's utterance (time-major)
//   sizes         [G] int64: each group's number of frames (<= T)
//   group         [N] int64: the lane group of each lane
//   ctx_label, ctx_blank  [T + 1, N] float32: the lanes' forward variables (row 0: before frame 0)
//   ctx_prefix    [N] float32: log ψ(g);  ctx_last [N] int64: the last label (-1: empty prefix)
//   labels        [N, K] int64: the candidates, in [0, V)
//   out_label, out_blank  [T + 1, N, K] float32 (forward) / [T + 1, N] (extend)
//   out_prefix    [N, K] float32 (forward) / [N] (extend);  out_last [N] int64 (extend)
//   out_score     [N, K] float32 (forward): the candidates' scores
//   parents       [N] int64, new_labels [N] int64 (-1: carry the parent's context)
//   scored_labels [N, K] int64, scored_label / scored_blank [T + 1, N, K], scored_prefix [N, K]:
//                 the last forward launch's labels and outputs; with num_scored 0 they are not read

#include "search_math.cuh"

#define PREFIX_THREADS 128

// The recursion for label `label` of a lane whose prefix context is column `ctx_lane` of ctx_* and
// whose frames are group `group`'s; writes rows 0..T of out_label / out_blank at
// out_at + row * out_stride and returns ψ.
__device__ __forceinline__ float forward_one(const float* __restrict__ log_probs, long long num_frames,
                                             long long size, long long group, long long num_groups,
                                             long long vocab_size, const float* __restrict__ ctx_label,
                                             const float* __restrict__ ctx_blank, long long ctx_lane,
                                             long long num_lanes, long long last, long long label, long long blank,
                                             long long sentence_end, float* __restrict__ out_label,
                                             float* __restrict__ out_blank, long long out_at, long long out_stride) {
    const long long column = label == blank ? 0 : label;
    const bool repeat = label == last;
    const long long frame_stride = num_groups * vocab_size;
    const float* frame = log_probs + group * vocab_size;
    float r_label = neg_inf(), r_blank = neg_inf(), psi = neg_inf();
    out_label[out_at] = r_label;
    out_blank[out_at] = r_blank;
    const long long valid = size < num_frames ? size : num_frames;
    for (long long t = 0; t < num_frames; ++t) {
        if (t < valid) {
            const float before_blank = ctx_blank[t * num_lanes + ctx_lane];
            const float before_label = ctx_label[t * num_lanes + ctx_lane];
            const float phi = repeat ? before_blank : log_add_exp(before_blank, before_label);
            const float x_label = frame[t * frame_stride + column];
            const float new_label = log_add_exp(r_label, phi) + x_label;
            const float new_blank = log_add_exp(r_blank, r_label) + frame[t * frame_stride + blank];
            psi = log_add_exp(psi, phi + x_label);
            r_label = new_label;
            r_blank = new_blank;
        }
        out_label[out_at + (t + 1) * out_stride] = r_label;
        out_blank[out_at + (t + 1) * out_stride] = r_blank;
    }
    if (label == sentence_end)
        psi = log_add_exp(ctx_blank[num_frames * num_lanes + ctx_lane], ctx_label[num_frames * num_lanes + ctx_lane]);
    if (label == blank) psi = neg_inf();
    return psi;
}

extern "C" __global__ void ctc_prefix_forward(
    const float* __restrict__ log_probs, const long long* __restrict__ sizes, const long long* __restrict__ group,
    const float* __restrict__ ctx_label, const float* __restrict__ ctx_blank, const float* __restrict__ ctx_prefix,
    const long long* __restrict__ ctx_last, const long long* __restrict__ labels, long long num_frames,
    long long num_groups, long long vocab_size, long long num_lanes, long long num_candidates, long long blank,
    long long sentence_end, float* __restrict__ out_label, float* __restrict__ out_blank,
    float* __restrict__ out_prefix, float* __restrict__ out_score) {
    const long long pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= num_lanes * num_candidates) return;
    const long long lane = pair / num_candidates, g = group[lane];
    const float psi = forward_one(log_probs, num_frames, sizes[g], g, num_groups, vocab_size, ctx_label, ctx_blank,
                                  lane, num_lanes, ctx_last[lane], labels[pair], blank, sentence_end, out_label,
                                  out_blank, pair, num_lanes * num_candidates);
    const float base = ctx_prefix[lane];
    out_prefix[pair] = psi;
    out_score[pair] = fabsf(base) < __int_as_float(0x7f800000) ? psi - base : neg_inf();  // ψ(g) = 0: impossible
}

extern "C" __global__ void ctc_prefix_extend(
    const float* __restrict__ log_probs, const long long* __restrict__ sizes, const long long* __restrict__ group,
    const float* __restrict__ ctx_label, const float* __restrict__ ctx_blank, const float* __restrict__ ctx_prefix,
    const long long* __restrict__ ctx_last, const long long* __restrict__ parents,
    const long long* __restrict__ new_labels, const long long* __restrict__ scored_labels,
    const float* __restrict__ scored_label, const float* __restrict__ scored_blank,
    const float* __restrict__ scored_prefix, long long num_scored, long long num_frames, long long num_groups,
    long long vocab_size, long long num_lanes, long long blank, long long sentence_end,
    float* __restrict__ out_label, float* __restrict__ out_blank, float* __restrict__ out_prefix,
    long long* __restrict__ out_last) {
    const long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (lane >= num_lanes) return;
    const long long parent = parents[lane], label = new_labels[lane];
    if (label < 0) {  // carried
        for (long long t = 0; t <= num_frames; ++t) {
            out_label[t * num_lanes + lane] = ctx_label[t * num_lanes + parent];
            out_blank[t * num_lanes + lane] = ctx_blank[t * num_lanes + parent];
        }
        out_prefix[lane] = ctx_prefix[parent];
        out_last[lane] = ctx_last[parent];
        return;
    }
    out_last[lane] = label;
    long long k = 0;
    while (k < num_scored && scored_labels[parent * num_scored + k] != label) ++k;
    if (k < num_scored) {  // scored by the last forward launch: its forward variables
        const long long at = parent * num_scored + k, stride = num_lanes * num_scored;
        for (long long t = 0; t <= num_frames; ++t) {
            out_label[t * num_lanes + lane] = scored_label[t * stride + at];
            out_blank[t * num_lanes + lane] = scored_blank[t * stride + at];
        }
        out_prefix[lane] = scored_prefix[at];
        return;
    }
    const long long g = group[lane];
    out_prefix[lane] = forward_one(log_probs, num_frames, sizes[g], g, num_groups, vocab_size, ctx_label, ctx_blank,
                                   parent, num_lanes, ctx_last[parent], label, blank, sentence_end, out_label,
                                   out_blank, lane, num_lanes);
}
