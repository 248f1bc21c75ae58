// The top `beam` of one utterance's candidates in a thread block, shared by the fused search
// kernels (ctc_frame.cu, transducer_step.cu; inlined by gpudecode/kernels.py::kernel_source after
// packed_key.cuh and search_math.cuh).
//
// A candidate is (value, column), column c = i * V + v for lane i and label v; -inf values are
// candidates too (they rank by column below every finite one). `scan(visit)` calls
// visit(value, column) for this thread's share of the candidates, each column at most once per
// block. With has_threshold, values below the block's best minus `threshold` count as -inf. Every
// thread keeps its best KEPT >= beam packed (key, column) pairs in registers, best first
// (packed_key.cuh: equal keys keep the lower column); `beam` rounds of a block maximum over the
// threads' list heads write the winners' columns to chosen[0 .. beam), best first (fewer than
// `beam` candidates leave ~0u). Scratch: warp_best [THREADS / 32], warp_max [THREADS / 32].
// Returns the threshold floor (-inf without a threshold). Ends with __syncthreads().

template <int KEPT, int THREADS, typename Scan>
__device__ __forceinline__ float block_top_beam_scan(const Scan& scan, int beam, int has_threshold, float threshold,
                                                     unsigned long long* warp_best, float* warp_max,
                                                     unsigned int* chosen) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float floor_key = neg_inf();
    if (has_threshold) {  // the utterance's best candidate, minus the threshold
        float best = neg_inf();
        scan([&](float value, unsigned int) { best = fmaxf(best, value); });
        best = warp_max_f(best);
        if (lane == 0) warp_max[warp] = best;
        __syncthreads();
        best = warp_max_f(lane < THREADS / 32 ? warp_max[lane] : neg_inf());
        floor_key = best - threshold;
    }

    unsigned long long kept[KEPT];  // best first
#pragma unroll
    for (int r = 0; r < KEPT; ++r) kept[r] = 0ull;
    scan([&](float value, unsigned int column) {
        if (has_threshold && !(value >= floor_key)) value = neg_inf();
        const unsigned long long key = pack_key(value, column);
        if (key <= kept[KEPT - 1]) return;
        kept[KEPT - 1] = key;
#pragma unroll
        for (int r = KEPT - 1; r > 0; --r) {
            if (kept[r] > kept[r - 1]) {
                const unsigned long long swap = kept[r];
                kept[r] = kept[r - 1];
                kept[r - 1] = swap;
            }
        }
    });
    for (int round = 0; round < beam; ++round) {
        const unsigned long long mine = kept[0];
        const unsigned long long in_warp = warp_max_u64(mine);
        if (lane == 0) warp_best[warp] = in_warp;
        __syncthreads();
        const unsigned long long winner = warp_max_u64(lane < THREADS / 32 ? warp_best[lane] : 0ull);
        if (mine == winner && mine != 0ull) {  // taken: the next of this thread's list moves up
#pragma unroll
            for (int r = 0; r < KEPT - 1; ++r) kept[r] = kept[r + 1];
            kept[KEPT - 1] = 0ull;
        }
        if (threadIdx.x == 0) chosen[round] = ~(unsigned int)(winner & 0xffffffffull);
        __syncthreads();
    }
    return floor_key;
}

// All beam * V candidates, valued by candidate(i, v): thread t scans v = t, t + THREADS, ... of
// every lane.
template <int KEPT, int THREADS, typename Candidate>
__device__ __forceinline__ float block_top_beam(const Candidate& candidate, int beam, int vocab_size,
                                                int has_threshold, float threshold,
                                                unsigned long long* warp_best, float* warp_max,
                                                unsigned int* chosen) {
    auto scan = [&](auto&& visit) {
        for (int i = 0; i < beam; ++i)
            for (int v = threadIdx.x; v < vocab_size; v += THREADS)
                visit(candidate(i, v), (unsigned int)(i * vocab_size + v));
    };
    return block_top_beam_scan<KEPT, THREADS>(scan, beam, has_threshold, threshold, warp_best, warp_max, chosen);
}
