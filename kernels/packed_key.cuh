// Packed (key, column) pairs for top-k selection, shared by top_k.cu and ctc_frame.cu (inlined
// into a family's source by gpudecode/kernels.py::kernel_source).
//
// Layout: uint64 = ordered float32 key bits << 32 | ~column. Unsigned order of the packed value is
// descending key, then ascending column (the stable sort's tie-break); NaN packs as -inf and -0.0
// as +0.0. 0 is below every packed value, so it marks "no candidate".

__device__ __forceinline__ unsigned long long pack_key(float key, unsigned int column) {
    if (isnan(key)) key = __int_as_float(0xff800000);  // -inf (NVRTC has no INFINITY)
    key += 0.0f;  // -0.0 -> +0.0
    const unsigned int bits = __float_as_uint(key);
    const unsigned int ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned long long)(~column);
}

// The key of a packed pair (NaN came back as -inf, -0.0 as +0.0).
__device__ __forceinline__ float unpack_key_value(unsigned long long packed) {
    const unsigned int ordered = (unsigned int)(packed >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

// A thread's best KEPT packed pairs, best first (0: empty; no two entries equal but 0s), kept in
// registers: `key` takes its place if it beats the last entry, which drops out.
template <int KEPT>
__device__ __forceinline__ void keep_best(unsigned long long (&kept)[KEPT], unsigned long long key) {
    if (key <= kept[KEPT - 1]) return;
    kept[KEPT - 1] = key;
#pragma unroll
    for (int r = KEPT - 1; r > 0; --r) {  // one bubble pass moves it up to its place
        if (kept[r] > kept[r - 1]) {
            const unsigned long long swap = kept[r];
            kept[r] = kept[r - 1];
            kept[r - 1] = swap;
        }
    }
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = other > value ? other : value;
    }
    return value;
}
