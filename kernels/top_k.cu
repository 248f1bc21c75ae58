// Per-row top-k for the searches (gpudecode/search/topk.py): the k largest keys of each row, best
// first, equal keys in column order (lower column first) — the order of a stable descending sort,
// which is what the numpy path computes.  NaN ranks like -inf and -0.0 equals +0.0.
//
// Memory layout
// -------------
//   keys       [num_rows, row_stride] float32, row r's columns at keys[r * row_stride + c], c < num_cols
//   out        [num_rows, k] int64 column indices, best first
//   candidates [num_rows, num_segments, k] uint64, scratch between the two launches for rows longer
//              than TOP_K_SEGMENT (4096) columns: the best k packed candidates of segment s, columns
//              [s * TOP_K_SEGMENT, (s + 1) * TOP_K_SEGMENT) of row r, best first; 0 after the last
//              where the segment has fewer than k columns
//
// Entry points, per KEPT in {1, 2, 4, 8, 16, 32} (the smallest >= k, 1 <= k <= 32):
//   top_k_rows_KEPT      grid [num_rows]: rows of at most TOP_K_SEGMENT columns, one launch
//   top_k_segments_KEPT  grid [num_rows * num_segments], block b = (row b / num_segments, segment
//                        b % num_segments): longer rows, first launch, writes candidates
//   top_k_merge_KEPT     grid [num_rows]: second launch, the best k of a row's candidates -> out
//
// A candidate is packed into one uint64 (packed_key.cuh), (order-preserving bits of the key) << 32
// | ~column, so "larger" means a larger key or, for equal keys, a lower column, and no two
// candidates of a row are equal.  A block reads its items in batches of TOP_K_SEGMENT (each thread
// TOP_K_ITEMS, strided by TOP_K_THREADS, loaded up front).  Per batch, the k-th largest of a warp's
// 32 per-thread maxima has k items of the warp at or above it, so no item below the largest such
// threshold of the block's warps can be among the block's best k: only the few items above it are
// inserted into their thread's sorted list of KEPT (registers, unrolled).  Then each warp takes
// its best (at most k) out of its threads' lists by rounds of a warp maximum, and each of those
// ≤ 8k entries finds its rank among the others in shared memory; ranks < k are the result.

#include "packed_key.cuh"

#define TOP_K_THREADS 256
#define TOP_K_WARPS (TOP_K_THREADS / 32)
#define TOP_K_ITEMS 16
#define TOP_K_SEGMENT (TOP_K_THREADS * TOP_K_ITEMS)

struct KeyColumns {  // float32 keys; an item is the key's ordered bits (never 0; 0: no item)
    typedef unsigned int Item;
    const float* keys;    // column `first`
    unsigned int first;
    __device__ __forceinline__ Item load(int i) const { return (unsigned int)(pack_key(keys[i], 0u) >> 32); }
    __device__ __forceinline__ unsigned long long packed(Item item, int i) const {
        return item ? ((unsigned long long)item << 32) | (unsigned long long)(~(first + (unsigned int)i)) : 0ull;
    }
};

struct PackedCandidates {  // already packed (0: none)
    typedef unsigned long long Item;
    const unsigned long long* values;
    __device__ __forceinline__ Item load(int i) const { return values[i]; }
    __device__ __forceinline__ unsigned long long packed(Item item, int) const { return item; }
};

struct TopKShared {
    unsigned long long threshold[2][TOP_K_WARPS];  // by batch parity
    unsigned long long warp_top[TOP_K_WARPS * 32];  // warp w's best at [w * KEPT, + warp_count[w])
    int warp_count[TOP_K_WARPS];
};

// The values sorted descending across the warp's lanes (bitonic network).
__device__ __forceinline__ unsigned long long warp_sort_descending(unsigned long long value) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, value, stride);
            const bool keep_min = ((lane & stride) != 0) == ((lane & size) == 0);
            value = (other < value) == keep_min ? other : value;
        }
    }
    return value;
}

// Inserts x > kept[KEPT - 1] into the descending list (no two entries equal but 0s).
template <int KEPT>
__device__ __forceinline__ void insert_sorted(unsigned long long (&kept)[KEPT], unsigned long long x) {
#pragma unroll
    for (int r = KEPT - 1; r > 0; --r) kept[r] = x > kept[r - 1] ? kept[r - 1] : (x > kept[r] ? x : kept[r]);
    kept[0] = x > kept[0] ? x : kept[0];
}

// The best min(k, count) of source's items 0 .. count - 1: emit(rank, packed) once for each, by some
// thread (rank 0: best). Returns the number emitted. Ends without a barrier: once per block.
template <int KEPT, typename Source, typename Emit>
__device__ __forceinline__ int block_top_k(const Source& source, int count, int k, TopKShared& shared,
                                           const Emit& emit) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long kept[KEPT];  // best first, 0: empty
#pragma unroll
    for (int r = 0; r < KEPT; ++r) kept[r] = 0ull;
    int parity = 0;
    for (int base = 0; base < count; base += TOP_K_SEGMENT, parity ^= 1) {
        typename Source::Item items[TOP_K_ITEMS];
#pragma unroll
        for (int j = 0; j < TOP_K_ITEMS; ++j) {
            const int i = base + j * TOP_K_THREADS + threadIdx.x;
            items[j] = i < count ? source.load(i) : 0;
        }
        typename Source::Item best_item = items[0];
        int best_j = 0;
#pragma unroll
        for (int j = 1; j < TOP_K_ITEMS; ++j) {
            if (items[j] > best_item) { best_item = items[j]; best_j = j; }
        }
        const unsigned long long thread_best = source.packed(best_item, base + best_j * TOP_K_THREADS + threadIdx.x);
        const unsigned long long warp_kth = __shfl_sync(0xffffffffu, warp_sort_descending(thread_best), k - 1);
        if (lane == 0) shared.threshold[parity][warp] = warp_kth;
        __syncthreads();
        unsigned long long threshold = 0ull;
#pragma unroll
        for (int w = 0; w < TOP_K_WARPS; ++w) {
            const unsigned long long t = shared.threshold[parity][w];
            threshold = t > threshold ? t : threshold;
        }
#pragma unroll
        for (int j = 0; j < TOP_K_ITEMS; ++j) {
            const unsigned long long x = source.packed(items[j], base + j * TOP_K_THREADS + threadIdx.x);
            if (x >= threshold && x > kept[KEPT - 1]) insert_sorted(kept, x);
        }
    }
    int taken = 0;  // the warp's best, best first, until k or the lists run dry
    for (; taken < k; ++taken) {
        const unsigned long long winner = warp_max_u64(kept[0]);
        if (winner == 0ull) break;
        if (kept[0] == winner) {  // candidates are unique: one thread's list moves up
#pragma unroll
            for (int r = 0; r < KEPT - 1; ++r) kept[r] = kept[r + 1];
            kept[KEPT - 1] = 0ull;
        }
        if (lane == 0) shared.warp_top[warp * KEPT + taken] = winner;
    }
    if (lane == 0) shared.warp_count[warp] = taken;
    __syncthreads();
    int total = 0;
#pragma unroll
    for (int w = 0; w < TOP_K_WARPS; ++w) total += shared.warp_count[w];
    const int w = threadIdx.x / KEPT, i = threadIdx.x % KEPT;
    if (w < TOP_K_WARPS && i < shared.warp_count[w]) {
        const unsigned long long mine = shared.warp_top[threadIdx.x];
        int rank = i;  // its own warp's entries before it
        for (int other = 0; other < TOP_K_WARPS; ++other) {
            if (other == w) continue;
            const int n = shared.warp_count[other];
            for (int j = 0; j < n; ++j) rank += shared.warp_top[other * KEPT + j] > mine;
        }
        if (rank < k) emit(rank, mine);
    }
    return total < k ? total : k;
}

__device__ __forceinline__ long long packed_column(unsigned long long packed) {
    return (long long)(~(unsigned int)(packed & 0xffffffffull));
}

struct EmitColumns {
    long long* out;  // the row's k columns
    __device__ __forceinline__ void operator()(int rank, unsigned long long packed) const {
        out[rank] = packed_column(packed);
    }
};

struct EmitPacked {
    unsigned long long* out;  // the segment's k candidates
    __device__ __forceinline__ void operator()(int rank, unsigned long long packed) const { out[rank] = packed; }
};

template <int KEPT>
__device__ __forceinline__ void top_k_rows(const float* __restrict__ keys, long long row_stride, int num_cols, int k,
                                           long long* __restrict__ out) {
    __shared__ TopKShared shared;
    const KeyColumns source{keys + (long long)blockIdx.x * row_stride, 0u};
    block_top_k<KEPT>(source, num_cols, k, shared, EmitColumns{out + (long long)blockIdx.x * k});
}

template <int KEPT>
__device__ __forceinline__ void top_k_segments(const float* __restrict__ keys, long long row_stride, int num_cols,
                                               int num_segments, int k, unsigned long long* __restrict__ candidates) {
    __shared__ TopKShared shared;
    const int row = blockIdx.x / num_segments, first = (blockIdx.x % num_segments) * TOP_K_SEGMENT;
    const int count = min(TOP_K_SEGMENT, num_cols - first);
    const KeyColumns source{keys + (long long)row * row_stride + first, (unsigned int)first};
    unsigned long long* out = candidates + (long long)blockIdx.x * k;
    const int emitted = block_top_k<KEPT>(source, count, k, shared, EmitPacked{out});
    if (threadIdx.x >= emitted && threadIdx.x < k) out[threadIdx.x] = 0ull;
}

template <int KEPT>
__device__ __forceinline__ void top_k_merge(const unsigned long long* __restrict__ candidates, int num_candidates,
                                            int k, long long* __restrict__ out) {
    __shared__ TopKShared shared;
    const PackedCandidates source{candidates + (long long)blockIdx.x * num_candidates};
    block_top_k<KEPT>(source, num_candidates, k, shared, EmitColumns{out + (long long)blockIdx.x * k});
}

#define TOP_K_ENTRY(KEPT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(TOP_K_THREADS) top_k_rows_##KEPT(                              \
        const float* __restrict__ keys, long long row_stride, int num_cols, int k, long long* __restrict__ out) { \
        top_k_rows<KEPT>(keys, row_stride, num_cols, k, out);                                                   \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(TOP_K_THREADS) top_k_segments_##KEPT(                          \
        const float* __restrict__ keys, long long row_stride, int num_cols, int num_segments, int k,            \
        unsigned long long* __restrict__ candidates) {                                                          \
        top_k_segments<KEPT>(keys, row_stride, num_cols, num_segments, k, candidates);                          \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(TOP_K_THREADS) top_k_merge_##KEPT(                             \
        const unsigned long long* __restrict__ candidates, int num_candidates, int k,                          \
        long long* __restrict__ out) {                                                                          \
        top_k_merge<KEPT>(candidates, num_candidates, k, out);                                                  \
    }
TOP_K_ENTRY(1)
TOP_K_ENTRY(2)
TOP_K_ENTRY(4)
TOP_K_ENTRY(8)
TOP_K_ENTRY(16)
TOP_K_ENTRY(32)
