// The selection of one label-synchronous search step for every utterance in TWO launches
// (gpudecode/search/label_step.py; the array version is _select in gpudecode/search/label_sync.py).
// The candidates of an utterance are its beam * V (lane, label) pairs: an open lane extends by every
// label (its score + the combined score), a terminated lane offers only itself (label column 0, its
// score unchanged), a dead lane (score -inf) nothing. Ranked by score / norm (the length
// normaliser), with the score threshold, the best `beam` survive (equal ranks go to the lower lane,
// then label: packed_key.cuh).
//   label_lane_top_<K>_<T>  one block per SEGMENT of LABEL_SEGMENT labels of a lane: the segment's best
//                       `beam` candidates (no threshold), so N x ceil(V / LABEL_SEGMENT) blocks read
//                       the step's N x V scores, eight labels per thread
//   label_select_<K>    one block per UTTERANCE: the best `beam` of its segment lists, the threshold,
//                       and the new lanes. Exact: a candidate among the utterance's best `beam` is
//                       among its segment's best `beam`; so is the threshold's best; and where fewer
//                       than `beam` candidates are left above -inf, the rest are -inf candidates of
//                       lane 0 (of lane 1, ... where V < beam) in both, whose labels are never used
//
// Memory layout
// -------------
//   term0 .. term3   [N, V] float32 or float16 (bit s of term_half; contiguous), or one row [V] that
//                    every lane shares (bit s of term_row: a scorer's broadcast row), read as float32: the
//                    combined score Σ scale_s · term_s over the first
//                    num_terms terms (1 to 4; label_lane_top_<K>_<num_terms>), each product rounded
//                    to float32 and summed in order, as scorers/combine.py::combine_scores (the host
//                    leaves out terms of scale 0); lane b of utterance u is row u * beam + b
//   logp0 .. logp3   [N, V] float32 or float16 (bit s of logp_half; contiguous), or one row [V] (bit s
//                    of logp_row): each scorer's unscaled
//                    log-probs (num_scorers <= 4 used; the others are never read)
//   score [N] float32, length [N] int64, ended [N] uint8: the lanes before the step
//   norm             [N] float32, or null for 1: the length normaliser of each lane's candidates
//   length           [N] int64: with min_length > 0 an open lane of fewer labels offers no
//                    sentence_end candidate (ranked -inf, as _mask_sentence_end in search/beam.py)
//   lane_keys        [N, segments, beam] uint64: a segment's best candidates, packed (rank, column
//                    i * V + v of the utterance; 0: none); segments = ceil(V / LABEL_SEGMENT)
//   scorer_scores    [num_scorers, N] float32 (contiguous): each scorer's score of each lane
//   deadline         [N] int64: a lane reaches its utterance's label limit with step `step` when
//                    deadline <= step (then it ends)
//   out              parents, labels [N] int64 (label -1: carried), score_out [N] float32,
//                    length_out [N] int64, ended_out [N] uint8, scorer_out [num_scorers, N] float32;
//                    new lane u * beam + r is the utterance's r-th best candidate

#include "packed_key.cuh"
#include "search_math.cuh"
#include "block_top_beam.cuh"

#define LABEL_THREADS 256
#define LABEL_MAX_BEAM 32
#define LANE_UNROLL 8  // H200, beam 8 x 64, V 10k: 38.6 us per step against 44.2 at 4 and 41.3 at 16
#define LABEL_SEGMENT (LANE_UNROLL * LABEL_THREADS)

struct Terms {
    const void* term[4];
    float scale[4];
    int count;
    int half;  // bit s: term s is float16
    int row;   // bit s: term s is one row [V] for every lane
    // label v of the lane whose row starts at row_start (= lane * V)
    __device__ __forceinline__ float value(int s, long long row_start, int v) const {
        return load_score(term[s], ((row >> s) & 1) ? (long long)v : row_start + v, (half >> s) & 1);
    }
    __device__ __forceinline__ float combined(long long row_start, int v) const {  // no contraction into FMAs
        float total = __fmul_rn(value(0, row_start, v), scale[0]);
#pragma unroll
        for (int s = 1; s < 4; ++s) {
            if (s >= count) break;
            total = __fadd_rn(total, __fmul_rn(value(s, row_start, v), scale[s]));
        }
        return total;
    }
};

template <int KEPT, int TERMS>
__device__ __forceinline__ void lane_top(const Terms& terms, int vocab_size, int beam,
                                         const float* __restrict__ score, const unsigned char* __restrict__ ended,
                                         const float* __restrict__ norm, const long long* __restrict__ length,
                                         long long min_length, long long sentence_end,
                                         unsigned long long* __restrict__ lane_keys) {
    __shared__ unsigned long long warp_lists[(LABEL_THREADS / 32) * LABEL_MAX_BEAM];
    __shared__ float warp_max[LABEL_THREADS / 32];
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const int segments = (vocab_size + LABEL_SEGMENT - 1) / LABEL_SEGMENT;
    const long long lane = blockIdx.x / segments;
    const int first_label = (blockIdx.x % segments) * LABEL_SEGMENT;
    const unsigned int base = (unsigned int)(lane % beam) * (unsigned int)vocab_size;  // the lane's first column
    const float lane_score = score[lane], lane_norm = norm != nullptr ? norm[lane] : 1.0f;
    unsigned long long* keys = lane_keys + (long long)blockIdx.x * beam;
    if (ended[lane]) {  // only itself, in column 0; the lowest other columns rank -inf, in segment 0
        const int r = threadIdx.x;
        if (r < beam) {
            const float rank = norm != nullptr ? lane_score / lane_norm : lane_score;
            keys[r] = first_label == 0 && r < vocab_size ? pack_key(r == 0 ? rank : neg_inf(), base + r) : 0ull;
        }
        return;
    }
    const long long row = lane * vocab_size;
    const long long masked_end = min_length > 0 && length[lane] < min_length ? sentence_end : -1;
    auto scan = [&](auto&& visit) {  // LANE_UNROLL labels per thread: all LANE_UNROLL * TERMS loads in flight
        float loaded[LANE_UNROLL][TERMS], values[LANE_UNROLL];
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {  // no branch around a load: past V, label V - 1 is read again
            const int v = min(first_label + k * LABEL_THREADS + (int)threadIdx.x, vocab_size - 1);
#pragma unroll
            for (int t = 0; t < TERMS; ++t) loaded[k][t] = terms.value(t, row, v);
        }
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {  // combine_scores's order and rounding, no FMA
            float total = __fmul_rn(loaded[k][0], terms.scale[0]);
#pragma unroll
            for (int t = 1; t < TERMS; ++t) total = __fadd_rn(total, __fmul_rn(loaded[k][t], terms.scale[t]));
            values[k] = lane_score + total;
        }
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {
            const int v = first_label + k * LABEL_THREADS + threadIdx.x;
            const float value = v == masked_end ? neg_inf() : values[k];
            if (v < vocab_size) visit(norm != nullptr ? value / lane_norm : value, base + v);
        }
    };
    block_top_beam_scan<KEPT, LABEL_THREADS>(scan, beam, 0, 0.0f, warp_lists, warp_max, chosen, chosen_rank);
    const int r = threadIdx.x;
    if (r < beam) keys[r] = chosen[r] == ~0u ? 0ull : pack_key(chosen_rank[r], chosen[r]);
}

template <int KEPT>
__device__ __forceinline__ void select_step(
    const Terms& terms, int vocab_size, int beam, const unsigned long long* __restrict__ lane_keys,
    const float* __restrict__ score, const long long* __restrict__ length, const unsigned char* __restrict__ ended,
    int has_threshold, float threshold, long long sentence_end, const long long* __restrict__ deadline,
    long long step, int num_scorers, const void* logp0, const void* logp1, const void* logp2, const void* logp3,
    int logp_half, int logp_row, const float* __restrict__ scorer_scores,
    long long num_lanes, long long* __restrict__ parents, long long* __restrict__ labels,
    float* __restrict__ score_out, long long* __restrict__ length_out, unsigned char* __restrict__ ended_out,
    float* __restrict__ scorer_out) {
    __shared__ unsigned long long warp_lists[(LABEL_THREADS / 32) * LABEL_MAX_BEAM];
    __shared__ float warp_max[LABEL_THREADS / 32];
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const long long first = (long long)blockIdx.x * beam;
    const int listed = beam * ((vocab_size + LABEL_SEGMENT - 1) / LABEL_SEGMENT) * beam;  // the lanes' lists
    const unsigned long long* keys = lane_keys + first * (listed / beam);
    auto scan = [&](auto&& visit) {
        for (int e = threadIdx.x; e < listed; e += LABEL_THREADS) {
            const unsigned long long key = keys[e];
            if (key != 0ull) visit(unpack_key_value(key), ~(unsigned int)(key & 0xffffffffull));
        }
    };
    block_top_beam_scan<KEPT, LABEL_THREADS>(scan, beam, has_threshold, threshold, warp_lists, warp_max, chosen,
                                             chosen_rank);

    const int r = threadIdx.x;
    if (r >= beam) return;
    const bool alive = chosen_rank[r] > neg_inf();
    const int i = (int)(chosen[r] / (unsigned int)vocab_size), v = (int)(chosen[r] % (unsigned int)vocab_size);
    const long long parent = first + i, lane = first + r;
    const bool was_ended = ended[parent] != 0;
    const long long label = alive && !was_ended ? v : -1;
    const bool emitted = label >= 0;
    parents[lane] = parent;
    labels[lane] = label;
    score_out[lane] = !alive ? neg_inf() : was_ended ? score[parent]
                                                     : score[parent] + terms.combined(parent * vocab_size, v);
    length_out[lane] = length[parent] + (emitted ? 1 : 0);
    ended_out[lane] = was_ended || !alive || label == sentence_end || deadline[lane] <= step;
    const void* logps[4] = {logp0, logp1, logp2, logp3};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s >= num_scorers) break;
        const long long at = ((logp_row >> s) & 1) ? (long long)v : parent * vocab_size + v;
        const float added = emitted ? load_score(logps[s], at, (logp_half >> s) & 1) : 0.0f;
        scorer_out[s * num_lanes + lane] = scorer_scores[s * num_lanes + parent] + added;
    }
}

#define TERMS_PARAMS                                                                                       \
    const void *term0, const void *term1, const void *term2, const void *term3, float scale0, float scale1, \
        float scale2, float scale3, int num_terms, int term_half, int term_row
#define TERMS_OF_PARAMS                                                                                    \
    Terms{{term0, term1, term2, term3}, {scale0, scale1, scale2, scale3}, num_terms, term_half, term_row}

#define LABEL_LANE_TOP(KEPT, TERMS)                                                                              \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_lane_top_##KEPT##_##TERMS(                \
        TERMS_PARAMS, int vocab_size, int beam, const float* score, const unsigned char* ended, const float* norm, \
        const long long* length, long long min_length, long long sentence_end, unsigned long long* lane_keys) {  \
        lane_top<KEPT, TERMS>(TERMS_OF_PARAMS, vocab_size, beam, score, ended, norm, length, min_length,        \
                              sentence_end, lane_keys);                                                          \
    }

#define LABEL_STEP(KEPT)                                                                                         \
    LABEL_LANE_TOP(KEPT, 1) LABEL_LANE_TOP(KEPT, 2) LABEL_LANE_TOP(KEPT, 3) LABEL_LANE_TOP(KEPT, 4)              \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_select_##KEPT(                            \
        TERMS_PARAMS, int vocab_size, int beam, const unsigned long long* lane_keys, const float* score,        \
        const long long* length, const unsigned char* ended, int has_threshold, float threshold,                \
        long long sentence_end, const long long* deadline, long long step, int num_scorers, const void* logp0,  \
        const void* logp1, const void* logp2, const void* logp3, int logp_half, int logp_row,                  \
        const float* scorer_scores,                                                                             \
        long long num_lanes, long long* parents, long long* labels, float* score_out, long long* length_out,    \
        unsigned char* ended_out, float* scorer_out) {                                                          \
        select_step<KEPT>(TERMS_OF_PARAMS, vocab_size, beam, lane_keys, score, length, ended, has_threshold,    \
                          threshold, sentence_end, deadline, step, num_scorers, logp0, logp1, logp2, logp3,     \
                          logp_half, logp_row, scorer_scores, num_lanes, parents, labels, score_out, length_out, ended_out, \
                          scorer_out);                                                                          \
    }

LABEL_STEP(8)
LABEL_STEP(16)
LABEL_STEP(32)
