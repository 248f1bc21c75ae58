// Per-row top-k for the searches (gpudecode/search/topk.py): the k largest keys of each row, best
// first, equal keys in column order (lower column first) — the order of a stable descending sort,
// which is what the numpy path computes.  NaN ranks like -inf and -0.0 equals +0.0.
//
// Memory layout
// -------------
//   keys [num_rows, row_stride] float32, row r's columns at keys[r * row_stride + c], c < num_cols
//   out  [num_rows, k] int64 column indices, best first
//
// One thread block per row.  A candidate is packed into one uint64, (order-preserving bits of the
// key) << 32 | ~column, so "larger" means a larger key or, for equal keys, a lower column, and no
// two candidates of a row are equal.  Each thread keeps its k largest candidates (a sorted list in
// local memory; most candidates fail the comparison with the list's last entry), then k rounds of
// a block-wide maximum over the threads' list heads emit the result in order.

#include "packed_key.cuh"

#define TOP_K_THREADS 256
#define TOP_K_MAX_K 32

extern "C" __global__ void __launch_bounds__(TOP_K_THREADS)
row_top_k(const float* __restrict__ keys, long long row_stride, int num_cols, int k, long long* __restrict__ out) {
    __shared__ unsigned long long warp_best[TOP_K_THREADS / 32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const float* row = keys + (long long)blockIdx.x * row_stride;
    // 0 is below every packed candidate (the smallest, -inf at the last column, is > 2^55)
    unsigned long long best[TOP_K_MAX_K];
    for (int i = 0; i < k; ++i) best[i] = 0ull;
    for (int c = threadIdx.x; c < num_cols; c += TOP_K_THREADS) {
        const unsigned long long candidate = pack_key(row[c], (unsigned int)c);
        if (candidate <= best[k - 1]) continue;
        int j = k - 1;
        while (j > 0 && best[j - 1] < candidate) {
            best[j] = best[j - 1];
            --j;
        }
        best[j] = candidate;
    }
    int head = 0;
    for (int round = 0; round < k; ++round) {
        const unsigned long long mine = head < k ? best[head] : 0ull;
        const unsigned long long in_warp = warp_max_u64(mine);
        if (lane == 0) warp_best[warp] = in_warp;
        __syncthreads();
        const unsigned long long winner = warp_max_u64(lane < TOP_K_THREADS / 32 ? warp_best[lane] : 0ull);
        if (mine == winner && mine != 0ull) ++head;  // candidates are unique: one thread advances
        if (threadIdx.x == 0) out[(long long)blockIdx.x * k + round] = (long long)(~(unsigned int)(winner & 0xffffffffull));
        __syncthreads();  // warp_best is rewritten in the next round
    }
}
