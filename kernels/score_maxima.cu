// The largest score each scorer gave each lane group's live lanes, folded into the maxima kept so
// far, in ONE launch per step (gpudecode/search/nonfinite.py; the array version is group_maxima
// there). A maximum is NaN once any score was NaN (as numpy's max propagates NaN), +inf once one
// was +inf; lanes that are not live count as -inf.
//   group_maxima   one block per (lane group, scorer): the block reads the group's lanes x V
//                  scores of its scorer and writes max(previous, their maximum)
//
// Memory layout
// -------------
//   scores0 .. scores3  [N, V] float32 or float16 (bit s of scores_half; contiguous), lane n of group g
//                       is row g * group_size + (n mod group_size); only the first num_scorers are read
//   skip                [N] uint8 or null: with skip_live 0 a nonzero entry marks a lane that is NOT
//                       live (a search's `ended`), with skip_live 1 one that IS live; null: every lane live
//   previous            [num_scorers, G] float32: the maxima so far
//   out                 [num_scorers, G] float32: the new maxima (may not alias previous)

#include "search_math.cuh"

#define MAXIMA_THREADS 256

extern "C" __global__ void group_maxima(const void* scores0, const void* scores1, const void* scores2,
                                        const void* scores3, int scores_half, int num_scorers,
                                        long long group_size, long long vocab_size,
                                        const unsigned char* __restrict__ skip, int skip_live,
                                        const float* __restrict__ previous, float* __restrict__ out) {
    __shared__ float block_max[MAXIMA_THREADS];
    __shared__ int block_nan[MAXIMA_THREADS];
    const int scorer = blockIdx.y;
    const long long group = blockIdx.x;
    const void* scores = scorer == 0 ? scores0 : scorer == 1 ? scores1 : scorer == 2 ? scores2 : scores3;
    const int half = (scores_half >> scorer) & 1;

    float best = neg_inf();
    int nan = 0;
    for (long long lane = group * group_size; lane < (group + 1) * group_size; ++lane) {
        if (skip != nullptr && ((skip[lane] != 0) != (skip_live != 0))) continue;  // not live
        const long long row_start = lane * vocab_size;
        for (long long v = threadIdx.x; v < vocab_size; v += MAXIMA_THREADS) {
            const float x = load_score(scores, row_start + v, half);
            if (x != x) nan = 1;
            else best = fmaxf(best, x);
        }
    }
    block_max[threadIdx.x] = best;
    block_nan[threadIdx.x] = nan;
    __syncthreads();
    for (int stride = MAXIMA_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            block_max[threadIdx.x] = fmaxf(block_max[threadIdx.x], block_max[threadIdx.x + stride]);
            block_nan[threadIdx.x] |= block_nan[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const long long at = (long long)scorer * gridDim.x + group;
        const float before = previous[at];
        out[at] = (block_nan[0] || before != before) ? __int_as_float(0x7fc00000) : fmaxf(before, block_max[0]);
    }
}
