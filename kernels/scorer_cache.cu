// The label scorers' cached scores of a time-synchronous search (gpudecode/search/scorer_cache.py):
// the per-step bookkeeping of up to MAX_SCORERS scorers in one launch each, bit for bit the array
// version there.
//
// Memory layout
// -------------
// cache_s      [N, V] float32, C-contiguous: scorer s's cached scores, row i for lane i
// new_s        [N, V] float32 rows at new_row_stride_s elements apart (0: one row broadcast to
//              every lane), the last axis contiguous: scorer s's scores of this step
// lm_scores    [S, N] float32: each lane's accumulated score of each scorer
// changed      [N] bool (bytes): lanes whose scorer context changed since the last refresh
// parents      [N] int64: the lane each new lane continues; labels [N] int64, -1: none emitted
// Unused scorer slots (s >= num_scorers) get any valid pointer; they are never read.
//
// scorer_terms:  (refresh: new_0 non-null) cache_s[i, :] = changed == null || changed[i] ? new_s[i, :]
//                : cache_s[i, :], written in place; then
//                lm_term[i, v] = sum over s with scale_s != 0, in order, of scale_s * cache_s[i, v]
//                lm_total[i] = the same sum of scale_s * lm_scores[s, i]
//                (a scale of 1 adds the score itself; every product and sum rounded to nearest, no
//                fused multiply-add, as numpy computes them; no scorer with a non-zero scale: 0)
// scorer_moves:  out_s[i, :] = cache_s[parents[i], :]
//                lm_out[s, i] = lm_scores[s, parents[i]] + (labels[i] >= 0 ? cache_s[parents[i], labels[i]] : 0)
//                changed_out[i] = changed[parents[i]] | (labels[i] >= 0)   (changed may be null: false)
//                scorer_parents[i] = scorer_lane[parents[i]]
//
// Thread mapping: grid-stride loops, one thread per (lane, label) element of the [N, V] arrays (all
// scorers in the thread) and one per lane for the per-lane values.

#define MAX_SCORERS 4

__device__ __forceinline__ float scaled_sum(const float* values, const float* scales, int num_scorers)
{
    float total = 0.0f;
    bool first = true;
#pragma unroll
    for (int s = 0; s < MAX_SCORERS; ++s) {
        if (s >= num_scorers) break;
        const float scale = scales[s];
        if (scale == 0.0f) continue;
        const float term = scale == 1.0f ? values[s] : __fmul_rn(values[s], scale);
        total = first ? term : __fadd_rn(total, term);
        first = false;
    }
    return total;
}

extern "C" __global__ void scorer_terms(
    float* cache0, float* cache1, float* cache2, float* cache3,
    const float* new0, const float* new1, const float* new2, const float* new3,
    long long stride0, long long stride1, long long stride2, long long stride3,
    const unsigned char* changed, const float* lm_scores,
    float scale0, float scale1, float scale2, float scale3, int num_scorers,
    long long num_lanes, long long vocab_size, float* lm_term, float* lm_total)
{
    float* cache[MAX_SCORERS] = {cache0, cache1, cache2, cache3};
    const float* fresh[MAX_SCORERS] = {new0, new1, new2, new3};
    const long long strides[MAX_SCORERS] = {stride0, stride1, stride2, stride3};
    const float scales[MAX_SCORERS] = {scale0, scale1, scale2, scale3};
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = num_lanes * vocab_size;
    for (long long k = first; k < total; k += stride) {
        const long long lane = k / vocab_size;
        const long long label = k - lane * vocab_size;
        const bool refresh = new0 != nullptr && (changed == nullptr || changed[lane]);
        float values[MAX_SCORERS];
#pragma unroll
        for (int s = 0; s < MAX_SCORERS; ++s) {
            if (s >= num_scorers) break;
            values[s] = refresh ? fresh[s][lane * strides[s] + label] : cache[s][k];
            if (refresh) cache[s][k] = values[s];
        }
        lm_term[k] = scaled_sum(values, scales, num_scorers);
    }
    for (long long lane = first; lane < num_lanes; lane += stride) {
        float values[MAX_SCORERS];
#pragma unroll
        for (int s = 0; s < MAX_SCORERS; ++s) {
            if (s >= num_scorers) break;
            values[s] = lm_scores[s * num_lanes + lane];
        }
        lm_total[lane] = scaled_sum(values, scales, num_scorers);
    }
}

extern "C" __global__ void scorer_moves(
    const float* cache0, const float* cache1, const float* cache2, const float* cache3,
    float* out0, float* out1, float* out2, float* out3,
    const long long* parents, const long long* labels, const float* lm_scores, float* lm_out,
    const unsigned char* changed, unsigned char* changed_out, const long long* scorer_lane,
    long long* scorer_parents, int num_scorers, long long num_lanes, long long vocab_size)
{
    const float* cache[MAX_SCORERS] = {cache0, cache1, cache2, cache3};
    float* out[MAX_SCORERS] = {out0, out1, out2, out3};
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = num_lanes * vocab_size;
    for (long long k = first; k < total; k += stride) {
        const long long lane = k / vocab_size;
        const long long source = parents[lane] * vocab_size + (k - lane * vocab_size);
#pragma unroll
        for (int s = 0; s < MAX_SCORERS; ++s) {
            if (s >= num_scorers) break;
            out[s][k] = cache[s][source];
        }
    }
    for (long long lane = first; lane < num_lanes; lane += stride) {
        const long long parent = parents[lane];
        const long long label = labels[lane];
#pragma unroll
        for (int s = 0; s < MAX_SCORERS; ++s) {
            if (s >= num_scorers) break;
            const float gained = label >= 0 ? cache[s][parent * vocab_size + label] : 0.0f;
            lm_out[s * num_lanes + lane] = __fadd_rn(lm_scores[s * num_lanes + parent], gained);
        }
        changed_out[lane] = (changed != nullptr && changed[parent]) || label >= 0;
        scorer_parents[lane] = scorer_lane[parent];
    }
}
