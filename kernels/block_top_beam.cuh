// The top `beam` of one utterance's candidates in a thread block, shared by the fused search
// kernels (ctc_frame.cu, transducer_step.cu; inlined by gpudecode/kernels.py::kernel_source after
// packed_key.cuh and search_math.cuh).
//
// A candidate is (value, column), column c = i * V + v for lane i and label v; -inf values are
// candidates too (they rank by column below every finite one). `scan(visit)` calls
// visit(value, column) for this thread's share of the candidates, each column at most once per
// block. With has_threshold, values below the block's best minus `threshold` count as -inf. Every
// thread keeps its best KEPT >= beam packed (key, column) pairs in registers, best first
// (packed_key.cuh: equal keys keep the lower column). Each warp then takes its own best `beam` by
// warp rounds (no barriers) into warp_lists [THREADS / 32 * beam]; every listed key's rank in the
// block is the number of larger listed keys (keys are unique), and the best `beam` are written to
// chosen[0 .. beam) (columns) and, when not null, chosen_value[0 .. beam) (their values after the
// threshold), best first; fewer than `beam` candidates leave ~0u. Scratch: warp_max [THREADS / 32].
// Returns the threshold floor (-inf without a threshold). Ends with __syncthreads().

template <int KEPT, int THREADS, typename Scan>
__device__ __forceinline__ float block_top_beam_scan(const Scan& scan, int beam, int has_threshold, float threshold,
                                                     unsigned long long* warp_lists, float* warp_max,
                                                     unsigned int* chosen, float* chosen_value) {
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
        keep_best(kept, pack_key(value, column));
    });
    if (threadIdx.x < beam) chosen[threadIdx.x] = ~0u;
    for (int round = 0; round < beam; ++round) {  // this warp's best `beam`, best first
        const unsigned long long winner = warp_max_u64(kept[0]);
        if (kept[0] == winner && winner != 0ull) {  // taken: the next of this thread's list moves up
#pragma unroll
            for (int r = 0; r < KEPT - 1; ++r) kept[r] = kept[r + 1];
            kept[KEPT - 1] = 0ull;
        }
        if (lane == 0) warp_lists[warp * beam + round] = winner;
    }
    __syncthreads();
    const int listed = (THREADS / 32) * beam;
    for (int e = threadIdx.x; e < listed; e += THREADS) {
        const unsigned long long key = warp_lists[e];
        if (key == 0ull) continue;
        int rank = 0;
        for (int f = 0; f < listed; ++f) rank += warp_lists[f] > key;
        if (rank < beam) {
            chosen[rank] = ~(unsigned int)(key & 0xffffffffull);
            if (chosen_value != nullptr) chosen_value[rank] = unpack_key_value(key);
        }
    }
    __syncthreads();
    return floor_key;
}

// All beam * V candidates, valued by candidate(i, v): thread t scans v = t, t + THREADS, ... of
// every lane.
template <int KEPT, int THREADS, typename Candidate>
__device__ __forceinline__ float block_top_beam(const Candidate& candidate, int beam, int vocab_size,
                                                int has_threshold, float threshold,
                                                unsigned long long* warp_lists, float* warp_max,
                                                unsigned int* chosen, float* chosen_value) {
    auto scan = [&](auto&& visit) {
        for (int i = 0; i < beam; ++i)
            for (int v = threadIdx.x; v < vocab_size; v += THREADS)
                visit(candidate(i, v), (unsigned int)(i * vocab_size + v));
    };
    return block_top_beam_scan<KEPT, THREADS>(scan, beam, has_threshold, threshold, warp_lists, warp_max, chosen,
                                              chosen_value);
}
