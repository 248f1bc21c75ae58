// State copy kernels: merge (state-pool slots -> batched model inputs) and split (model outputs
// -> newly allocated slots) for ALL state variables of a model in ONE launch each.
//
// Memory layout
// -------------
// State pool (see gpudecode/states/pool.py): per state variable one slab per chunk, each slab a
// contiguous array [slots_per_chunk, token_size] of the storage dtype.  Slot s lives in chunk
// s / slots_per_chunk, row s % slots_per_chunk, of every variable's slab.  The slab addresses are
// a device table slab_table[var * chunk_stride + chunk] (uint64), re-uploaded only when the pool
// grows.
//
// A token state of variable v is the variable's declared shape without the batch and time axes,
// flattened as [pre, mid, inner]:
//     declared shape  [pre dims..., BATCH, mid dims..., TIME, inner dims...]
//     pre   = product of the dims before the batch axis   (e.g. layers of an LSTM [L, N, H])
//     mid   = product of the dims between batch and time  (e.g. heads of [N, H, T, D])
//     inner = product of the dims after the time axis     (e.g. D of [N, H, T, D], H*D of [N, T, H*D])
// A "span" is one run of `inner` contiguous elements: span q = a * mid + m of the token state lives
// at token offset q * inner, and in a batched tensor [pre, rows, mid, time, inner] (the model's
// layout) at ((a * rows + b) * mid + m) * time + t) * inner.  LSTM states have no time axis:
// they are handled as time = 1, mid = 1.
//
// Per-variable geometry is a static device table of 8 int64 per variable (uploaded once):
//     [pre, mid, inner, token_size, storage_code, model_code, storage_itemsize, model_itemsize]
// Per-launch tensor addresses (merge outputs, split sources) are passed BY VALUE in a
// StatePointers struct, so a launch needs no host-to-device upload.
//
// Merge semantics (RASR): histories are [num_rows, history_width] int32 slot tables with lengths;
// kept = min(length, max_history); the kept token states are right-aligned in time (zero padding
// on the left), and with keep_first the first token state sits in position 0 followed by the last
// kept - 1 ones.  Rows >= num_rows of a larger output buffer are all zero.  prefix_lengths[b] =
// kept (0 for padding rows).  Slot ids < 0 or >= capacity read as zero states.
//
// Split semantics: new token p of row b is read at time index src_time - num_new + p and written to
// slot new_slots[b * num_new + p] (skipped where the slot is < 0).
//
// Thread mapping: one warp copies one token state (one (variable, row, time) triple); blockIdx.y
// selects the state variable; blocks grid-stride over rows x time.  Lanes walk the token's spans in
// vectors of up to 16 bytes (chosen at run time from the alignment of every address involved).

#define MAX_STATE_VARIABLES 128
#define GEOMETRY_FIELDS 8
#define WARPS_PER_BLOCK 8

// dtype codes shared with gpudecode/states/cuda.py; equal codes copy raw bytes.
#define DTYPE_OTHER 0
#define DTYPE_FLOAT32 1
#define DTYPE_FLOAT16 2
#define DTYPE_BFLOAT16 3

struct StatePointers {
    unsigned long long ptr[MAX_STATE_VARIABLES];
};

struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

template <typename T, int K>
struct __align__(sizeof(T) * K) Pack { T v[K]; };

// ---- element conversions (bit-exact with numpy's astype: round to nearest even) -------------------
template <typename Tin, typename Tout> struct Convert;
template <typename T> struct Convert<T, T> {
    static __device__ __forceinline__ T run(T x) { return x; }
};
template <> struct Convert<f16, float> {
    static __device__ __forceinline__ float run(f16 x) {
        float y;
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x.bits));
        return y;
    }
};
template <> struct Convert<float, f16> {
    static __device__ __forceinline__ f16 run(float x) {
        f16 y;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y.bits) : "f"(x));
        return y;
    }
};
template <> struct Convert<bf16, float> {
    static __device__ __forceinline__ float run(bf16 x) {
        return __uint_as_float(((unsigned int)x.bits) << 16);
    }
};
template <> struct Convert<float, bf16> {
    static __device__ __forceinline__ bf16 run(float x) {
        unsigned int u = __float_as_uint(x);
        bf16 y;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            y.bits = (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            y.bits = (unsigned short)(u >> 16);
        }
        return y;
    }
};

struct SpanGeometry {
    int num_spans;        // pre * mid
    int mid;
    int inner;            // elements (or vector units) per span
    long long stride_a;   // tensor elements between consecutive pre indices: rows * mid * time * inner
    long long stride_m;   // tensor elements between consecutive mid indices: time * inner
};

// One warp: copy one token state between its contiguous form (`token`) and its spans in a batched
// tensor (`tensor` + tensor_base, the element offset of span (0, 0) at this row and time).
// TO_TENSOR: token -> tensor (merge), else tensor -> token (split).  K elements per vector.
template <bool TO_TENSOR, typename Tin, typename Tout, int K>
__device__ __forceinline__ void copy_token(const Tin* __restrict__ src, Tout* __restrict__ dst,
                                           long long tensor_base, const SpanGeometry& g, int lane) {
    const int inner_vecs = g.inner / K;
    const int total = g.num_spans * inner_vecs;
#pragma unroll 2
    for (int f = lane; f < total; f += 32) {
        const int q = f / inner_vecs;
        const int iv = f - q * inner_vecs;
        const int a = q / g.mid;
        const int m = q - a * g.mid;
        const long long tensor_off = tensor_base + a * g.stride_a + m * g.stride_m + (long long)iv * K;
        const long long token_off = (long long)q * g.inner + (long long)iv * K;
        const long long src_off = TO_TENSOR ? token_off : tensor_off;
        const long long dst_off = TO_TENSOR ? tensor_off : token_off;
        const Pack<Tin, K> in = *reinterpret_cast<const Pack<Tin, K>*>(src + src_off);
        Pack<Tout, K> out;
#pragma unroll
        for (int k = 0; k < K; ++k) out.v[k] = Convert<Tin, Tout>::run(in.v[k]);
        *reinterpret_cast<Pack<Tout, K>*>(dst + dst_off) = out;
    }
}

// One warp: write zeros into one token state's spans of a batched tensor (merge padding).
template <typename U>
__device__ __forceinline__ void zero_token(U* __restrict__ dst, long long tensor_base,
                                           const SpanGeometry& g, int lane) {
    const int total = g.num_spans * g.inner;
    const U zero{};
#pragma unroll 2
    for (int f = lane; f < total; f += 32) {
        const int q = f / g.inner;
        const int i = f - q * g.inner;
        const int a = q / g.mid;
        const int m = q - a * g.mid;
        dst[tensor_base + a * g.stride_a + m * g.stride_m + i] = zero;
    }
}

// Widest unit (16, 8, 4, 2 or 1 bytes) dividing every address and offset OR-ed into `bits`.
__device__ __forceinline__ int unit_bytes(unsigned long long bits) {
    if ((bits & 15ull) == 0) return 16;
    if ((bits & 7ull) == 0) return 8;
    if ((bits & 3ull) == 0) return 4;
    if ((bits & 1ull) == 0) return 2;
    return 1;
}

// The same geometry counted in units of `unit` bytes instead of elements of `itemsize` bytes.
__device__ __forceinline__ SpanGeometry in_units(const SpanGeometry& g, int itemsize, int unit) {
    SpanGeometry u = g;
    u.inner = (int)((long long)g.inner * itemsize / unit);
    u.stride_a = g.stride_a * itemsize / unit;
    u.stride_m = g.stride_m * itemsize / unit;
    return u;
}

// Raw copy (storage dtype == model dtype): dtype-agnostic, in the widest aligned unit.
template <bool TO_TENSOR>
__device__ __forceinline__ void copy_raw(const void* src, void* dst, int itemsize, long long tensor_base,
                                         const SpanGeometry& g, int lane, unsigned long long bits) {
    const int unit = unit_bytes(bits);
    const SpanGeometry u = in_units(g, itemsize, unit);
    const long long base = tensor_base * itemsize / unit;
    switch (unit) {
        case 16: copy_token<TO_TENSOR, uint4, uint4, 1>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), base, u, lane); break;
        case 8: copy_token<TO_TENSOR, uint2, uint2, 1>(static_cast<const uint2*>(src), static_cast<uint2*>(dst), base, u, lane); break;
        case 4: copy_token<TO_TENSOR, unsigned int, unsigned int, 1>(static_cast<const unsigned int*>(src), static_cast<unsigned int*>(dst), base, u, lane); break;
        case 2: copy_token<TO_TENSOR, unsigned short, unsigned short, 1>(static_cast<const unsigned short*>(src), static_cast<unsigned short*>(dst), base, u, lane); break;
        default: copy_token<TO_TENSOR, unsigned char, unsigned char, 1>(static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), base, u, lane); break;
    }
}

// Zero padding of one token state in a batched tensor, in the widest aligned unit.
__device__ __forceinline__ void zero_raw(void* dst, int itemsize, long long tensor_base, const SpanGeometry& g,
                                         int lane, unsigned long long bits) {
    const int unit = unit_bytes(bits);
    const SpanGeometry u = in_units(g, itemsize, unit);
    const long long base = tensor_base * itemsize / unit;
    switch (unit) {
        case 16: zero_token<uint4>(static_cast<uint4*>(dst), base, u, lane); break;
        case 8: zero_token<uint2>(static_cast<uint2*>(dst), base, u, lane); break;
        case 4: zero_token<unsigned int>(static_cast<unsigned int*>(dst), base, u, lane); break;
        case 2: zero_token<unsigned short>(static_cast<unsigned short*>(dst), base, u, lane); break;
        default: zero_token<unsigned char>(static_cast<unsigned char*>(dst), base, u, lane); break;
    }
}

// Converting copy Tin -> Tout, vectorised by 4 elements where alignment allows.
template <bool TO_TENSOR, typename Tin, typename Tout>
__device__ __forceinline__ void copy_convert_typed(const void* src, void* dst, long long tensor_base,
                                                   const SpanGeometry& g, int lane,
                                                   unsigned long long src_addresses, unsigned long long dst_addresses) {
    const bool vec4 = (g.inner % 4) == 0 && (src_addresses % (4 * sizeof(Tin))) == 0 &&
                      (dst_addresses % (4 * sizeof(Tout))) == 0;
    const Tin* s = static_cast<const Tin*>(src);
    Tout* d = static_cast<Tout*>(dst);
    if (vec4) copy_token<TO_TENSOR, Tin, Tout, 4>(s, d, tensor_base, g, lane);
    else copy_token<TO_TENSOR, Tin, Tout, 1>(s, d, tensor_base, g, lane);
}

template <bool TO_TENSOR>
__device__ __forceinline__ void copy_convert(const void* src, void* dst, int src_code, int dst_code,
                                             long long tensor_base, const SpanGeometry& g, int lane,
                                             unsigned long long src_addresses, unsigned long long dst_addresses) {
    if (src_code == DTYPE_FLOAT16 && dst_code == DTYPE_FLOAT32)
        copy_convert_typed<TO_TENSOR, f16, float>(src, dst, tensor_base, g, lane, src_addresses, dst_addresses);
    else if (src_code == DTYPE_FLOAT32 && dst_code == DTYPE_FLOAT16)
        copy_convert_typed<TO_TENSOR, float, f16>(src, dst, tensor_base, g, lane, src_addresses, dst_addresses);
    else if (src_code == DTYPE_BFLOAT16 && dst_code == DTYPE_FLOAT32)
        copy_convert_typed<TO_TENSOR, bf16, float>(src, dst, tensor_base, g, lane, src_addresses, dst_addresses);
    else if (src_code == DTYPE_FLOAT32 && dst_code == DTYPE_BFLOAT16)
        copy_convert_typed<TO_TENSOR, float, bf16>(src, dst, tensor_base, g, lane, src_addresses, dst_addresses);
    // other pairs are rejected on the host (gpudecode/states/cuda.py)
}

__device__ __forceinline__ SpanGeometry span_geometry(const long long* geo, int rows, int time) {
    SpanGeometry g;
    const long long pre = geo[0];
    g.mid = (int)geo[1];
    g.inner = (int)geo[2];
    g.num_spans = (int)(pre * geo[1]);
    g.stride_m = (long long)time * g.inner;
    g.stride_a = (long long)rows * g.mid * g.stride_m;
    return g;
}

// ---- merge ----------------------------------------------------------------------------------------
// grid: (x: row tiles, y: state variables), block: 32 * WARPS_PER_BLOCK threads.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK, 4)
merge_states(const long long* __restrict__ geometry,
             const unsigned long long* __restrict__ slab_table, int chunk_stride, int slots_per_chunk,
             int capacity, StatePointers outputs,
             const int* __restrict__ history, int history_width, const int* __restrict__ lengths,
             int num_rows, int out_rows, int out_time, int max_history, int keep_first,
             int* __restrict__ prefix_lengths) {
    const int var = blockIdx.y;
    const int lane = threadIdx.x & 31;
    // prefix lengths: written once per row by the threads of variable 0.
    if (var == 0 && prefix_lengths != nullptr) {
        for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < out_rows; b += gridDim.x * blockDim.x) {
            int kept = 0;
            if (b < num_rows) {
                const int length = min(max(lengths[b], 0), history_width);
                kept = min(length, max_history);
            }
            prefix_lengths[b] = kept;
        }
    }
    const long long* geo = geometry + (long long)var * GEOMETRY_FIELDS;
    const SpanGeometry g = span_geometry(geo, out_rows, out_time);
    const int storage_code = (int)geo[4];
    const int model_code = (int)geo[5];
    const int storage_size = (int)geo[6];
    const int model_size = (int)geo[7];
    const long long token_bytes = geo[3] * storage_size;
    void* out = reinterpret_cast<void*>(outputs.ptr[var]);
    const unsigned long long* slabs = slab_table + (long long)var * chunk_stride;
    const unsigned long long out_addresses = outputs.ptr[var] | (unsigned long long)((long long)g.stride_m * model_size) |
                                             (unsigned long long)((long long)g.inner * model_size);

    const long long total_rows = (long long)out_rows * out_time;
    const long long warp_global = (long long)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const long long warp_stride = (long long)gridDim.x * WARPS_PER_BLOCK;
    for (long long r = warp_global; r < total_rows; r += warp_stride) {
        const int b = (int)(r / out_time);
        const int t = (int)(r - (long long)b * out_time);
        int slot = -1;
        if (b < num_rows) {
            const int length = min(max(lengths[b], 0), history_width);
            const int kept = min(length, max_history);
            const int pad = out_time - kept;
            if (t >= pad) {
                const int j = t - pad;
                const int position = (keep_first && j == 0) ? 0 : length - kept + j;
                slot = history[(long long)b * history_width + position];
                if (slot >= capacity) slot = -1;
            }
        }
        const long long tensor_base = (((long long)b * g.mid) * out_time + t) * g.inner;
        if (slot < 0) {
            zero_raw(out, model_size, tensor_base, g, lane, out_addresses);
            continue;
        }
        const int chunk = slot / slots_per_chunk;
        const int row = slot - chunk * slots_per_chunk;
        const char* token = reinterpret_cast<const char*>(slabs[chunk]) + (long long)row * token_bytes;
        const unsigned long long token_addresses = reinterpret_cast<unsigned long long>(token) |
                                                   (unsigned long long)((long long)g.inner * storage_size);
        if (storage_code == model_code) {
            copy_raw<true>(token, out, model_size, tensor_base, g, lane, token_addresses | out_addresses);
        } else {
            copy_convert<true>(token, out, storage_code, model_code, tensor_base, g, lane, token_addresses, out_addresses);
        }
    }
}

// ---- split ----------------------------------------------------------------------------------------
// grid: (x: row tiles, y: state variables), block: 32 * WARPS_PER_BLOCK threads.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK, 4)
split_states(const long long* __restrict__ geometry,
             const unsigned long long* __restrict__ slab_table, int chunk_stride, int slots_per_chunk,
             int capacity, StatePointers sources,
             int num_rows, int src_time, int num_new, const int* __restrict__ new_slots) {
    const int var = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const long long* geo = geometry + (long long)var * GEOMETRY_FIELDS;
    const SpanGeometry g = span_geometry(geo, num_rows, src_time);
    const int storage_code = (int)geo[4];
    const int model_code = (int)geo[5];
    const int storage_size = (int)geo[6];
    const int model_size = (int)geo[7];
    const long long token_bytes = geo[3] * storage_size;
    const void* src = reinterpret_cast<const void*>(sources.ptr[var]);
    const unsigned long long* slabs = slab_table + (long long)var * chunk_stride;
    const unsigned long long src_addresses = sources.ptr[var] | (unsigned long long)((long long)g.stride_m * model_size) |
                                             (unsigned long long)((long long)g.inner * model_size);

    const long long total = (long long)num_rows * num_new;
    const long long warp_global = (long long)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const long long warp_stride = (long long)gridDim.x * WARPS_PER_BLOCK;
    for (long long r = warp_global; r < total; r += warp_stride) {
        const int slot = new_slots[r];
        if (slot < 0 || slot >= capacity) continue;
        const int b = (int)(r / num_new);
        const int p = (int)(r - (long long)b * num_new);
        const int t = src_time - num_new + p;
        const long long tensor_base = (((long long)b * g.mid) * src_time + t) * g.inner;
        const int chunk = slot / slots_per_chunk;
        const int row = slot - chunk * slots_per_chunk;
        char* token = reinterpret_cast<char*>(slabs[chunk]) + (long long)row * token_bytes;
        const unsigned long long token_addresses = reinterpret_cast<unsigned long long>(token) |
                                                   (unsigned long long)((long long)g.inner * storage_size);
        if (storage_code == model_code) {
            copy_raw<false>(src, token, model_size, tensor_base, g, lane, token_addresses | src_addresses);
        } else {
            copy_convert<false>(src, token, model_code, storage_code, tensor_base, g, lane, src_addresses, token_addresses);
        }
    }
}
