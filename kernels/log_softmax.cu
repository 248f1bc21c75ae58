// Log-softmax of a step's logits in ONE launch (gpudecode/scorers/onnx_decoder.py,
// log_softmax_rows; the array version is log_softmax there: x - max, minus the log of the sum of
// the exponentials, in float32). A NaN in a row makes the whole row NaN (through the sum), as in
// the array version; the sum runs in a different order than the array version's reduction
// (results equal to within float32 rounding).
//   log_softmax_rows   one block per row
//
// Memory layout
// -------------
//   logits   [R, V] float32 or float16 (is_half), contiguous
//   out      [R, V] float32, contiguous

#include "search_math.cuh"

#define SOFTMAX_THREADS 256

extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS)
log_softmax_rows(const void* __restrict__ logits, int is_half, long long vocab_size,
                 float* __restrict__ out) {
    __shared__ float partial[SOFTMAX_THREADS];
    const long long row = blockIdx.x;
    const long long start = row * vocab_size;
    const int t = threadIdx.x;
    float best = neg_inf();  // (fmaxf skips NaN)
    for (long long v = t; v < vocab_size; v += SOFTMAX_THREADS) best = fmaxf(best, load_score(logits, start + v, is_half));
    partial[t] = best;
    __syncthreads();
    for (int half = SOFTMAX_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) partial[t] = fmaxf(partial[t], partial[t + half]);
        __syncthreads();
    }
    const float shift = partial[0];
    __syncthreads();
    float total = 0.0f;
    for (long long v = t; v < vocab_size; v += SOFTMAX_THREADS)
        total += expf(load_score(logits, start + v, is_half) - shift);
    partial[t] = total;
    __syncthreads();
    for (int half = SOFTMAX_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) partial[t] += partial[t + half];
        __syncthreads();
    }
    const float log_total = logf(partial[0]);
    float* row_out = out + row * vocab_size;
    for (long long v = t; v < vocab_size; v += SOFTMAX_THREADS)
        row_out[v] = (load_score(logits, start + v, is_half) - shift) - log_total;
}
