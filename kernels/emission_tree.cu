// The label sequences of chosen lanes of a time-synchronous search (CTC prefix, transducer), read
// from its emission tree (gpudecode/search/emission_tree.py): one thread per traced lane walks
// the lane's path back to the root and writes it oldest first.
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
//   lengths     [L] int32 (out): labels per row

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
