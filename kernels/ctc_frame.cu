// One full frame of the CTC prefix beam search without label scorers (gpudecode/search/ctc_frame.py;
// the array version is _PrefixSearch._full_frame in gpudecode/search/ctc.py): candidates,
// recombination with the collision check, score threshold, per-utterance top-beam and the new
// lanes, one thread block per utterance.
//
// Memory layout
// -------------
//   log_probs  [U, T, V] float32 (contiguous)          lengths [U] int64 valid frames
//   skip       [U, T] uint8 or null (1: the utterance treats frame t as blank only)
//   lane state [N = U * beam], lane b of utterance u at u * beam + b; read from the old_* arrays,
//              written to the new_* arrays (never the same):
//     blank_logp, label_logp float32   prefix log-prob ending in blank / in its last label
//     last, length, hash, prev_hash, node int64   last label (-1: empty), prefix length, rolling
//              hash of the prefix and of the prefix without its last label, emission node
//   node_parent, node_label [1 + frames * N] int64: emission tree; this frame's nodes are
//              base + lane, written for every lane
//   unresolved [1] uint8: set to 1 when a hash-equal pair stays undecided after compare_steps
//
// Per block: lane state in shared memory (beam <= CTC_MAX_BEAM); one thread per lane for the
// recombination (a serial walk of the emission tree per hash-equal pair); every thread scans a
// strided share of the beam * V candidates keeping its best `beam` (key, column) pairs, packed
// into uint64 as in top_k.cu so that equal keys keep the lower column; `beam` rounds of a block
// maximum pick the winners in order.

#define CTC_THREADS 256
#define CTC_MAX_BEAM 32

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// numpy's npy_logaddexpf
__device__ __forceinline__ float log_add_exp(float x, float y) {
    if (x == y) return x + 0.693147180559945309417f;
    const float d = x - y;
    if (d > 0) return x + log1pf(expf(-d));
    if (d <= 0) return y + log1pf(expf(d));
    return d;  // NaN
}

__device__ __forceinline__ unsigned long long pack_key(float key, unsigned int column) {
    key += 0.0f;  // -0.0 -> +0.0
    const unsigned int bits = __float_as_uint(key);
    const unsigned int ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned long long)(~column);
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = other > value ? other : value;
    }
    return value;
}

__device__ __forceinline__ float warp_max_f(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

struct Frame {
    const float* row;  // log_probs[u, t, :]
    int blank;
    bool active, keep;
    __device__ float x(int v) const {
        if (keep) return row[v];
        if (v == blank) return active ? row[blank] : 0.0f;
        return neg_inf();
    }
};

extern "C" __global__ void __launch_bounds__(CTC_THREADS)
ctc_prefix_frame(const float* __restrict__ log_probs, int num_frames, int vocab_size, int blank, int t,
                 const long long* __restrict__ lengths, const unsigned char* __restrict__ skip, int beam,
                 const float* __restrict__ old_blank_logp, const float* __restrict__ old_label_logp,
                 const long long* __restrict__ old_last, const long long* __restrict__ old_length,
                 const long long* __restrict__ old_hash, const long long* __restrict__ old_prev_hash,
                 const long long* __restrict__ old_node,
                 float* __restrict__ new_blank_logp, float* __restrict__ new_label_logp,
                 long long* __restrict__ new_last, long long* __restrict__ new_length,
                 long long* __restrict__ new_hash, long long* __restrict__ new_prev_hash,
                 long long* __restrict__ new_node,
                 long long* __restrict__ node_parent, long long* __restrict__ node_label, long long base,
                 int compare_steps, int has_threshold, float threshold,
                 long long hash_multiplier, long long hash_modulus, unsigned char* __restrict__ unresolved) {
    __shared__ float s_blank[CTC_MAX_BEAM], s_total[CTC_MAX_BEAM];
    __shared__ float s_stay_blank[CTC_MAX_BEAM], s_stay_label[CTC_MAX_BEAM];
    __shared__ long long s_last[CTC_MAX_BEAM], s_length[CTC_MAX_BEAM], s_hash[CTC_MAX_BEAM];
    __shared__ long long s_prev_hash[CTC_MAX_BEAM], s_node[CTC_MAX_BEAM];
    __shared__ int s_kill_lane[CTC_MAX_BEAM], s_kill_label[CTC_MAX_BEAM];
    __shared__ bool s_retime[CTC_MAX_BEAM];
    __shared__ unsigned long long s_warp_best[CTC_THREADS / 32];
    __shared__ float s_warp_max[CTC_THREADS / 32];
    __shared__ unsigned int s_chosen[CTC_MAX_BEAM];

    const int u = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long first = (long long)u * beam;
    Frame frame;
    frame.row = log_probs + ((long long)u * num_frames + t) * vocab_size;
    frame.blank = blank;
    frame.active = t < lengths[u];
    frame.keep = frame.active && !(skip != nullptr && skip[(long long)u * num_frames + t]);

    // lane state, the stay (same prefix) scores
    if (threadIdx.x < beam) {
        const int i = threadIdx.x;
        const float b = old_blank_logp[first + i], l = old_label_logp[first + i];
        const long long last = old_last[first + i];
        s_blank[i] = b;
        s_last[i] = last;
        s_length[i] = old_length[first + i];
        s_hash[i] = old_hash[first + i];
        s_prev_hash[i] = old_prev_hash[first + i];
        s_node[i] = old_node[first + i];
        const float total = log_add_exp(b, l);
        s_total[i] = total;
        s_stay_blank[i] = total + frame.x(blank);
        s_stay_label[i] = last >= 0 ? l + frame.x((int)last) : neg_inf();
    }
    __syncthreads();

    // extension of lane i by label v (before recombination removes some)
    auto emit = [&](int i, int v) -> float {
        if (v == blank) return neg_inf();
        if (s_last[i] >= 0 && v == s_last[i]) return s_blank[i] + frame.x(v);
        return s_total[i] + frame.x(v);
    };

    // recombination: lane j's prefix = lane i's prefix + j's last label (the first such i)
    if (threadIdx.x < beam) {
        const int j = threadIdx.x;
        int match = 0;
        bool matched = false, undecided_any = false;
        const long long node_j = node_parent[s_node[j]];
        for (int i = 0; i < beam; ++i) {
            if (!(s_hash[i] == s_prev_hash[j] && s_length[i] + 1 == s_length[j] && s_total[i] > neg_inf()
                  && s_total[j] > neg_inf())) continue;
            long long a = s_node[i], b = node_j;
            bool equal = a == b, pending = a != b;
            for (int step = 0; pending && (compare_steps < 0 || step < compare_steps); ++step) {
                pending = node_label[a] == node_label[b];
                a = node_parent[a];
                b = node_parent[b];
                if (pending && a == b) {
                    equal = true;
                    pending = false;
                }
            }
            undecided_any |= pending;
            if (equal && !matched) {
                match = i;
                matched = true;
            }
        }
        if (undecided_any) unresolved[0] = 1;
        const int safe_last = s_last[j] >= 0 ? (int)s_last[j] : 0;
        const float merged = emit(match, safe_last);
        s_retime[j] = matched && merged > log_add_exp(s_stay_blank[j], s_stay_label[j]);
        if (matched) s_stay_label[j] = log_add_exp(s_stay_label[j], merged);
        s_kill_lane[j] = matched ? match : -1;
        s_kill_label[j] = safe_last;
    }
    __syncthreads();

    const int num_candidates = beam * vocab_size;
    auto candidate = [&](int c) -> float {
        const int i = c / vocab_size, v = c - i * vocab_size;
        if (v == blank) return log_add_exp(s_stay_blank[i], s_stay_label[i]);
        for (int j = 0; j < beam; ++j)
            if (s_kill_lane[j] == i && s_kill_label[j] == v) return neg_inf();
        return emit(i, v);
    };

    float floor_key = neg_inf();
    if (has_threshold) {  // the utterance's best candidate, minus the threshold
        float best = neg_inf();
        for (int c = threadIdx.x; c < num_candidates; c += CTC_THREADS) best = fmaxf(best, candidate(c));
        best = warp_max_f(best);
        if (lane == 0) s_warp_max[warp] = best;
        __syncthreads();
        best = warp_max_f(lane < CTC_THREADS / 32 ? s_warp_max[lane] : neg_inf());
        floor_key = best - threshold;
    }

    // top `beam` candidates of this thread's share, then `beam` rounds of the block maximum
    unsigned long long kept[CTC_MAX_BEAM];
    for (int r = 0; r < beam; ++r) kept[r] = 0ull;
    for (int c = threadIdx.x; c < num_candidates; c += CTC_THREADS) {
        float value = candidate(c);
        if (has_threshold && !(value >= floor_key)) value = neg_inf();
        const unsigned long long key = pack_key(value, (unsigned int)c);
        if (key <= kept[beam - 1]) continue;
        int r = beam - 1;
        while (r > 0 && kept[r - 1] < key) {
            kept[r] = kept[r - 1];
            --r;
        }
        kept[r] = key;
    }
    int head = 0;
    for (int round = 0; round < beam; ++round) {
        const unsigned long long mine = head < beam ? kept[head] : 0ull;
        const unsigned long long in_warp = warp_max_u64(mine);
        if (lane == 0) s_warp_best[warp] = in_warp;
        __syncthreads();
        const unsigned long long winner = warp_max_u64(lane < CTC_THREADS / 32 ? s_warp_best[lane] : 0ull);
        if (mine == winner && mine != 0ull) ++head;
        if (threadIdx.x == 0) s_chosen[round] = ~(unsigned int)(winner & 0xffffffffull);
        __syncthreads();
    }

    // the new lanes
    if (threadIdx.x < beam) {
        const int b = threadIdx.x;
        const int c = (int)s_chosen[b];
        float value = candidate(c);
        if (has_threshold && !(value >= floor_key)) value = neg_inf();
        const bool alive = value > neg_inf();
        const int p = c / vocab_size;
        const int label = c - p * vocab_size;
        const bool stay = label == blank || !alive;
        const bool retimed = stay && alive && s_retime[p];
        const long long out = first + b;
        const long long parent_node = s_node[p];
        node_parent[base + out] = retimed ? node_parent[parent_node] : parent_node;
        node_label[base + out] = retimed ? s_last[p] : (long long)label;
        new_blank_logp[out] = (stay && alive) ? s_stay_blank[p] : neg_inf();
        new_label_logp[out] = stay ? (alive ? s_stay_label[p] : neg_inf()) : emit(p, label);
        new_node[out] = (stay && !retimed) ? parent_node : base + out;
        new_prev_hash[out] = stay ? s_prev_hash[p] : s_hash[p];
        new_hash[out] = stay ? s_hash[p] : (s_hash[p] * hash_multiplier + label + 1) % hash_modulus;
        new_last[out] = stay ? s_last[p] : (long long)label;
        new_length[out] = s_length[p] + (stay ? 0 : 1);
    }
}
