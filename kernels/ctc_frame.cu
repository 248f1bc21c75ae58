// The CTC prefix beam search (gpudecode/search/ctc_frame.py; the array version is _PrefixSearch in
// gpudecode/search/ctc.py): one thread block per utterance loops over the frames [frame_begin,
// frame_end) — utterances never interact — with the lanes' state in shared memory. A full frame is
// candidates, recombination with the collision check, score threshold, top-beam and the new lanes;
// a blank-only frame (every active utterance skips it) only moves all mass to the blank ending.
// Without label scorers every frame is one launch (ctc_prefix_frames_<K>); with scorers
// (ctc_prefix_frames_scored_<K>) a launch ends
// with one full frame, ranked with the scorers' terms, and says per new lane where it came from, so
// that the host can run the scorers on the lanes that emitted before the next full frame.
//
// Memory layout
// -------------
//   log_probs   [U, T, V] float32 (contiguous)          lengths [U] int64 valid frames
//   frame_kinds [T] int8: 0 no utterance has the frame, 1 blank only, 2 searched in full
//   skip        [U, T] uint8 or null (1: the utterance treats frame t as blank only)
//   lane state  [N = U * beam], lane b of utterance u at u * beam + b, read at the start and
//               written at the end (in place):
//     blank_logp, label_logp float32   prefix log-prob ending in blank / in its last label
//     last, length, hash, prev_hash, node int64   last label (-1: empty), prefix length, rolling
//               hash of the prefix and of the prefix without its last label, emission node
//   node_parent, node_label [1 + full frames * N] int64: the emission tree; the k-th full frame's
//               nodes are 1 + k * N + lane, written for every lane
//   unresolved  [1] uint8: set to 1 when a hash-equal pair stays undecided after compare_steps
//   top_labels  [U, T, num_top] int32 or null: per frame its num_top best labels other than blank,
//               best first (larger log-prob, then lower label), written by ctc_top_labels_<P> (a warp
//               per frame: the labels above a threshold ranked in static shared memory, [8 warps][64]
//               packed keys, with per-thread lists in registers as the fallback; see top_labels_rows)
//   top_values  [U, T, num_top] float32 or null: their log-probs
//   dynamic shared memory: [V] float32, the frame's log-probs, when row_in_shared (else 0 bytes)
//   frame_begin, frame_end, full_begin: the frames this launch searches and the index k of the first
//               full frame among them (the emission nodes' offset)
//   step        [3] int64 or null: when set, frame_begin, frame_end and full_begin are read from it
//               (a launch captured in a CUDA graph and replayed frame after frame)
//   with scorers (all null without; then the launch's frames hold at most one full frame):
//     lm_term   [N, V] float32: Σ scale · score of label v after lane i's prefix (the scorers' cache)
//     lm_total  [N] float32: Σ scale · score of lane i's prefix so far
//     candidates then rank (extension + lm_total) + lm_term and stay + lm_total; the new lanes' path
//     scores are without them. Written for the full frame, per new lane b:
//     new_parent [N] int64 the lane it continues; new_label [N] int64 the label it emitted, -1 none;
//     new_transition [N] int8 0 label, 1 blank, 2 loop (the stay's label ending outweighs its blank)
//
// Per block: one thread per lane for the state and the recombination (a serial walk of the
// emission tree per hash-equal pair); the frame's log-prob row is staged in dynamic shared memory
// (row_in_shared, when V floats fit); every thread scans a strided share of the beam * V
// candidates keeping its best KEPT >= beam (key, column) pairs in registers, packed into uint64
// (packed_key.cuh) so that equal keys keep the lower column; each warp's best `beam`, ranked across
// the block, give the winners in order with their values (block_top_beam.cuh). A lane's parent
// node (node_parent[node]) is kept in shared memory with its state, so a frame's only global reads
// are the frame's log-probs (x(blank), each lane's x(last label), the listed labels' values), all
// issued together while the lanes' stay scores are formed.
//
// The label prefilter (top_labels, num_top = P + 1 with P >= 2 * beam): a lane's extensions other
// than its last label rank in the order of the frame's log-probs, and at most beam - 1 of them are
// recombined away (one per other lane), so only the blank (stay), the last label and the frame's P
// best labels can reach the top beam. That holds as long as the P-th and (P+1)-th labels give a
// lane different sums (a float rounding tie could let a later, lower label win); a frame where
// some live lane has such a tie is searched over all labels. Lanes that end up dead (-inf) may
// hold other prefixes than with the full scan; they never score again.

#include "packed_key.cuh"
#include "search_math.cuh"
#include "block_top_beam.cuh"

#define CTC_THREADS 256
#define CTC_MAX_BEAM 32
#define CTC_MAX_TOP 33  // the longest label list, ctc_top_labels_33
#define TOP_LABELS_LOADS 8  // log-probs a thread of ctc_top_labels_<P> loads at once
#define TOP_LABELS_CAP 64  // candidates a warp of ctc_top_labels_<P> ranks in shared memory (a multiple of 32)

struct Lanes {  // one utterance's lanes
    float blank[CTC_MAX_BEAM], label[CTC_MAX_BEAM];
    long long last[CTC_MAX_BEAM], length[CTC_MAX_BEAM], hash[CTC_MAX_BEAM], prev_hash[CTC_MAX_BEAM],
        node[CTC_MAX_BEAM], parent_node[CTC_MAX_BEAM];  // parent_node: node_parent[node], kept here
};

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

// KEPT (8, 16 or 32, >= beam): the per-thread candidate list, held in registers (unrolled).
// SCORED: ranked with the scorers' terms (ctc_prefix_frames_scored_<K>; lm_term and the new_* not null).
template <int KEPT, bool SCORED>
__device__ __forceinline__ void prefix_frames(const float* __restrict__ log_probs, int num_frames, int vocab_size, int blank,
                  const signed char* __restrict__ frame_kinds, const long long* __restrict__ lengths,
                  const unsigned char* __restrict__ skip, int beam,
                  float* __restrict__ blank_logp, float* __restrict__ label_logp, long long* __restrict__ last,
                  long long* __restrict__ length, long long* __restrict__ hash, long long* __restrict__ prev_hash,
                  long long* __restrict__ node, long long* __restrict__ node_parent,
                  long long* __restrict__ node_label, int compare_steps, int has_threshold, float threshold,
                  long long hash_multiplier, long long hash_modulus, unsigned char* __restrict__ unresolved,
                  int row_in_shared, const int* __restrict__ top_labels, const float* __restrict__ top_values,
                  int num_top, int frame_begin, int frame_end, long long full_begin,
                  const float* __restrict__ lm_term, const float* __restrict__ lm_total,
                  long long* __restrict__ new_parent, long long* __restrict__ new_label,
                  signed char* __restrict__ new_transition, const long long* __restrict__ step) {
    __shared__ Lanes cur, next;
    __shared__ float s_total[CTC_MAX_BEAM], s_stay_blank[CTC_MAX_BEAM], s_stay_label[CTC_MAX_BEAM];
    __shared__ float s_x_last[CTC_MAX_BEAM];  // x(last label), lane by lane
    __shared__ float s_lm_total[CTC_MAX_BEAM];  // SCORED: lm_total of the lanes
    __shared__ int s_kill_lane[CTC_MAX_BEAM], s_kill_label[CTC_MAX_BEAM];
    __shared__ bool s_retime[CTC_MAX_BEAM], s_tie[CTC_MAX_BEAM];
    __shared__ int s_top_label[CTC_MAX_TOP];  // the frame's listed labels and their x
    __shared__ float s_top_x[CTC_MAX_TOP];
    __shared__ unsigned long long s_warp_lists[CTC_THREADS / 32 * CTC_MAX_BEAM];
    __shared__ float s_warp_max[CTC_THREADS / 32];
    __shared__ unsigned int s_chosen[CTC_MAX_BEAM];
    __shared__ float s_chosen_value[CTC_MAX_BEAM];
    extern __shared__ float s_row[];  // the frame's log-probs [V] when row_in_shared

    if (step != nullptr) {
        frame_begin = (int)step[0];
        frame_end = (int)step[1];
        full_begin = step[2];
    }
    const int u = blockIdx.x;
    const long long first = (long long)u * beam;
    const long long num_lanes = (long long)gridDim.x * beam;
    const long long utterance_length = lengths[u];
    const int i_own = threadIdx.x;  // the lane this thread keeps, when < beam
    const int k_own = threadIdx.x - CTC_MAX_BEAM;  // the listed label this thread loads, when in [0, num_top)
    if (i_own < beam) {
        cur.blank[i_own] = blank_logp[first + i_own];
        cur.label[i_own] = label_logp[first + i_own];
        cur.last[i_own] = last[first + i_own];
        cur.length[i_own] = length[first + i_own];
        cur.hash[i_own] = hash[first + i_own];
        cur.prev_hash[i_own] = prev_hash[first + i_own];
        cur.node[i_own] = node[first + i_own];
        cur.parent_node[i_own] = node_parent[cur.node[i_own]];
    }
    __syncthreads();

    constexpr bool lm = SCORED;
    long long full_index = full_begin;  // k: full frames so far
    for (int t = frame_begin; t < frame_end; ++t) {
        const int kind = frame_kinds[t];
        if (kind == 0) continue;
        Frame frame;
        frame.row = log_probs + ((long long)u * num_frames + t) * vocab_size;
        frame.blank = blank;
        frame.active = t < utterance_length;
        frame.keep = frame.active && !(skip != nullptr && skip[(long long)u * num_frames + t]);
        if (kind == 1) {  // blank only: the prefixes stay, all mass ends in blank
            if (i_own < beam) {
                const float total = log_add_exp(cur.blank[i_own], cur.label[i_own]);
                cur.blank[i_own] = total + (frame.active ? frame.row[blank] : 0.0f);
                cur.label[i_own] = neg_inf();
            }
            __syncthreads();
            continue;
        }
        const long long base = 1 + full_index * num_lanes;
        ++full_index;
        if (row_in_shared) {  // one coalesced load of the row; every candidate reads it
            for (int v = threadIdx.x; v < vocab_size; v += CTC_THREADS) s_row[v] = frame.row[v];
            frame.row = s_row;
            __syncthreads();
        }

        // the stay (same prefix) scores; meanwhile other threads load the listed labels
        const bool listed = num_top > 0;
        if (i_own < beam) {
            const float total = log_add_exp(cur.blank[i_own], cur.label[i_own]);
            const float x_last = cur.last[i_own] >= 0 ? frame.x((int)cur.last[i_own]) : neg_inf();
            s_total[i_own] = total;
            s_x_last[i_own] = x_last;
            s_stay_blank[i_own] = total + frame.x(blank);
            s_stay_label[i_own] = cur.last[i_own] >= 0 ? cur.label[i_own] + x_last : neg_inf();
            if (lm) s_lm_total[i_own] = lm_total[first + i_own];
        } else if (listed && k_own >= 0 && k_own < num_top) {
            const long long at = ((long long)u * num_frames + t) * num_top + k_own;
            s_top_label[k_own] = top_labels[at];
            s_top_x[k_own] = frame.keep ? top_values[at] : neg_inf();  // listed labels are never blank
        }
        __syncthreads();

        // extension of lane i by label v whose log-prob is xv (before recombination removes some)
        auto emit_x = [&](int i, int v, float xv) -> float {
            if (v == blank) return neg_inf();
            if (cur.last[i] >= 0 && v == cur.last[i]) return cur.blank[i] + xv;
            return s_total[i] + xv;
        };

        // recombination: lane j's prefix = lane i's prefix + j's last label (the first such i); and
        // whether lane j's sums tie at the list's end (then the frame is scanned in full)
        if (i_own < beam) {
            const int j = i_own;
            int match = 0;
            bool matched = false, undecided_any = false;
            const long long node_j = cur.parent_node[j];
            for (int i = 0; i < beam; ++i) {
                if (!(cur.hash[i] == cur.prev_hash[j] && cur.length[i] + 1 == cur.length[j]
                      && s_total[i] > neg_inf() && s_total[j] > neg_inf())) continue;
                bool undecided;
                const bool equal = paths_equal(cur.node[i], node_j, node_label, node_parent, compare_steps,
                                               &undecided);
                undecided_any |= undecided;
                if (equal && !matched) {
                    match = i;
                    matched = true;
                }
            }
            if (undecided_any) unresolved[0] = 1;
            const int safe_last = cur.last[j] >= 0 ? (int)cur.last[j] : 0;
            const float merged = emit_x(match, safe_last, s_x_last[j]);
            s_retime[j] = matched && merged > log_add_exp(s_stay_blank[j], s_stay_label[j]);
            if (matched) s_stay_label[j] = log_add_exp(s_stay_label[j], merged);
            s_kill_lane[j] = matched ? match : -1;
            s_kill_label[j] = safe_last;
            bool tie = false;
            if (listed && s_total[j] > neg_inf()) {
                const float at_end = s_total[j] + s_top_x[num_top - 2], after = s_total[j] + s_top_x[num_top - 1];
                tie = at_end == after && at_end > neg_inf();
            }
            s_tie[j] = tie;
        }
        __syncthreads();
        bool full_scan = !listed;
        for (int i = 0; i < beam && !full_scan; ++i) full_scan = s_tie[i];

        auto killed = [&](int i, int v) -> bool {
            for (int j = 0; j < beam; ++j)
                if (s_kill_lane[j] == i && s_kill_label[j] == v) return true;
            return false;
        };
        auto stay = [&](int i) -> float { return log_add_exp(s_stay_blank[i], s_stay_label[i]); };

        if (full_scan) {
            auto candidate = [&](int i, int v) -> float {  // column c = i * V + v
                if (lm) {  // ranked with the scorers: (emit + lm_total) + lm_term, stay + lm_total
                    if (v == blank) return stay(i) + s_lm_total[i];
                    if (killed(i, v)) return neg_inf();
                    return (emit_x(i, v, frame.x(v)) + s_lm_total[i]) + lm_term[(first + i) * vocab_size + v];
                }
                if (v == blank) return stay(i);
                return killed(i, v) ? neg_inf() : emit_x(i, v, frame.x(v));
            };
            block_top_beam<KEPT, CTC_THREADS>(candidate, beam, vocab_size, has_threshold, threshold, s_warp_lists,
                                              s_warp_max, s_chosen, s_chosen_value);
        } else {  // per lane: the blank (stay), its last label, the frame's best num_top - 1 labels
            const int slots = num_top + 1;
            auto scan = [&](auto&& visit) {
                for (int k = threadIdx.x; k < beam * slots; k += CTC_THREADS) {
                    const int i = k / slots, slot = k - i * slots;
                    const int last_i = (int)cur.last[i];
                    const int v = slot == 0 ? blank : (slot == 1 ? last_i : s_top_label[slot - 2]);
                    if (!(slot == 1 ? last_i >= 0 : (slot == 0 || v != last_i))) continue;  // each label once
                    const float xv = slot == 1 ? s_x_last[i] : (slot == 0 ? 0.0f : s_top_x[slot - 2]);
                    const float value = slot == 0 ? stay(i) : (killed(i, v) ? neg_inf() : emit_x(i, v, xv));
                    visit(value, (unsigned int)(i * vocab_size + v));
                }
            };
            block_top_beam_scan<KEPT, CTC_THREADS>(scan, beam, has_threshold, threshold, s_warp_lists, s_warp_max,
                                                   s_chosen, s_chosen_value);
        }

        // the new lanes (the winners' values come with them, thresholded)
        if (i_own < beam) {
            const int b = i_own;
            const int c = (int)s_chosen[b];
            const int p = c / vocab_size;
            const int label = c - p * vocab_size;
            const float value = s_chosen_value[b];
            const bool alive = value > neg_inf();
            const bool stays = label == blank || !alive;
            const bool retimed = stays && alive && s_retime[p];
            const long long out = base + first + b;
            const long long parent_node = cur.node[p];
            const long long out_parent = retimed ? cur.parent_node[p] : parent_node;
            node_parent[out] = out_parent;
            node_label[out] = retimed ? cur.last[p] : (long long)label;
            next.blank[b] = (stays && alive) ? s_stay_blank[p] : neg_inf();
            next.label[b] = stays ? (alive ? s_stay_label[p] : neg_inf()) : value;
            next.node[b] = (stays && !retimed) ? parent_node : out;
            next.parent_node[b] = (stays && !retimed) ? cur.parent_node[p] : out_parent;
            next.prev_hash[b] = stays ? cur.prev_hash[p] : cur.hash[p];
            next.hash[b] = stays ? cur.hash[p] : (cur.hash[p] * hash_multiplier + label + 1) % hash_modulus;
            next.last[b] = stays ? cur.last[p] : (long long)label;
            next.length[b] = cur.length[p] + (stays ? 0 : 1);
            if (lm) {  // the chosen value holds the scorers' terms: the prefix's own path score without them
                if (!stays) next.label[b] = emit_x(p, label, frame.x(label));
                new_parent[first + b] = first + p;
                new_label[first + b] = stays ? -1 : (long long)label;
                new_transition[first + b] = !stays ? 0 : (s_stay_label[p] > s_stay_blank[p] ? 2 : 1);
            }
        }
        __syncthreads();
        if (i_own < beam) {
            cur.blank[i_own] = next.blank[i_own];
            cur.label[i_own] = next.label[i_own];
            cur.last[i_own] = next.last[i_own];
            cur.length[i_own] = next.length[i_own];
            cur.hash[i_own] = next.hash[i_own];
            cur.prev_hash[i_own] = next.prev_hash[i_own];
            cur.node[i_own] = next.node[i_own];
            cur.parent_node[i_own] = next.parent_node[i_own];
        }
        __syncthreads();
    }
    if (i_own < beam) {
        blank_logp[first + i_own] = cur.blank[i_own];
        label_logp[first + i_own] = cur.label[i_own];
        last[first + i_own] = cur.last[i_own];
        length[first + i_own] = cur.length[i_own];
        hash[first + i_own] = cur.hash[i_own];
        prev_hash[first + i_own] = cur.prev_hash[i_own];
        node[first + i_own] = cur.node[i_own];
    }
}

#define CTC_ENTRY(NAME, KEPT, SCORED, MIN_BLOCKS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(CTC_THREADS, MIN_BLOCKS) NAME(       \
        const float* __restrict__ log_probs, int num_frames, int vocab_size, int blank,                   \
        const signed char* __restrict__ frame_kinds, const long long* __restrict__ lengths,               \
        const unsigned char* __restrict__ skip, int beam, float* __restrict__ blank_logp,                 \
        float* __restrict__ label_logp, long long* __restrict__ last, long long* __restrict__ length,     \
        long long* __restrict__ hash, long long* __restrict__ prev_hash, long long* __restrict__ node,    \
        long long* __restrict__ node_parent, long long* __restrict__ node_label, int compare_steps,       \
        int has_threshold, float threshold, long long hash_multiplier, long long hash_modulus,            \
        unsigned char* __restrict__ unresolved, int row_in_shared, const int* __restrict__ top_labels,     \
        const float* __restrict__ top_values, int num_top, int frame_begin, int frame_end,                \
        long long full_begin, const float* __restrict__ lm_term, const float* __restrict__ lm_total,      \
        long long* __restrict__ new_parent, long long* __restrict__ new_label,                            \
        signed char* __restrict__ new_transition, const long long* __restrict__ step) {                   \
        prefix_frames<KEPT, SCORED>(log_probs, num_frames, vocab_size, blank, frame_kinds, lengths, skip, beam,   \
                            blank_logp, label_logp, last, length, hash, prev_hash, node, node_parent,     \
                            node_label, compare_steps, has_threshold, threshold, hash_multiplier,         \
                            hash_modulus, unresolved, row_in_shared, top_labels, top_values, num_top,     \
                            frame_begin, frame_end, full_begin, lm_term, lm_total, new_parent,            \
                            new_label, new_transition, step);                                             \
    }
CTC_ENTRY(ctc_prefix_frames_8, 8, false, 0)
CTC_ENTRY(ctc_prefix_frames_16, 16, false, 0)
CTC_ENTRY(ctc_prefix_frames_32, 32, false, 0)
CTC_ENTRY(ctc_prefix_frames_scored_8, 8, true, 1)
CTC_ENTRY(ctc_prefix_frames_scored_16, 16, true, 1)
CTC_ENTRY(ctc_prefix_frames_scored_32, 32, true, 1)

// The label prefilter: per row of log_probs [rows, V], its P best labels other than blank, best
// first (larger log-prob, then lower label; NaN ranks like -inf), into top_labels [rows, P], and
// their log-probs into top_values [rows, P] (-1 / -inf past the row's labels). One warp per row.
// Fast path: each thread keeps its best M = ceil(P / 32) log-probs (blank, NaN and columns >= V as
// -inf); tau, the P-th largest of the warp's 32 * M, is a lower bound of the row's P-th best, so
// the labels with log-prob >= tau (at least P) are the candidates: up to TOP_LABELS_CAP of them go
// to shared memory as packed keys (packed_key.cuh) and each one's rank is the number of larger
// keys. Fallback, where tau is -inf or the candidates overflow (ties, -inf rows, tiny V): each
// thread keeps its best P packed keys in registers, then P rounds of warp max.
template <int P>
__device__ __forceinline__ void top_labels_rows(const float* __restrict__ log_probs, long long num_rows,
                                                int vocab_size, int blank, int* __restrict__ top_labels,
                                                float* __restrict__ top_values) {
    constexpr int M = (P + 31) / 32;
    __shared__ unsigned long long s_candidates[CTC_THREADS / 32][TOP_LABELS_CAP];
    const long long row = (long long)blockIdx.x * (CTC_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= num_rows) return;  // the whole warp
    const int lane = threadIdx.x & 31;
    const float* x = log_probs + row * vocab_size;
    auto for_row = [&](auto&& visit) {  // visit(value, v) for this thread's columns (the whole warp: v >= V too)
        for (int start = 0; start < vocab_size; start += 32 * TOP_LABELS_LOADS) {
            float values[TOP_LABELS_LOADS];  // loads issued together, then visited
#pragma unroll
            for (int j = 0; j < TOP_LABELS_LOADS; ++j) {
                const int v = start + lane + 32 * j;
                values[j] = v < vocab_size ? x[v] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < TOP_LABELS_LOADS; ++j) visit(values[j], start + lane + 32 * j);
        }
    };

    float best[M];  // this thread's best M log-probs, best first
#pragma unroll
    for (int r = 0; r < M; ++r) best[r] = neg_inf();
    for_row([&](float value, int v) {
        float carry = v < vocab_size && v != blank ? fmaxf(value, neg_inf()) : neg_inf();  // NaN -> -inf
#pragma unroll
        for (int r = 0; r < M; ++r) {
            const float higher = fmaxf(best[r], carry);
            carry = fminf(best[r], carry);
            best[r] = higher;
        }
    });
    int count[M] = {};  // how many of the warp's 32 * M are >= best[r]
    for (int src = 0; src < 32; ++src) {
#pragma unroll
        for (int s = 0; s < M; ++s) {
            const float other = __shfl_sync(0xffffffffu, best[s], src);
#pragma unroll
            for (int r = 0; r < M; ++r) count[r] += other >= best[r];
        }
    }
    float tau = neg_inf();
#pragma unroll
    for (int r = 0; r < M; ++r)
        if (count[r] >= P) tau = fmaxf(tau, best[r]);
    tau = warp_max_f(tau);

    if (tau > neg_inf()) {
        unsigned long long* candidates = s_candidates[threadIdx.x >> 5];
        int num_candidates = 0;
        for_row([&](float value, int v) {
            const bool candidate = value >= tau && v < vocab_size && v != blank;  // NaN is not
            const unsigned int ballot = __ballot_sync(0xffffffffu, candidate);
            if (ballot == 0u) return;
            const int at = num_candidates + __popc(ballot & ((1u << lane) - 1u));
            if (candidate && at < TOP_LABELS_CAP) candidates[at] = pack_key(value, (unsigned int)v);
            num_candidates += __popc(ballot);
        });
        if (num_candidates <= TOP_LABELS_CAP) {
            __syncwarp();
#pragma unroll
            for (int k = 0; k < TOP_LABELS_CAP / 32; ++k) {
                const int c = lane + 32 * k;
                if (c >= num_candidates) break;
                const unsigned long long key = candidates[c];
                int rank = 0;
                for (int other = 0; other < num_candidates; ++other) rank += candidates[other] > key;
                if (rank < P) {
                    const int label = (int)~(unsigned int)(key & 0xffffffffull);
                    top_labels[row * P + rank] = label;
                    top_values[row * P + rank] = x[label];
                }
            }
            return;
        }
    }

    unsigned long long kept[P];  // the fallback: best first
#pragma unroll
    for (int r = 0; r < P; ++r) kept[r] = 0ull;
    for_row([&](float value, int v) {
        if (v < vocab_size && v != blank) keep_best(kept, pack_key(value, (unsigned int)v));
    });
    for (int round = 0; round < P; ++round) {
        const unsigned long long winner = warp_max_u64(kept[0]);
        if (kept[0] == winner && winner != 0ull) {
#pragma unroll
            for (int r = 0; r < P - 1; ++r) kept[r] = kept[r + 1];
            kept[P - 1] = 0ull;
        }
        if (lane == 0) {
            const int label = winner != 0ull ? (int)~(unsigned int)(winner & 0xffffffffull) : -1;
            top_labels[row * P + round] = label;
            top_values[row * P + round] = label >= 0 ? x[label] : neg_inf();
        }
    }
}

#define TOP_LABELS_ENTRY(P)                                                                                \
    extern "C" __global__ void __launch_bounds__(CTC_THREADS) ctc_top_labels_##P(                          \
        const float* __restrict__ log_probs, long long num_rows, int vocab_size, int blank,                \
        int* __restrict__ top_labels, float* __restrict__ top_values) {                                    \
        top_labels_rows<P>(log_probs, num_rows, vocab_size, blank, top_labels, top_values);                \
    }
TOP_LABELS_ENTRY(9)
TOP_LABELS_ENTRY(17)
TOP_LABELS_ENTRY(33)
