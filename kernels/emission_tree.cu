// The label sequences of chosen lanes of a time-synchronous search (CTC prefix, transducer), read
// from its emission tree (gpudecode/search/emission_tree.py), written oldest first.
//
// Memory layout
// -------------
//   lanes       [L] int64: the lanes to trace (indices into node)
//   node        [N] int64: each lane's newest emission node (0: the empty sequence)
//   node_parent, node_label [1 + K * N] int64: the tree; node 1 + k * N + lane was made at the
//               k-th tree step, node 0 is the root. A parent is always of an earlier step, so a
//               path holds at most K labels
//   node_frames [K] int64: the input frame of each tree step
//   labels, frames [L, K] int32 (out): row l holds lane lanes[l]'s labels and their frames, oldest
//               first, then -1
//   lengths     [L] int32 (out): labels per row; -1 (trace_emission_groups) when the row's lane or
//               a node on its path is outside the row's group, or a parent is not older
//
// trace_emission_groups: one block per group of G consecutive lanes (an utterance's beam) whose
// nodes' parents stay in the group; rows [g * R, (g + 1) * R) trace lanes of group g. The group's
// nodes are staged in shared memory chunk by chunk, newest steps first, as group-local indices
// k * G + (lane - g * G), so each path is walked in shared memory, not one global load per label.
// trace_emission_paths: one thread per row walks the tree in global memory (any lanes).

#define TRACE_THREADS 128
#define TRACE_CHUNK 2048  // nodes staged at once: TRACE_CHUNK / G tree steps

extern "C" __global__ void trace_emission_paths(const long long* __restrict__ lanes, int num_traced,
                                                const long long* __restrict__ node,
                                                const long long* __restrict__ node_parent,
                                                const long long* __restrict__ node_label,
                                                const long long* __restrict__ node_frames, long long num_lanes,
                                                int max_length, int* __restrict__ labels, int* __restrict__ frames,
                                                int* __restrict__ lengths) {
    const int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= num_traced) return;
    int* label_row = labels + (long long)l * max_length;
    int* frame_row = frames + (long long)l * max_length;
    long long n = node[lanes[l]];
    int depth = 0;
    for (; n != 0 && depth < max_length; ++depth) {  // newest first
        label_row[depth] = (int)node_label[n];
        frame_row[depth] = (int)node_frames[(n - 1) / num_lanes];
        n = node_parent[n];
    }
    for (int i = 0, j = depth - 1; i < j; ++i, --j) {  // oldest first
        const int label = label_row[i], frame = frame_row[i];
        label_row[i] = label_row[j];
        frame_row[i] = frame_row[j];
        label_row[j] = label;
        frame_row[j] = frame;
    }
    for (int i = depth; i < max_length; ++i) label_row[i] = frame_row[i] = -1;
    lengths[l] = depth;
}

// A node's group-local index: -1 for the root, -2 outside the group [first_lane, first_lane + G) or
// not older than `before` (a local index of the step being staged).
__device__ __forceinline__ int group_local(long long n, long long num_lanes, long long first_lane, int group_size,
                                           long long before) {
    if (n == 0) return -1;
    const long long k = (n - 1) / num_lanes, lane = n - 1 - k * num_lanes - first_lane;
    const long long local = k * group_size + lane;
    return lane >= 0 && lane < group_size && local < before ? (int)local : -2;
}

extern "C" __global__ void __launch_bounds__(TRACE_THREADS) trace_emission_groups(
    const long long* __restrict__ lanes, int rows_per_group, int group_size, const long long* __restrict__ node,
    const long long* __restrict__ node_parent, const long long* __restrict__ node_label,
    const long long* __restrict__ node_frames, long long num_lanes, int max_length, int* __restrict__ labels,
    int* __restrict__ frames, int* __restrict__ lengths) {
    __shared__ int s_parent[TRACE_CHUNK], s_label[TRACE_CHUNK], s_frame[TRACE_CHUNK];
    __shared__ int s_length[TRACE_THREADS];
    const int g = blockIdx.x, t = threadIdx.x;
    const long long first_lane = (long long)g * group_size, first_row = (long long)g * rows_per_group;
    const bool tracer = t < rows_per_group;
    int* label_row = labels + (first_row + t) * max_length;
    int* frame_row = frames + (first_row + t) * max_length;
    int current = -1, depth = 0;  // newest first
    if (tracer) {
        const long long lane = lanes[first_row + t];
        current = lane >= first_lane && lane < first_lane + group_size
                      ? group_local(node[lane], num_lanes, first_lane, group_size, (long long)max_length * group_size)
                      : -2;
    }
    const int steps_per_chunk = TRACE_CHUNK / group_size;
    if (steps_per_chunk == 0) {  // the caller checks G <= TRACE_CHUNK
        if (tracer) lengths[first_row + t] = -1;
        return;
    }
    for (int end = max_length; end > 0; end -= steps_per_chunk) {
        const int begin = end > steps_per_chunk ? end - steps_per_chunk : 0;
        const int base = begin * group_size, count = (end - begin) * group_size;
        __syncthreads();  // the previous chunk is walked
        for (int i = t; i < count; i += TRACE_THREADS) {
            const int step = begin + i / group_size;
            const long long n = 1 + (long long)step * num_lanes + first_lane + i % group_size;
            s_parent[i] = group_local(node_parent[n], num_lanes, first_lane, group_size, (long long)step * group_size);
            s_label[i] = (int)node_label[n];
        }
        for (int j = t; j < end - begin; j += TRACE_THREADS) s_frame[j] = (int)node_frames[begin + j];
        __syncthreads();
        if (tracer) {
            while (current >= base) {
                const int i = current - base;
                label_row[depth] = s_label[i];
                frame_row[depth] = s_frame[i / group_size];
                ++depth;
                current = s_parent[i];
            }
        }
    }
    if (tracer) {
        s_length[t] = current == -1 ? depth : -1;
        lengths[first_row + t] = s_length[t];
    }
    __syncthreads();
    for (int r = 0; r < rows_per_group; ++r) {  // oldest first, then -1; row r's positions over the block
        const int length = s_length[r];
        int* label_r = labels + (first_row + r) * max_length;
        int* frame_r = frames + (first_row + r) * max_length;
        for (int i = t; i < max_length; i += TRACE_THREADS) {
            if (i < length / 2) {
                const int j = length - 1 - i, label = label_r[i], frame = frame_r[i];
                label_r[i] = label_r[j];
                frame_r[i] = frame_r[j];
                label_r[j] = label;
                frame_r[j] = frame;
            } else if (i >= (length > 0 ? length : 0)) {
                label_r[i] = frame_r[i] = -1;
            }
        }
    }
}
