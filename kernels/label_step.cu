// The selection of one label-synchronous search step for every utterance in ONE launch
// (gpudecode/search/label_step.py; the array version is _select in gpudecode/search/label_sync.py):
// one thread block per utterance, utterances never interact. The candidates of an utterance are
// its beam * V (lane, label) pairs: an open lane extends by every label (its score + the combined
// score), a terminated lane offers only itself (label column 0, its score unchanged), a dead lane
// (score -inf) nothing. Ranked by score / norm (the length normaliser), with the score threshold,
// the best `beam` survive (block_top_beam.cuh: equal ranks go to the lower lane, then label).
//
// Memory layout
// -------------
//   combined         [N, V] float32 (contiguous): Σ scale · log-probs; lane b of utterance u is
//                    row u * beam + b
//   logp0 .. logp3   [N, V] float32 (contiguous): each scorer's unscaled log-probs (num_scorers <= 4
//                    used; the others are never read)
//   score [N] float32, length [N] int64, ended [N] uint8: the lanes before the step
//   norm             [N] float32, or null for 1: the length normaliser of each lane's candidates
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

template <int KEPT>
__device__ __forceinline__ void select_step(
    const float* __restrict__ combined, int vocab_size, int beam, const float* __restrict__ score,
    const long long* __restrict__ length, const unsigned char* __restrict__ ended, const float* __restrict__ norm,
    int has_threshold, float threshold, long long sentence_end, const long long* __restrict__ deadline,
    long long step, int num_scorers, const float* __restrict__ logp0, const float* __restrict__ logp1,
    const float* __restrict__ logp2, const float* __restrict__ logp3, const float* __restrict__ scorer_scores,
    long long num_lanes, long long* __restrict__ parents, long long* __restrict__ labels,
    float* __restrict__ score_out, long long* __restrict__ length_out, unsigned char* __restrict__ ended_out,
    float* __restrict__ scorer_out) {
    __shared__ float s_score[LABEL_MAX_BEAM], s_norm[LABEL_MAX_BEAM];
    __shared__ bool s_ended[LABEL_MAX_BEAM];
    __shared__ unsigned long long warp_lists[(LABEL_THREADS / 32) * LABEL_MAX_BEAM];
    __shared__ float warp_max[LABEL_THREADS / 32];
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const long long first = (long long)blockIdx.x * beam;
    if (threadIdx.x < beam) {
        s_score[threadIdx.x] = score[first + threadIdx.x];
        s_ended[threadIdx.x] = ended[first + threadIdx.x] != 0;
        s_norm[threadIdx.x] = norm != nullptr ? norm[first + threadIdx.x] : 1.0f;
    }
    __syncthreads();
    const float* rows = combined + first * vocab_size;
    auto candidate = [&](int i, int v) -> float {  // the candidate's score, before normalising
        if (s_ended[i]) return v == 0 ? s_score[i] : neg_inf();
        return s_score[i] + rows[(long long)i * vocab_size + v];
    };
    auto rank = [&](int i, int v) -> float {
        const float value = candidate(i, v);
        return norm != nullptr ? value / s_norm[i] : value;
    };
    block_top_beam<KEPT, LABEL_THREADS>(rank, beam, vocab_size, has_threshold, threshold, warp_lists, warp_max,
                                        chosen, chosen_rank);

    const int r = threadIdx.x;
    if (r >= beam) return;
    const int i = (int)(chosen[r] / (unsigned int)vocab_size), v = (int)(chosen[r] % (unsigned int)vocab_size);
    const long long parent = first + i, lane = first + r;
    const bool alive = chosen_rank[r] > neg_inf();
    const long long label = alive && !s_ended[i] ? v : -1;
    const bool emitted = label >= 0;
    parents[lane] = parent;
    labels[lane] = label;
    score_out[lane] = alive ? candidate(i, v) : neg_inf();
    length_out[lane] = length[parent] + (emitted ? 1 : 0);
    ended_out[lane] = s_ended[i] || !alive || label == sentence_end || deadline[lane] <= step;
    const float* logps[4] = {logp0, logp1, logp2, logp3};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s >= num_scorers) break;
        const float added = emitted ? logps[s][parent * vocab_size + v] : 0.0f;
        scorer_out[s * num_lanes + lane] = scorer_scores[s * num_lanes + parent] + added;
    }
}

#define LABEL_SELECT(KEPT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_select_##KEPT(                            \
        const float* combined, int vocab_size, int beam, const float* score, const long long* length,           \
        const unsigned char* ended, const float* norm, int has_threshold, float threshold,                      \
        long long sentence_end, const long long* deadline, long long step, int num_scorers, const float* logp0, \
        const float* logp1, const float* logp2, const float* logp3, const float* scorer_scores,                \
        long long num_lanes, long long* parents, long long* labels, float* score_out, long long* length_out,    \
        unsigned char* ended_out, float* scorer_out) {                                                          \
        select_step<KEPT>(combined, vocab_size, beam, score, length, ended, norm, has_threshold, threshold,    \
                          sentence_end, deadline, step, num_scorers, logp0, logp1, logp2, logp3, scorer_scores, \
                          num_lanes, parents, labels, score_out, length_out, ended_out, scorer_out);            \
    }

LABEL_SELECT(8)
LABEL_SELECT(16)
LABEL_SELECT(32)
