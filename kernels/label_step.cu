// The selection of one label-synchronous search step for every utterance in TWO launches
// (gpudecode/search/label_step.py; the array version is _select in gpudecode/search/label_sync.py).
// The candidates of an utterance are its beam * V (lane, label) pairs: an open lane extends by every
// label (its score + the combined score), a terminated lane offers only itself (label column 0, its
// score unchanged), a dead lane (score -inf) nothing. Ranked by score / norm (the length
// normaliser), with the score threshold, the best `beam` survive (equal ranks go to the lower lane,
// then label: packed_key.cuh).
//   label_lane_top_<K>_<T>  one block per SEGMENT of LABEL_SEGMENT labels of a lane: the segment's best
//                       `beam` candidates (no threshold), so N x ceil(V / LABEL_SEGMENT) blocks read
//                       the step's N x V scores, eight labels per thread
//   label_select_<K>    one block per UTTERANCE: the best `beam` of its segment lists, the threshold,
//                       and the new lanes. Exact: a candidate among the utterance's best `beam` is
//                       among its segment's best `beam`; so is the threshold's best; and where fewer
//                       than `beam` candidates are left above -inf, the rest are -inf candidates of
//                       lane 0 (of lane 1, ... where V < beam) in both, whose labels are never used
//
// Memory layout
// -------------
//   term0 .. term3   [N, V] float32 or float16 (bit s of term_half; contiguous), or one row [V] that
//                    every lane shares (bit s of term_row: a scorer's broadcast row), read as float32: the
//                    combined score Σ scale_s · term_s over the first
//                    num_terms terms (1 to 4; label_lane_top_<K>_<num_terms>), each product rounded
//                    to float32 and summed in order, as scorers/combine.py::combine_scores (the host
//                    leaves out terms of scale 0); lane b of utterance u is row u * beam + b
//   logp0 .. logp3   [N, V] float32 or float16 (bit s of logp_half; contiguous), or one row [V] (bit s
//                    of logp_row): each scorer's unscaled
//                    log-probs (num_scorers <= 4 used; the others are never read)
//   score [N] float32, length [N] int64, ended [N] uint8: the lanes before the step
//   norm             [N] float32, or null for 1: the length normaliser of each lane's candidates
//   length           [N] int64: with min_length > 0 an open lane of fewer labels offers no
//                    sentence_end candidate (ranked -inf, as _mask_sentence_end in search/beam.py)
//   lane_keys        [N, segments, beam] uint64: a segment's best candidates, packed (rank, column
//                    i * V + v of the utterance; 0: none); segments = ceil(V / LABEL_SEGMENT)
//   scorer_scores    [num_scorers, N] float32 (contiguous): each scorer's score of each lane
//   deadline         [N] int64: a lane reaches its utterance's label limit with step `step` when
//                    deadline <= step (then it ends)
//   out              parents, labels [N] int64 (label -1: carried), score_out [N] float32,
//                    length_out [N] int64, ended_out [N] uint8, scorer_out [num_scorers, N] float32;
//                    new lane u * beam + r is the utterance's r-th best candidate

#include "packed_key.cuh"
#include "search_math.cuh"
#include "block_top_beam.cuh"

#define LABEL_THREADS 256
#define LABEL_MAX_BEAM 32
#define LANE_UNROLL 8  // H200, beam 8 x 64, V 10k: 38.6 us per step against 44.2 at 4 and 41.3 at 16
#define LABEL_SEGMENT (LANE_UNROLL * LABEL_THREADS)

struct Terms {
    const void* term[4];
    float scale[4];
    int count;
    int half;  // bit s: term s is float16
    int row;   // bit s: term s is one row [V] for every lane
    // label v of the lane whose row starts at row_start (= lane * V)
    __device__ __forceinline__ float value(int s, long long row_start, int v) const {
        return load_score(term[s], ((row >> s) & 1) ? (long long)v : row_start + v, (half >> s) & 1);
    }
    __device__ __forceinline__ float combined(long long row_start, int v) const {  // no contraction into FMAs
        float total = __fmul_rn(value(0, row_start, v), scale[0]);
#pragma unroll
        for (int s = 1; s < 4; ++s) {
            if (s >= count) break;
            total = __fadd_rn(total, __fmul_rn(value(s, row_start, v), scale[s]));
        }
        return total;
    }
};

template <int KEPT, int TERMS>
__device__ __forceinline__ void lane_top(const Terms& terms, int vocab_size, int beam, int keep,
                                         const float* __restrict__ score, const unsigned char* __restrict__ ended,
                                         const float* __restrict__ norm, const long long* __restrict__ length,
                                         long long min_length, long long sentence_end,
                                         unsigned long long* __restrict__ lane_keys) {
    __shared__ unsigned long long warp_lists[(LABEL_THREADS / 32) * LABEL_MAX_BEAM];
    __shared__ float warp_max[LABEL_THREADS / 32];
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const int segments = (vocab_size + LABEL_SEGMENT - 1) / LABEL_SEGMENT;
    const long long lane = blockIdx.x / segments;
    const int first_label = (blockIdx.x % segments) * LABEL_SEGMENT;
    const unsigned int base = (unsigned int)(lane % beam) * (unsigned int)vocab_size;  // the lane's first column
    const float lane_score = score[lane], lane_norm = norm != nullptr ? norm[lane] : 1.0f;
    unsigned long long* keys = lane_keys + (long long)blockIdx.x * keep;
    if (ended[lane]) {  // only itself, in column 0; the lowest other columns rank -inf, in segment 0
        const int r = threadIdx.x;
        if (r < keep) {
            const float rank = norm != nullptr ? lane_score / lane_norm : lane_score;
            keys[r] = first_label == 0 && r < vocab_size ? pack_key(r == 0 ? rank : neg_inf(), base + r) : 0ull;
        }
        return;
    }
    const long long row = lane * vocab_size;
    const long long masked_end = min_length > 0 && length[lane] < min_length ? sentence_end : -1;
    auto scan = [&](auto&& visit) {  // LANE_UNROLL labels per thread: all LANE_UNROLL * TERMS loads in flight
        float loaded[LANE_UNROLL][TERMS], values[LANE_UNROLL];
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {  // no branch around a load: past V, label V - 1 is read again
            const int v = min(first_label + k * LABEL_THREADS + (int)threadIdx.x, vocab_size - 1);
#pragma unroll
            for (int t = 0; t < TERMS; ++t) loaded[k][t] = terms.value(t, row, v);
        }
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {  // combine_scores's order and rounding, no FMA
            float total = __fmul_rn(loaded[k][0], terms.scale[0]);
#pragma unroll
            for (int t = 1; t < TERMS; ++t) total = __fadd_rn(total, __fmul_rn(loaded[k][t], terms.scale[t]));
            values[k] = lane_score + total;
        }
#pragma unroll
        for (int k = 0; k < LANE_UNROLL; ++k) {
            const int v = first_label + k * LABEL_THREADS + threadIdx.x;
            const float value = v == masked_end ? neg_inf() : values[k];
            if (v < vocab_size) visit(norm != nullptr ? value / lane_norm : value, base + v);
        }
    };
    block_top_beam_scan<KEPT, LABEL_THREADS>(scan, keep, 0, 0.0f, warp_lists, warp_max, chosen, chosen_rank);
    const int r = threadIdx.x;
    if (r < keep) keys[r] = chosen[r] == ~0u ? 0ull : pack_key(chosen_rank[r], chosen[r]);
}

// The best `keep` candidates of utterance blockIdx.x from its lanes' segment lists (label_lane_top's
// lists of `keep` keys) into chosen / chosen_rank, best first (block_top_beam.cuh; with the threshold).
template <int KEPT>
__device__ __forceinline__ void utterance_top(const unsigned long long* __restrict__ lane_keys, int vocab_size,
                                              int beam, int keep, int has_threshold, float threshold,
                                              unsigned int* chosen, float* chosen_rank) {
    __shared__ unsigned long long warp_lists[(LABEL_THREADS / 32) * LABEL_MAX_BEAM];
    __shared__ float warp_max[LABEL_THREADS / 32];
    const int listed = beam * ((vocab_size + LABEL_SEGMENT - 1) / LABEL_SEGMENT) * keep;  // the lanes' lists
    const unsigned long long* keys = lane_keys + (long long)blockIdx.x * listed;
    auto scan = [&](auto&& visit) {
        for (int e = threadIdx.x; e < listed; e += LABEL_THREADS) {
            const unsigned long long key = keys[e];
            if (key != 0ull) visit(unpack_key_value(key), ~(unsigned int)(key & 0xffffffffull));
        }
    };
    block_top_beam_scan<KEPT, LABEL_THREADS>(scan, keep, has_threshold, threshold, warp_lists, warp_max, chosen,
                                             chosen_rank);
}

template <int KEPT>
__device__ __forceinline__ void select_step(
    const Terms& terms, int vocab_size, int beam, const unsigned long long* __restrict__ lane_keys,
    const float* __restrict__ score, const long long* __restrict__ length, const unsigned char* __restrict__ ended,
    int has_threshold, float threshold, long long sentence_end, const long long* __restrict__ deadline,
    long long step, int num_scorers, const void* logp0, const void* logp1, const void* logp2, const void* logp3,
    int logp_half, int logp_row, const float* __restrict__ scorer_scores,
    long long num_lanes, long long* __restrict__ parents, long long* __restrict__ labels,
    float* __restrict__ score_out, long long* __restrict__ length_out, unsigned char* __restrict__ ended_out,
    float* __restrict__ scorer_out) {
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const long long first = (long long)blockIdx.x * beam;
    utterance_top<KEPT>(lane_keys, vocab_size, beam, beam, has_threshold, threshold, chosen, chosen_rank);

    const int r = threadIdx.x;
    if (r >= beam) return;
    const bool alive = chosen_rank[r] > neg_inf();
    const int i = (int)(chosen[r] / (unsigned int)vocab_size), v = (int)(chosen[r] % (unsigned int)vocab_size);
    const long long parent = first + i, lane = first + r;
    const bool was_ended = ended[parent] != 0;
    const long long label = alive && !was_ended ? v : -1;
    const bool emitted = label >= 0;
    parents[lane] = parent;
    labels[lane] = label;
    score_out[lane] = !alive ? neg_inf() : was_ended ? score[parent]
                                                     : score[parent] + terms.combined(parent * vocab_size, v);
    length_out[lane] = length[parent] + (emitted ? 1 : 0);
    ended_out[lane] = was_ended || !alive || label == sentence_end || deadline[lane] <= step;
    const void* logps[4] = {logp0, logp1, logp2, logp3};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s >= num_scorers) break;
        const long long at = ((logp_row >> s) & 1) ? (long long)v : parent * vocab_size + v;
        const float added = emitted ? load_score(logps[s], at, (logp_half >> s) & 1) : 0.0f;
        scorer_out[s * num_lanes + lane] = scorer_scores[s * num_lanes + parent] + added;
    }
}

#define TERMS_PARAMS                                                                                       \
    const void *term0, const void *term1, const void *term2, const void *term3, float scale0, float scale1, \
        float scale2, float scale3, int num_terms, int term_half, int term_row
#define TERMS_OF_PARAMS                                                                                    \
    Terms{{term0, term1, term2, term3}, {scale0, scale1, scale2, scale3}, num_terms, term_half, term_row}

#define LABEL_LANE_TOP(KEPT, TERMS)                                                                              \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_lane_top_##KEPT##_##TERMS(                \
        TERMS_PARAMS, int vocab_size, int beam, int keep, const float* score, const unsigned char* ended,         \
        const float* norm, const long long* length, long long min_length, long long sentence_end,               \
        unsigned long long* lane_keys) {                                                                        \
        lane_top<KEPT, TERMS>(TERMS_OF_PARAMS, vocab_size, beam, keep, score, ended, norm, length, min_length,  \
                              sentence_end, lane_keys);                                                          \
    }

#define LABEL_STEP(KEPT)                                                                                         \
    LABEL_LANE_TOP(KEPT, 1) LABEL_LANE_TOP(KEPT, 2) LABEL_LANE_TOP(KEPT, 3) LABEL_LANE_TOP(KEPT, 4)              \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_select_##KEPT(                            \
        TERMS_PARAMS, int vocab_size, int beam, const unsigned long long* lane_keys, const float* score,        \
        const long long* length, const unsigned char* ended, int has_threshold, float threshold,                \
        long long sentence_end, const long long* deadline, long long step, int num_scorers, const void* logp0,  \
        const void* logp1, const void* logp2, const void* logp3, int logp_half, int logp_row,                  \
        const float* scorer_scores,                                                                             \
        long long num_lanes, long long* parents, long long* labels, float* score_out, long long* length_out,    \
        unsigned char* ended_out, float* scorer_out) {                                                          \
        select_step<KEPT>(TERMS_OF_PARAMS, vocab_size, beam, lane_keys, score, length, ended, has_threshold,    \
                          threshold, sentence_end, deadline, step, num_scorers, logp0, logp1, logp2, logp3,     \
                          logp_half, logp_row, scorer_scores, num_lanes, parents, labels, score_out, length_out, ended_out, \
                          scorer_out);                                                                          \
    }

LABEL_STEP(8)
LABEL_STEP(16)
LABEL_STEP(32)

// ---- finished="separate" (Hugging Face's beam search) and "separate-genai" (GenAI's BeamSearchScorer) ----
// (the array version is select_separate in gpudecode/search/beam.py, the compiled one
// gpudecode/search/label_sync_cpu_jit.py::select_separate; this follows the latter line by line)
//   label_lane_top_<K>_<T> with keep = size = min(2 * beam, beam * V) and no norm: each lane
//                       segment's best `size` candidates by score
//   label_separate_<K>  one block per UTTERANCE: its best `size` candidates from those lists; then
//                       thread 0 makes the new open lanes (the best `beam` candidates that do not end)
//                       and merges the ending ones (and GenAI's open lanes at the label limit) into the
//                       utterance's finished list, with the stop test
//
// Memory layout (beyond the in-beam step's; G utterances, B = beam, E = B (separate) or 2B (genai))
//   fin_ranks, fin_scores [G * B] float32, fin_scorer [num_scorers, G * B] float32, fin_lengths,
//   fin_steps, fin_lanes, fin_labels [G * B] int64: the finished lists before the step (entry
//                    g * B + b); prompts [G] int64; hopeful, done [G] uint8
//   rank of a finished entry: score / max(counted length, 1) ** norm_scale (norm_scale 0: the score),
//                    the normaliser read from norm_table [norm_size] float32 (numpy's values; powf
//                    beyond it); counted length = labels, plus the prompt where prompt_counts (minus
//                    a final sentence_end)
//   early_stopping   0 False, 1 True, 2 "never"; never_norm: "never" with norm_scale != 0
//   out              the new lanes as label_select_<K> writes them (ended_out with the stop test), the
//                    new lists new_* (same layout as fin_*), new_hopeful, new_done [G] uint8,
//                    picked [G, B] int64 (entry g * B + b came from column picked of [the B old
//                    entries | the E step candidates]), cand_lanes, cand_labels [G * E] int64

#define SEPARATE_MAX_SIZE 32  // 2 * beam
#define SEPARATE_MAX_MERGED (LABEL_MAX_BEAM / 2 + SEPARATE_MAX_SIZE)

struct FinishedLists {
    const float *ranks, *scores, *scorer;
    const long long *lengths, *steps, *lanes, *labels;
};

// The `want` best of values[0 .. count) into out: larger first, equal values (and NaN, as -inf) by index.
__device__ __forceinline__ void best_columns(const float* values, int count, int want, int* out) {
    unsigned long long taken = 0ull;
    for (int j = 0; j < want; ++j) {
        unsigned long long best_key = 0ull;
        int best = 0;
        for (int c = 0; c < count; ++c) {
            if ((taken >> c) & 1ull) continue;
            const unsigned long long key = pack_key(values[c], (unsigned int)c);
            if (key > best_key) best_key = key, best = c;
        }
        taken |= 1ull << best;
        out[j] = best;
    }
}

struct Normaliser {
    float scale;  // 0: ranks are the scores
    const float* table;  // [size] the normaliser of each counted length, as numpy computes it
    long long size;
    __device__ __forceinline__ float rank(float score, long long counted) const {
        if (scale == 0.0f) return score;
        return score / (counted < size ? table[counted] : powf(fmaxf((float)counted, 1.0f), scale));
    }
};

template <int KEPT>
__device__ __forceinline__ void separate_step(
    const Terms& terms, int vocab_size, int beam, int size, const unsigned long long* __restrict__ lane_keys,
    const float* __restrict__ score, const long long* __restrict__ length, const unsigned char* __restrict__ ended,
    long long min_length, long long sentence_end, const long long* __restrict__ deadline, long long step,
    int num_scorers, const void* logp0, const void* logp1, const void* logp2, const void* logp3, int logp_half,
    int logp_row, const float* __restrict__ scorer_scores, long long num_lanes, FinishedLists fin,
    const long long* __restrict__ prompts, const unsigned char* __restrict__ hopeful,
    const unsigned char* __restrict__ done, int genai, int prompt_counts, Normaliser norm, int early_stopping,
    int never_norm, long long* __restrict__ parents, long long* __restrict__ labels, float* __restrict__ score_out,
    long long* __restrict__ length_out, unsigned char* __restrict__ ended_out, float* __restrict__ scorer_out,
    float* __restrict__ new_ranks, float* __restrict__ new_scores, float* __restrict__ new_scorer,
    long long* __restrict__ new_lengths, long long* __restrict__ new_steps, long long* __restrict__ new_lanes,
    long long* __restrict__ new_labels, unsigned char* __restrict__ new_hopeful, unsigned char* __restrict__ new_done,
    long long* __restrict__ picked, long long* __restrict__ cand_lanes, long long* __restrict__ cand_labels) {
    __shared__ unsigned int chosen[LABEL_MAX_BEAM];
    __shared__ float chosen_rank[LABEL_MAX_BEAM];

    const long long g = blockIdx.x, first = g * beam;
    utterance_top<KEPT>(lane_keys, vocab_size, beam, size, 0, 0.0f, chosen, chosen_rank);
    if (threadIdx.x != 0) return;

    const void* logps[4] = {logp0, logp1, logp2, logp3};
    auto logp = [&](int s, long long lane, long long v) {
        const long long at = ((logp_row >> s) & 1) ? v : lane * vocab_size + v;
        return load_score(logps[s], at, (logp_half >> s) & 1);
    };
    float cand_score[SEPARATE_MAX_SIZE], open_score[SEPARATE_MAX_SIZE];
    long long parent[SEPARATE_MAX_SIZE], label[SEPARATE_MAX_SIZE];
    bool ending[SEPARATE_MAX_SIZE];
    for (int k = 0; k < size; ++k) {  // the candidates as the array version computes them
        const unsigned int column = chosen[k];
        const long long n = first + column / (unsigned int)vocab_size, v = column % (unsigned int)vocab_size;
        const bool open = !ended[n], short_of_min = open && min_length > 0 && length[n] < min_length;
        const float x = !open                                  ? (v == 0 ? score[n] : neg_inf())
                        : short_of_min && v == sentence_end ? neg_inf()
                                                               : score[n] + terms.combined(n * vocab_size, (int)v);
        cand_score[k] = x;
        parent[k] = n;
        label[k] = v;
        const bool ends = v == sentence_end || (!genai && deadline[n] <= step);
        ending[k] = x > neg_inf() && open && ends;
        open_score[k] = ending[k] ? neg_inf() : x;
    }
    // the open lanes: the best B candidates that do not end
    int kept[LABEL_MAX_BEAM];
    best_columns(open_score, size, beam, kept);
    float raw[LABEL_MAX_BEAM];
    long long open_labels[LABEL_MAX_BEAM];
    bool alive[LABEL_MAX_BEAM];
    for (int j = 0; j < beam; ++j) {
        const long long n = first + j, p = parent[kept[j]];
        const float s = open_score[kept[j]];
        raw[j] = s;
        alive[j] = s > neg_inf();
        open_labels[j] = label[kept[j]];
        const long long lab = alive[j] && !ended[p] ? open_labels[j] : -1;
        parents[n] = p;
        labels[n] = lab;
        const bool emitted = lab >= 0;
        for (int i = 0; i < num_scorers; ++i)
            scorer_out[i * num_lanes + n] = scorer_scores[i * num_lanes + p] + (emitted ? logp(i, p, lab) : 0.0f);
        length_out[n] = length[p] + (emitted ? 1 : 0);
        score_out[n] = alive[j] ? s : neg_inf();
    }
    // the old entries, then the ending candidates among the best B, then (GenAI) the open lanes
    const int extra = genai ? 2 * beam : beam;
    float merged[SEPARATE_MAX_MERGED], m_scores[SEPARATE_MAX_MERGED];
    long long m_lengths[SEPARATE_MAX_MERGED], m_steps[SEPARATE_MAX_MERGED], m_lanes[SEPARATE_MAX_MERGED],
        m_labels[SEPARATE_MAX_MERGED];
    for (int c = 0; c < beam; ++c) {
        const long long e = first + c;
        merged[c] = fin.ranks[e];
        m_scores[c] = fin.scores[e];
        m_lengths[c] = fin.lengths[e];
        m_steps[c] = fin.steps[e];
        m_lanes[c] = fin.lanes[e];
        m_labels[c] = fin.labels[e];
    }
    const bool listed_here = hopeful[g] && !done[g];
    for (int k = 0; k < beam; ++k) {
        const int c = beam + k;
        const long long p = parent[k], lab = label[k], len = length[p] + 1;
        const long long counted = prompt_counts ? prompts[g] + len - (lab == sentence_end ? 1 : 0) : len;
        merged[c] = ending[k] && listed_here ? norm.rank(cand_score[k], counted) : neg_inf();
        m_scores[c] = cand_score[k];
        m_lengths[c] = len;
        m_steps[c] = step;
        m_lanes[c] = p;
        m_labels[c] = lab;
    }
    const bool at_limit = deadline[first] <= step;
    bool hope = hopeful[g], finish = done[g];
    int best[LABEL_MAX_BEAM];
    if (genai) {  // the stop test before the open lanes join at the limit
        best_columns(merged, 2 * beam, beam, best);
        bool full = true;
        float low = merged[best[0]];
        for (int j = 0; j < beam; ++j) {
            const float value = merged[best[j]];
            full = full && value > neg_inf();
            low = value < low ? value : low;
        }
        const long long len = length[parent[0]];
        const bool improvable = low < norm.rank(cand_score[0], prompt_counts ? prompts[g] + len : len);
        const bool stops = full && (early_stopping == 0 ? !improvable : true) && !done[g];
        finish = done[g] || stops || at_limit;
        const bool joins = at_limit && !done[g] && !stops;
        for (int j = 0; j < beam; ++j) {
            const long long n = first + j;
            const int c = 2 * beam + j;
            const long long counted = prompt_counts ? prompts[g] + length_out[n] : length_out[n];
            merged[c] = alive[j] && joins ? norm.rank(raw[j], counted) : neg_inf();
            m_scores[c] = raw[j];
            m_lengths[c] = length_out[n];
            m_steps[c] = step;
            m_lanes[c] = parents[n];
            m_labels[c] = open_labels[j];
        }
    }
    best_columns(merged, beam + extra, beam, best);
    const long long num_entries = num_lanes;  // G * B
    for (int j = 0; j < beam; ++j) {
        const long long e = first + j;
        const int c = best[j];
        picked[g * beam + j] = c;
        new_ranks[e] = merged[c];
        new_scores[e] = m_scores[c];
        new_lengths[e] = m_lengths[c];
        new_steps[e] = m_steps[c];
        new_lanes[e] = m_lanes[c];
        new_labels[e] = m_labels[c];
        for (int i = 0; i < num_scorers; ++i) {  // an entry's per-scorer scores, from where it came
            float value;
            if (c < beam) {
                value = fin.scorer[i * num_entries + first + c];
            } else if (c < 2 * beam) {
                const int k = c - beam;
                value = scorer_scores[i * num_lanes + parent[k]] + logp(i, parent[k], label[k] > 0 ? label[k] : 0);
            } else {
                value = scorer_out[i * num_lanes + first + (c - 2 * beam)];
            }
            new_scorer[i * num_entries + e] = value;
        }
    }
    for (int c = 0; c < extra; ++c) {
        cand_lanes[g * extra + c] = m_lanes[beam + c];
        cand_labels[g * extra + c] = m_labels[beam + c];
    }
    if (!genai) {  // the stop test after the step, on the best open lane
        bool full = true;
        float low = new_ranks[first];
        for (int j = 0; j < beam; ++j) {
            const float value = new_ranks[first + j];
            full = full && value > neg_inf();
            low = value < low ? value : low;
        }
        long long len = length_out[first];
        if (never_norm) len += deadline[first] - step;
        const float best_open = norm.rank(raw[0], prompt_counts ? prompts[g] + len : len);
        hope = hopeful[g] && (!full || best_open > low);
        finish = done[g] || !hope || at_limit;
        if (early_stopping == 1) finish = finish || full;
    }
    new_hopeful[g] = hope;
    new_done[g] = finish;
    for (int j = 0; j < beam; ++j) ended_out[first + j] = finish || !alive[j];
}

#define LABEL_SEPARATE(KEPT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(LABEL_THREADS) label_separate_##KEPT(                          \
        TERMS_PARAMS, int vocab_size, int beam, int size, const unsigned long long* lane_keys, const float* score, \
        const long long* length, const unsigned char* ended, long long min_length, long long sentence_end,       \
        const long long* deadline, long long step, int num_scorers, const void* logp0, const void* logp1, const void* logp2,                \
        const void* logp3, int logp_half, int logp_row, const float* scorer_scores, long long num_lanes,         \
        const float* fin_ranks, const float* fin_scores, const float* fin_scorer, const long long* fin_lengths,  \
        const long long* fin_steps, const long long* fin_lanes, const long long* fin_labels,                     \
        const long long* prompts, const unsigned char* hopeful, const unsigned char* done, int genai,            \
        int prompt_counts, float norm_scale, const float* norm_table, long long norm_size, int early_stopping,   \
        int never_norm, long long* parents,                                                                      \
        long long* labels, float* score_out, long long* length_out, unsigned char* ended_out, float* scorer_out, \
        float* new_ranks, float* new_scores, float* new_scorer, long long* new_lengths, long long* new_steps,    \
        long long* new_lanes, long long* new_labels, unsigned char* new_hopeful, unsigned char* new_done,        \
        long long* picked, long long* cand_lanes, long long* cand_labels) {                                      \
        separate_step<KEPT>(TERMS_OF_PARAMS, vocab_size, beam, size, lane_keys, score, length, ended, min_length, \
                            sentence_end, deadline, step, num_scorers, logp0, logp1, logp2, logp3, logp_half,    \
                            logp_row, scorer_scores, num_lanes,                                                  \
                            FinishedLists{fin_ranks, fin_scores, fin_scorer, fin_lengths, fin_steps, fin_lanes,  \
                                          fin_labels},                                                           \
                            prompts, hopeful, done, genai, prompt_counts,                                        \
                            Normaliser{norm_scale, norm_table, norm_size}, early_stopping, never_norm,           \
                            parents, labels, score_out, length_out, ended_out, scorer_out, new_ranks, new_scores, \
                            new_scorer, new_lengths, new_steps, new_lanes, new_labels, new_hopeful, new_done,    \
                            picked, cand_lanes, cand_labels);                                                    \
    }

LABEL_SEPARATE(8)
LABEL_SEPARATE(16)
LABEL_SEPARATE(32)
