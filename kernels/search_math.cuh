// Helpers of the search kernels (ctc_frame.cu, transducer_step.cu), inlined into a family's
// source by gpudecode/kernels.py::kernel_source.

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// numpy's npy_logaddexpf
__device__ __forceinline__ float log_add_exp(float x, float y) {
    if (x == y) return x + 0.693147180559945309417f;
    const float d = x - y;
    if (d > 0) return x + log1pf(expf(-d));
    if (d <= 0) return y + log1pf(expf(d));
    return d;  // NaN
}

__device__ __forceinline__ float warp_max_f(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

// Whether emission nodes a and b spell the same label sequence (same_label_paths for one pair);
// *undecided: still open after compare_steps (< 0: walk to the end).
__device__ __forceinline__ bool paths_equal(long long a, long long b, const long long* __restrict__ node_label,
                                            const long long* __restrict__ node_parent, int compare_steps,
                                            bool* undecided) {
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
    *undecided = pending;
    return equal;
}
