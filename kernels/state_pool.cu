// State pool bookkeeping kernels (gpudecode/states/pool.py): slot allocation from the free list,
// reference marking by the windows of live histories, the sweep that frees unmarked slots, and
// the children's history tables after a search step (gpudecode/states/history.py).
// No state data is touched here: these kernels move int32 slot ids only.
//
// Memory layout
// -------------
//   free_stack [capacity] int32   free slot ids; the top of the stack is free_stack[num_free - 1]
//   counters   [4] int32          [0] num_free, [1] peak live slots (capacity - num_free, highest
//                                 seen after an allocation), [2] overflow flag (an allocation asked
//                                 for more slots than were free: a bug in the host's bound), [3] 0
//                                 between launches (split_states in state_copy.cu counts its
//                                 finished thread blocks there when it allocates)
//   allocated  [capacity] uint8   1 while a slot is handed out
//   marks      [capacity] uint8   1 if a live history window references the slot; the sweep
//                                 consumes the marks and leaves them 0 again (no memset needed)
//   history    [num_rows, history_width] int32 slot ids, oldest first, valid below lengths[b]
//   new_slots  [num_rows, max_tokens] int32 (allocation result; -1 beyond token_counts[b])
//   parents    [num_children] int64  the history row each child continues
//   append     [num_children] uint8  0: the child keeps its parent's history (may be null: all 1)
//   children   [num_children, history_width + max_tokens] int32, lengths [num_children] int32
//
// Window of a history (shared with the merge, see state_copy.cu): positions
// [length - kept, length) with kept = min(length, max_history), plus position 0 when keep_first
// and kept > 0.

#define ALLOCATE_THREADS 1024

__device__ __forceinline__ int warp_inclusive_scan(int value, int lane) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += other;
    }
    return value;
}

// Single thread block.  Row b receives token_counts[b] (all rows: max_tokens when token_counts is
// null) slots, taken from the top of the free stack in row-major order: row b, token p gets
// free_stack[num_free - 1 - (offset_b + p)] where offset_b is the exclusive prefix sum of counts.
extern "C" __global__ void __launch_bounds__(ALLOCATE_THREADS)
allocate_slots(const int* __restrict__ token_counts, int num_rows, int max_tokens,
               int* __restrict__ free_stack, int* __restrict__ counters, int capacity,
               unsigned char* __restrict__ allocated, int* __restrict__ new_slots) {
    __shared__ int warp_sums[ALLOCATE_THREADS / 32];
    __shared__ int carry;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_free = counters[0];
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int tile = 0; tile < num_rows; tile += ALLOCATE_THREADS) {
        const int b = tile + threadIdx.x;
        int count = 0;
        if (b < num_rows) {
            count = token_counts ? token_counts[b] : max_tokens;
            count = min(max(count, 0), max_tokens);
        }
        const int inclusive_in_warp = warp_inclusive_scan(count, lane);
        if (lane == 31) warp_sums[warp] = inclusive_in_warp;
        __syncthreads();
        if (warp == 0) {
            const int s = warp_inclusive_scan(warp_sums[lane], lane);
            warp_sums[lane] = s;  // inclusive over warps
        }
        __syncthreads();
        const int before_warp = warp == 0 ? 0 : warp_sums[warp - 1];
        const int offset = carry + before_warp + inclusive_in_warp - count;
        if (b < num_rows) {
            for (int p = 0; p < max_tokens; ++p) {
                int slot = -1;
                if (p < count) {
                    const int position = num_free - 1 - (offset + p);
                    if (position >= 0) {
                        slot = free_stack[position];
                        allocated[slot] = 1;
                    } else {
                        counters[2] = 1;
                    }
                }
                new_slots[(long long)b * max_tokens + p] = slot;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) carry += warp_sums[ALLOCATE_THREADS / 32 - 1];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const int remaining = max(num_free - carry, 0);
        counters[0] = remaining;
        counters[1] = max(counters[1], capacity - remaining);
    }
}

// Every row gets max_tokens slots (no token_counts): slot i = free_stack[num_free - 1 - i], a
// grid-stride loop with coalesced writes; finish_allocation then updates the counters (so every
// thread block reads num_free before it changes).
extern "C" __global__ void allocate_uniform(int total, const int* __restrict__ free_stack,
                                            int* __restrict__ counters, unsigned char* __restrict__ allocated,
                                            int* __restrict__ new_slots) {
    const int num_free = counters[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int position = num_free - 1 - i;
        int slot = -1;
        if (position >= 0) {
            slot = free_stack[position];
            allocated[slot] = 1;
        } else {
            counters[2] = 1;
        }
        new_slots[i] = slot;
    }
}

extern "C" __global__ void finish_allocation(int total, int* __restrict__ counters, int capacity) {
    const int remaining = max(counters[0] - total, 0);
    counters[0] = remaining;
    counters[1] = max(counters[1], capacity - remaining);
}

// grid-stride over history entries: marks every slot inside a row's window.
extern "C" __global__ void mark_slots(const int* __restrict__ history, int history_width,
                                      const int* __restrict__ lengths, int num_rows, int max_history,
                                      int keep_first, unsigned char* __restrict__ marks, int capacity) {
    const long long total = (long long)num_rows * history_width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int b = (int)(i / history_width);
        const int j = (int)(i - (long long)b * history_width);
        const int length = min(max(lengths[b], 0), history_width);
        const int kept = min(length, max_history);
        const bool inside = j < length && (j >= length - kept || (keep_first && kept > 0 && j == 0));
        if (!inside) continue;
        const int slot = history[i];
        if (slot >= 0 && slot < capacity) marks[slot] = 1;
    }
}

// grid-stride over slots: every allocated, unmarked slot is pushed on the free stack (warp-
// aggregated atomics: the order of the pushed ids is not deterministic); marks are reset to 0.
extern "C" __global__ void sweep_slots(unsigned char* __restrict__ marks, unsigned char* __restrict__ allocated,
                                       int* __restrict__ free_stack, int* __restrict__ counters, int capacity) {
    const int lane = threadIdx.x & 31;
    const int stride = gridDim.x * blockDim.x;
    // every lane of a warp runs the same number of iterations, so the ballot sees the full warp
    const int start = blockIdx.x * blockDim.x + threadIdx.x;
    const int rounds = (capacity + stride - 1) / stride;
    for (int round = 0; round < rounds; ++round) {
        const int s = start + round * stride;
        bool release = false;
        if (s < capacity) {
            release = allocated[s] && !marks[s];
            marks[s] = 0;
            if (release) allocated[s] = 0;
        }
        const unsigned int ballot = __ballot_sync(0xffffffffu, release);
        if (ballot == 0) continue;
        int base = 0;
        const int leader = __ffs(ballot) - 1;
        if (lane == leader) base = atomicAdd(&counters[0], __popc(ballot));
        base = __shfl_sync(0xffffffffu, base, leader);
        if (release) free_stack[base + __popc(ballot & ((1u << lane) - 1u))] = s;
    }
}

// Child c = its parent's history (positions below the parent's length, clipped to the width)
// followed by the parent row's new slots (those >= 0, a prefix of the row), -1 beyond.
extern "C" __global__ void extend_histories(const int* __restrict__ history, int history_width,
                                            const int* __restrict__ lengths,
                                            const int* __restrict__ new_slots, int max_tokens,
                                            const long long* __restrict__ parents,
                                            const unsigned char* __restrict__ append, int num_children,
                                            int* __restrict__ children, int* __restrict__ child_lengths) {
    const int out_width = history_width + max_tokens;
    const long long total = (long long)num_children * out_width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i / out_width);
        const int t = (int)(i % out_width);
        const long long p = parents[c];
        const int parent_length = min(max(lengths[p], 0), history_width);
        int added = 0;
        if (append == nullptr || append[c]) {
            for (int s = 0; s < max_tokens; ++s) added += new_slots[p * max_tokens + s] >= 0;
        }
        int slot = -1;
        if (t < parent_length) {
            slot = history[p * history_width + t];
        } else if (t - parent_length < added) {
            slot = new_slots[p * max_tokens + (t - parent_length)];
        }
        children[i] = slot;
        if (t == 0) child_lengths[c] = parent_length + added;
    }
}
