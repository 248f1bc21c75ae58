// Helpers of the search kernels (ctc_frame.cu, transducer_step.cu), inlined into a family's
// source by gpudecode/kernels.py::kernel_source.

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// An IEEE float16 (its bits) as float32, exactly: the GPU's own conversion, or (the kernel emulator,
// compiled as plain C++) the same in integer arithmetic.
__device__ __forceinline__ float half_bits_to_float(unsigned short bits) {
#if defined(__CUDA_ARCH__)
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
#else
    unsigned int sign = (unsigned int)(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    unsigned int out = sign;
    if (exponent == 0x1fu) {
        out |= 0x7f800000u | (mantissa << 13);  // inf, nan
    } else if (exponent != 0) {
        out |= ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa != 0) {  // subnormal: normalise
        unsigned int shift = 0;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            ++shift;
        }
        out |= ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    return __int_as_float((int)out);
#endif
}

// Element `at` of a float32 ([is_half] 0) or float16 (1) array, as float32.
__device__ __forceinline__ float load_score(const void* values, long long at, int is_half) {
    return is_half ? half_bits_to_float(__ldg((const unsigned short*)values + at)) : __ldg((const float*)values + at);
}

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
