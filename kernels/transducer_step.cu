// The selection of one transducer symbol step (with or without label scorers' terms), for every
// utterance in ONE launch (gpudecode/search/transducer_step.py; the array version is _TransducerSearch._select in
// gpudecode/search/transducer.py): one thread block per utterance — utterances never interact.
// Stays (blank, or the lane as it is when done) and emissions; with s > 0 the merge of lanes that
// spell the same sequence; on the last symbol step of a frame the merge of an extension into the
// lane that already spells it; score threshold; the best `beam` candidates; the new lanes.
//
// Memory layout
// -------------
//   logp        [N, V] float32 (contiguous): the joint's log-probs, lane b of utterance u at u * beam + b
//   lane state  [N], read at the start (into shared memory) and written at the end (in place):
//     score float32, done uint8, node, last, length, hash, prev_hash int64 (as in the search)
//   node_parent, node_label int64: the emission tree; this step's nodes are base + lane, written for
//               every lane; older nodes are only read
//   parents, labels [N] int64, alive, emitted [N] uint8: the selection, for the prediction network
//   unresolved  [1] uint8: set to 1 when a hash-equal pair stays undecided after compare_steps
//   with label scorers (both null without):
//     lm_term   [N, V] float32: Σ scale · score of label v after lane i's sequence (the scorers' cache)
//     lm_total  [N] float32: Σ scale · score of lane i's sequence so far
//     candidates then rank (emission + lm_total) + lm_term and stay + lm_total; the lanes' scores
//     stay without them
//
// Per block: one thread per lane for the stays and both merges (a serial walk of the emission tree
// per hash-equal pair); every thread scans a strided share of the beam * V candidates keeping its
// best KEPT >= beam (key, column) pairs in registers; each warp's best `beam`, ranked across the
// block, give the winners in order (block_top_beam.cuh).

#include "packed_key.cuh"
#include "search_math.cuh"
#include "block_top_beam.cuh"

#define TRANSDUCER_THREADS 256
#define TRANSDUCER_MAX_BEAM 32

struct Lanes {  // one utterance's lanes, as read at the start of the step
    float score[TRANSDUCER_MAX_BEAM];
    bool done[TRANSDUCER_MAX_BEAM];
    long long node[TRANSDUCER_MAX_BEAM], last[TRANSDUCER_MAX_BEAM], length[TRANSDUCER_MAX_BEAM],
        hash[TRANSDUCER_MAX_BEAM], prev_hash[TRANSDUCER_MAX_BEAM];
};

template <int KEPT>
__device__ __forceinline__ void select_step(
    const float* __restrict__ logp, int vocab_size, int blank, int beam, float* __restrict__ score,
    unsigned char* __restrict__ done, long long* __restrict__ node, long long* __restrict__ last,
    long long* __restrict__ length, long long* __restrict__ hash, long long* __restrict__ prev_hash,
    long long* __restrict__ node_parent, long long* __restrict__ node_label, long long base, int merge_done,
    int forced, int compare_steps, int has_threshold, float threshold, int combine_max,
    long long hash_multiplier, long long hash_modulus, long long* __restrict__ parents,
    long long* __restrict__ labels, unsigned char* __restrict__ alive_out, unsigned char* __restrict__ emitted_out,
    unsigned char* __restrict__ unresolved, const float* __restrict__ lm_term, const float* __restrict__ lm_total) {
    __shared__ Lanes cur;
    __shared__ float s_stay[TRANSDUCER_MAX_BEAM], s_next_stay[TRANSDUCER_MAX_BEAM];
    __shared__ long long s_stay_node[TRANSDUCER_MAX_BEAM], s_next_stay_node[TRANSDUCER_MAX_BEAM];
    __shared__ long long s_stay_node_parent[TRANSDUCER_MAX_BEAM];
    __shared__ bool s_stay_new[TRANSDUCER_MAX_BEAM];
    __shared__ int s_kill_lane[TRANSDUCER_MAX_BEAM], s_kill_label[TRANSDUCER_MAX_BEAM];
    __shared__ unsigned long long s_warp_lists[TRANSDUCER_THREADS / 32 * TRANSDUCER_MAX_BEAM];
    __shared__ float s_warp_max[TRANSDUCER_THREADS / 32];
    __shared__ unsigned int s_chosen[TRANSDUCER_MAX_BEAM];

    const long long first = (long long)blockIdx.x * beam;
    const int me = threadIdx.x;  // the lane this thread keeps, when < beam
    if (me < beam) {
        cur.score[me] = score[first + me];
        cur.done[me] = done[first + me] != 0;
        cur.node[me] = node[first + me];
        cur.last[me] = last[first + me];
        cur.length[me] = length[first + me];
        cur.hash[me] = hash[first + me];
        cur.prev_hash[me] = prev_hash[first + me];
    }
    __syncthreads();

    auto alive = [&](int i) -> bool { return cur.score[i] > neg_inf(); };
    auto active = [&](int i) -> bool { return alive(i) && !cur.done[i]; };
    auto safe_last = [&](int i) -> int { return cur.last[i] >= 0 ? (int)cur.last[i] : 0; };
    auto emit = [&](int i, int v) -> float {
        if (v == blank || !active(i)) return neg_inf();
        return cur.score[i] + logp[(first + i) * vocab_size + v];
    };
    auto combine = [&](float a, float b) -> float { return combine_max ? fmaxf(a, b) : log_add_exp(a, b); };

    bool undecided_any = false;
    if (me < beam) {
        s_stay[me] = active(me) ? cur.score[me] + logp[(first + me) * vocab_size + blank] : cur.score[me];
        s_stay_node[me] = cur.node[me];
        s_stay_new[me] = false;
        s_stay_node_parent[me] = 0;
        s_kill_lane[me] = -1;
        s_kill_label[me] = 0;
    }
    __syncthreads();

    if (merge_done) {  // s > 0: lane i takes in the first later lane j that spells its sequence
        if (me < beam) {
            const int i = me;
            bool absorbs = false, absorbed = false;
            int partner = 0;
            for (int j = 0; j < beam; ++j) {
                if (j == i) continue;
                const int a = min(i, j), b = max(i, j);
                if (!(cur.hash[a] == cur.hash[b] && cur.length[a] == cur.length[b] && alive(a) && alive(b))) continue;
                bool undecided;
                const bool equal = paths_equal(cur.node[a], cur.node[b], node_label, node_parent, compare_steps,
                                               &undecided);
                undecided_any |= undecided;
                if (!equal) continue;
                if (j > i) {
                    if (!absorbs) partner = j;
                    absorbs = true;
                } else {
                    absorbed = true;
                }
            }
            float stay = s_stay[i];
            long long stay_node = s_stay_node[i];
            if (absorbs && s_stay[partner] > s_stay[i]) stay_node = cur.node[partner];
            if (absorbs) stay = combine(s_stay[i], s_stay[partner]);
            if (absorbed) stay = neg_inf();
            s_next_stay[i] = stay;
            s_next_stay_node[i] = stay_node;
        }
        __syncthreads();
        if (me < beam) {
            s_stay[me] = s_next_stay[me];
            s_stay_node[me] = s_next_stay_node[me];
        }
        __syncthreads();
    }

    if (forced) {  // lane j's sequence = lane i's + j's last label: the extension joins j's stay
        if (me < beam) {
            const int j = me;
            int match = 0;
            bool matched = false;
            const long long node_j = node_parent[cur.node[j]];
            for (int i = 0; i < beam; ++i) {
                if (!(cur.hash[i] == cur.prev_hash[j] && cur.length[i] + 1 == cur.length[j] && active(i)
                      && s_stay[j] > neg_inf())) continue;
                bool undecided;
                const bool equal = paths_equal(cur.node[i], node_j, node_label, node_parent, compare_steps, &undecided);
                undecided_any |= undecided;
                if (equal && !matched) {
                    match = i;
                    matched = true;
                }
            }
            const float merged = emit(match, safe_last(j));
            s_stay_new[j] = matched && merged > s_stay[j];
            s_stay_node_parent[j] = cur.node[match];
            if (matched) {
                s_stay[j] = combine(s_stay[j], merged);
                s_kill_lane[j] = match;
                s_kill_label[j] = safe_last(j);
            }
        }
    }
    if (undecided_any) unresolved[0] = 1;
    __syncthreads();

    const bool lm = lm_term != nullptr;
    auto candidate = [&](int i, int v) -> float {  // column c = i * V + v
        if (v == blank) return lm ? s_stay[i] + lm_total[first + i] : s_stay[i];
        for (int j = 0; j < beam; ++j)
            if (s_kill_lane[j] == i && s_kill_label[j] == v) return neg_inf();
        if (lm) return (emit(i, v) + lm_total[first + i]) + lm_term[(first + i) * vocab_size + v];
        return emit(i, v);
    };

    const float floor_key = block_top_beam<KEPT, TRANSDUCER_THREADS>(
        candidate, beam, vocab_size, has_threshold, threshold, s_warp_lists, s_warp_max, s_chosen, nullptr);

    // the new lanes (every read of the old state above came from shared memory)
    if (me < beam) {
        const int b = me;
        const int c = (int)s_chosen[b];
        const int p = c / vocab_size;
        const int label = c - p * vocab_size;
        float value = candidate(p, label);
        if (has_threshold && !(value >= floor_key)) value = neg_inf();
        const bool alive_new = value > neg_inf();
        const bool is_stay = label == blank || !alive_new;
        const bool fresh = !is_stay || (alive_new && s_stay_new[p]);
        const long long out = base + first + b;
        node_parent[out] = is_stay ? s_stay_node_parent[p] : cur.node[p];
        node_label[out] = is_stay ? (long long)safe_last(p) : (long long)label;
        node[first + b] = fresh ? out : s_stay_node[p];
        score[first + b] = is_stay ? (alive_new ? s_stay[p] : neg_inf()) : emit(p, label);
        done[first + b] = (is_stay || forced) ? 1 : 0;
        prev_hash[first + b] = is_stay ? cur.prev_hash[p] : cur.hash[p];
        hash[first + b] = is_stay ? cur.hash[p] : (cur.hash[p] * hash_multiplier + label + 1) % hash_modulus;
        last[first + b] = is_stay ? cur.last[p] : (long long)label;
        length[first + b] = cur.length[p] + (is_stay ? 0 : 1);
        parents[first + b] = first + p;
        labels[first + b] = label;
        alive_out[first + b] = alive_new ? 1 : 0;
        emitted_out[first + b] = is_stay ? 0 : 1;
    }
}

#define TRANSDUCER_ENTRY(KEPT)                                                                            \
    extern "C" __global__ void __launch_bounds__(TRANSDUCER_THREADS) transducer_select_##KEPT(            \
        const float* __restrict__ logp, int vocab_size, int blank, int beam, float* __restrict__ score,   \
        unsigned char* __restrict__ done, long long* __restrict__ node, long long* __restrict__ last,     \
        long long* __restrict__ length, long long* __restrict__ hash, long long* __restrict__ prev_hash,  \
        long long* __restrict__ node_parent, long long* __restrict__ node_label, long long base,          \
        int merge_done, int forced, int compare_steps, int has_threshold, float threshold,               \
        int combine_max, long long hash_multiplier, long long hash_modulus,                               \
        long long* __restrict__ parents, long long* __restrict__ labels,                                  \
        unsigned char* __restrict__ alive_out, unsigned char* __restrict__ emitted_out,                   \
        unsigned char* __restrict__ unresolved, const float* __restrict__ lm_term,                        \
        const float* __restrict__ lm_total) {                                                             \
        select_step<KEPT>(logp, vocab_size, blank, beam, score, done, node, last, length, hash,           \
                          prev_hash, node_parent, node_label, base, merge_done, forced, compare_steps,    \
                          has_threshold, threshold, combine_max, hash_multiplier, hash_modulus, parents,  \
                          labels, alive_out, emitted_out, unresolved, lm_term, lm_total);                 \
    }
TRANSDUCER_ENTRY(8)
TRANSDUCER_ENTRY(16)
TRANSDUCER_ENTRY(32)
