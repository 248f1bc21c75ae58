// State copy kernels: merge (state-pool slots -> batched model inputs), split (model outputs
// -> newly allocated slots) and copy_steps (a resident greedy step's new token states: model outputs
// -> the step's own inputs, no pool) for ALL state variables of a model in ONE launch each.
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
// kept - 1 ones.  With left_aligned the kept token states come first instead, for models that read
// only each row's prefix_lengths[b] positions: the positions after them (and rows >= num_rows) are
// not written at all, so a step's merge copies the kept tokens and never the padding (the caller
// zeroes the buffers once, so they hold only finite values).  Otherwise rows >= num_rows of a
// larger output buffer are all zero.  prefix_lengths[b] =
// kept (0 for padding rows).  Slot ids < 0 or >= capacity read as zero states.
//
// Split semantics: new token p of row b is read at time index src_time - num_new + p and written to
// slot new_slots[b * num_new + p] (skipped where the slot is < 0).  With src_positions non-null
// ([num_rows] int32, e.g. the merge's prefix_lengths: a left-aligned Hugging Face model's present
// output holds each row's history first, its new step at the row's own length), token p of row b is
// read at src_positions[b] + p instead, the position clamped into [0, src_time - num_new] (so every
// read stays inside the row's time axis), in the same one launch.  With free_stack non-null the
// split also allocates those slots (the pool's uniform allocation, state_pool.cu: allocate_uniform
// + finish_allocation, fused): copy r = b * num_new + p takes free_stack[num_free - 1 - r], the
// warps of variable 0 write new_slots and the allocated flags, and the last thread block to finish
// (counted in counters[3], left at 0 again) updates counters[0..2].
//
// Thread mapping: the (variable, token) copies of a launch are numbered variable-major and split
// into one contiguous, equal range per warp (the grid is sized by the launcher to the resident
// warps of the device, so every warp gets the same work and no wave tail is left).  A warp takes
// its range in batches of up to 32 tokens: lane j resolves token j of the batch (slot, slab
// address, tensor index: the only integer divisions, once per token), then the warp copies the
// batch's tokens, GROUP of them at a time, in 16-byte vectors (the fast path: storage dtype == model
// dtype and 16-byte aligned tensor, spans and token).  Within a token the lanes walk the vectors f = lane,
// lane + 32, ... of its contiguous form; the matching tensor offset (span q = f / inner_vecs, its
// pre / mid indices) is advanced incrementally (a Walk, set up once per variable) — no division per
// vector — and UNROLL vectors of each of the GROUP tokens are loaded before any is stored, so a lane
// keeps UNROLL * GROUP independent loads in flight.  Data read once are loaded with the streaming
// cache hint.  Everything else (dtype conversions, narrower alignment, a token whose slab address is
// not 16-byte aligned) takes the generic per-vector path (copy_raw / copy_convert / zero_raw, widest
// aligned unit), in a second pass over the warp's range that runs only where such tokens exist.
// A merged variable whose spans are single 16-byte vectors (keys in FasterTransformer's layout) is
// copied lane per token instead (merge_lane_token), so that the stores to a span are contiguous.

#define MAX_STATE_VARIABLES 128
#define GEOMETRY_FIELDS 8

#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
// The CPU kernel emulator (tools/kernel-emulator: g++ with its emu/runtime.h), which the tests run
// these kernels through: CUDA's vector types, plain loads and stores instead of the PTX cache hints,
// float16 conversions by the compiler, and the tensor addresses through a pointer to the struct (it
// passes arrays and scalars only).  Nothing here is seen by NVRTC or nvcc.
#define STATE_COPY_EMULATED 1
#define STATE_COPY_LOAD_CS 0
#define STATE_COPY_STORE_CS 0
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct __align__(8) uint2 { unsigned int x, y; };
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}
#define STATE_POINTERS const StatePointers*
#define STATE_POINTER(pointers, var) ((pointers)->ptr[var])
#else
#define STATE_POINTERS StatePointers
#define STATE_POINTER(pointers, var) ((pointers).ptr[var])
#endif
#ifndef WARPS_PER_BLOCK
#define WARPS_PER_BLOCK 8        // gpudecode/states/cuda.py
#endif
#ifndef MIN_BLOCKS_PER_SM
#define MIN_BLOCKS_PER_SM 3      // __launch_bounds__ residency (<= 80 registers at 256 threads)
#endif
#ifndef STATE_COPY_UNROLL
#define STATE_COPY_UNROLL 4      // vectors per token loaded before the stores
#endif
#ifndef STATE_COPY_GROUP
#define STATE_COPY_GROUP 1       // tokens copied together (1 or 2)
#endif
#ifndef STATE_COPY_LOAD_CS
#define STATE_COPY_LOAD_CS 1     // ld.global.cs (evict-first) for the data read once
#endif
#ifndef STATE_COPY_STORE_CS
#define STATE_COPY_STORE_CS 0    // st.global.cs for the data written
#endif
#define TOKENS_PER_BATCH 32

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
#ifdef STATE_COPY_EMULATED
        _Float16 h;
        __builtin_memcpy(&h, &x.bits, 2);
        return (float)h;
#else
        float y;
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x.bits));
        return y;
#endif
    }
};
template <> struct Convert<float, f16> {
    static __device__ __forceinline__ f16 run(float x) {
        f16 y;
#ifdef STATE_COPY_EMULATED
        const _Float16 h = (_Float16)x;  // round to nearest even, as cvt.rn
        __builtin_memcpy(&y.bits, &h, 2);
#else
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y.bits) : "f"(x));
#endif
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

// ---- fast path: streaming vector loads / stores ---------------------------------------------------
template <typename P>
__device__ __forceinline__ P load_once(const P* p) {
#if STATE_COPY_LOAD_CS
    if constexpr (sizeof(P) == 16) {
        union { uint4 u; P p; } v;
        asm("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.u.x), "=r"(v.u.y), "=r"(v.u.z), "=r"(v.u.w) : "l"(p));
        return v.p;
    } else if constexpr (sizeof(P) == 8) {
        union { uint2 u; P p; } v;
        asm("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(v.u.x), "=r"(v.u.y) : "l"(p));
        return v.p;
    } else if constexpr (sizeof(P) == 4) {
        union { unsigned int u; P p; } v;
        asm("ld.global.cs.u32 %0, [%1];" : "=r"(v.u) : "l"(p));
        return v.p;
    }
#endif
    return *p;
}

template <typename P>
__device__ __forceinline__ void store_vec(P* p, const P& value) {
#if STATE_COPY_STORE_CS
    if constexpr (sizeof(P) == 16) {
        union { uint4 u; P p; } v;
        v.p = value;
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.u.x), "r"(v.u.y), "r"(v.u.z), "r"(v.u.w) : "memory");
        return;
    } else if constexpr (sizeof(P) == 8) {
        union { uint2 u; P p; } v;
        v.p = value;
        asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(v.u.x), "r"(v.u.y) : "memory");
        return;
    } else if constexpr (sizeof(P) == 4) {
        union { unsigned int u; P p; } v;
        v.p = value;
        asm volatile("st.global.cs.u32 [%0], %1;" :: "l"(p), "r"(v.u) : "memory");
        return;
    }
#endif
    *p = value;
}

// ---- fast path: the per-lane walk over one token's vectors ----------------------------------------
// Vectors (of the variable's vector size) of a token: f = q * V + iv, span q = a * mid + m.  Lane
// `lane` visits f = lane, lane + 32, ...; per step of 32 the span advances by dq = 32 / V
// (= da * mid + dm) and iv by r = 32 % V, with at most one carry into m and one into a, so the tensor
// offset (vectors) a * stride_a + m * stride_m + iv follows by additions only.
struct Walk {
    int total;            // vectors per token: num_spans * V
    int V;                // vectors per span
    int mid;
    int r;                // 32 % V
    int dm;               // (32 / V) % mid
    int iv0, m0;          // this lane's first vector
    int off0;             // its tensor offset (vectors; the plan checks that all offsets fit an int)
    int step;             // r + dm * stride_m + da * stride_a
    int carry_iv;         // stride_m - V
    int carry_m;          // stride_a - mid * stride_m
};

__device__ __forceinline__ Walk make_walk(int V, int mid, int num_spans, int stride_m, int stride_a, int lane) {
    Walk w;
    w.total = num_spans * V;
    w.V = V;
    w.mid = mid;
    const int dq = 32 / V;
    w.r = 32 - dq * V;
    const int da = dq / mid;
    w.dm = dq - da * mid;
    const int q0 = lane / V;
    w.iv0 = lane - q0 * V;
    const int a0 = q0 / mid;
    w.m0 = q0 - a0 * mid;
    w.off0 = a0 * stride_a + w.m0 * stride_m + w.iv0;
    w.step = w.r + w.dm * stride_m + da * stride_a;
    w.carry_iv = stride_m - V;
    w.carry_m = stride_a - mid * stride_m;
    return w;
}

__device__ __forceinline__ void walk_advance(const Walk& w, int& iv, int& m, int& off) {
    iv += w.r;
    m += w.dm;
    off += w.step;
    if (iv >= w.V) {
        iv -= w.V;
        m += 1;
        off += w.carry_iv;
    }
    if (m >= w.mid) {
        m -= w.mid;
        off += w.carry_m;
    }
}

// G tokens at once: tok[g] = the token's contiguous form, ten[g] = its span (0, 0) in the tensor.
template <bool TO_TENSOR, typename Tin, typename Tout, int K, int G>
__device__ __forceinline__ void copy_walk(const unsigned long long (&tok)[G], const unsigned long long (&ten)[G],
                                          const Walk& w, int lane) {
    using PIn = Pack<Tin, K>;
    using POut = Pack<Tout, K>;
    constexpr int U = STATE_COPY_UNROLL;
    int f = lane, iv = w.iv0, m = w.m0, off = w.off0;
#pragma unroll 1
    while (f < w.total) {
        int fo[U];
        int to[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            fo[u] = f;
            to[u] = off;
            f += 32;
            walk_advance(w, iv, m, off);
        }
        PIn in[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (fo[u] < w.total) {
                    const PIn* s = TO_TENSOR ? reinterpret_cast<const PIn*>(tok[g]) + fo[u]
                                             : reinterpret_cast<const PIn*>(ten[g]) + to[u];
                    in[u][g] = load_once(s);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (fo[u] < w.total) {
                    POut out;
#pragma unroll
                    for (int k = 0; k < K; ++k) out.v[k] = Convert<Tin, Tout>::run(in[u][g].v[k]);
                    POut* d = TO_TENSOR ? reinterpret_cast<POut*>(ten[g]) + to[u] : reinterpret_cast<POut*>(tok[g]) + fo[u];
                    store_vec(d, out);
                }
            }
        }
    }
}

// Zeros into one token's spans of a tensor (merge padding), in vectors of Z.
template <typename Z>
__device__ __forceinline__ void zero_walk(unsigned long long ten, const Walk& w, int lane) {
    Z* d = reinterpret_cast<Z*>(ten);
    int f = lane, iv = w.iv0, m = w.m0, off = w.off0;
    const Z zero{};
#pragma unroll 1
    for (; f < w.total; f += 32) {
        store_vec(d + off, zero);
        walk_advance(w, iv, m, off);
    }
}

// The fast path copies raw 16-byte vectors (storage dtype == model dtype, 16-byte aligned spans).
// Anything else (conversions, narrower alignment, tensors of more than 2^31 vectors) takes the
// generic per-vector path (copy_slow / zero_slow), whose semantics are the same.

template <bool TO_TENSOR, int G>
__device__ __forceinline__ void copy_fast(const unsigned long long (&tok)[G], const unsigned long long (&ten)[G],
                                          const Walk& w, int lane) {
    copy_walk<TO_TENSOR, uint4, uint4, 1, G>(tok, ten, w, lane);
}

// Per-variable plan of the fast path (uniform across the warp).
struct VarPlan {
    Walk w;
    bool fast;                // 16-byte raw vectors; else every token takes the generic path
    long long span_bytes;     // inner * model itemsize: tensor bytes per (row, time) index step
    long long token_bytes;
    const unsigned long long* slabs;
};

__device__ __forceinline__ VarPlan plan_variable(const long long* geo, unsigned long long tensor,
                                                 const unsigned long long* slabs, int rows, int time, int lane) {
    VarPlan p;
    const int pre = (int)geo[0];
    const int mid = (int)geo[1];
    const int model_size = (int)geo[7];
    p.span_bytes = geo[2] * model_size;
    p.token_bytes = geo[3] * geo[6];
    p.slabs = slabs;
    const int V = (int)(p.span_bytes / 16);
    const long long stride_m = (long long)time * V;
    const long long stride_a = (long long)rows * mid * stride_m;
    // same dtype, 16-byte aligned tensor and spans (token addresses are checked per token), and
    // every tensor offset in 16-byte vectors within an int
    p.fast = geo[4] == geo[5] && ((tensor | (unsigned long long)p.span_bytes) & 15ull) == 0 &&
             stride_a * pre <= 0x7fffffffll;
    p.w = make_walk(max(V, 1), mid, pre * mid, (int)stride_m, (int)stride_a, lane);
    return p;
}

// Generic per-vector path for a token whose slab address is less aligned than its variable's plan.
template <bool TO_TENSOR>
__device__ __forceinline__ void copy_slow(const long long* geo, unsigned long long tensor, unsigned long long token,
                                       long long tensor_base, int rows, int time, int lane) {
    const SpanGeometry g = span_geometry(geo, rows, time);
    const int storage_code = (int)geo[4];
    const int model_code = (int)geo[5];
    const int storage_size = (int)geo[6];
    const int model_size = (int)geo[7];
    const unsigned long long tensor_addresses = tensor | (unsigned long long)((long long)g.stride_m * model_size) |
                                                (unsigned long long)((long long)g.inner * model_size);
    const unsigned long long token_addresses = token | (unsigned long long)((long long)g.inner * storage_size);
    if (TO_TENSOR) {
        if (storage_code == model_code)
            copy_raw<true>(reinterpret_cast<const void*>(token), reinterpret_cast<void*>(tensor), model_size, tensor_base,
                           g, lane, token_addresses | tensor_addresses);
        else
            copy_convert<true>(reinterpret_cast<const void*>(token), reinterpret_cast<void*>(tensor), storage_code,
                               model_code, tensor_base, g, lane, token_addresses, tensor_addresses);
    } else {
        if (storage_code == model_code)
            copy_raw<false>(reinterpret_cast<const void*>(tensor), reinterpret_cast<void*>(token), model_size, tensor_base,
                            g, lane, token_addresses | tensor_addresses);
        else
            copy_convert<false>(reinterpret_cast<const void*>(tensor), reinterpret_cast<void*>(token), model_code,
                                storage_code, tensor_base, g, lane, tensor_addresses, token_addresses);
    }
}

__device__ __forceinline__ void zero_slow(const long long* geo, unsigned long long tensor, long long tensor_base, int rows,
                                       int time, int lane) {
    const SpanGeometry g = span_geometry(geo, rows, time);
    const int model_size = (int)geo[7];
    const unsigned long long tensor_addresses = tensor | (unsigned long long)((long long)g.stride_m * model_size) |
                                                (unsigned long long)((long long)g.inner * model_size);
    zero_raw(reinterpret_cast<void*>(tensor), model_size, tensor_base, g, lane, tensor_addresses);
}

#define KIND_NONE 0   // merge: zeros; split: skipped
#define KIND_FAST 1
#define KIND_SLOW 2
#define KIND_SKIP 3   // merge, left-aligned padding: left as it is

// Merge of a variable whose spans are one 16-byte vector (keys in FasterTransformer's layout
// [N, H·Dh/x, T, x], x = 16 bytes / itemsize). Copying token by token, as copy_walk does, would
// scatter a warp's stores T·16 bytes apart; here lane j copies its own token j of the batch instead,
// span by span, so that the lanes' stores to one span (consecutive time positions of a row) are
// contiguous, and each lane reads LANE_TOKEN_UNROLL consecutive vectors of its token at a time.
#ifndef LANE_TOKEN_UNROLL
#define LANE_TOKEN_UNROLL 4
#endif
__device__ __forceinline__ void merge_lane_token(const VarPlan& p, int kind, unsigned long long token,
                                                 unsigned long long ten) {
    if (kind != KIND_FAST && kind != KIND_NONE) return;  // a skipped or slow-path token
    const uint4* src = reinterpret_cast<const uint4*>(token);
    uint4* dst = reinterpret_cast<uint4*>(ten);
    const int total = p.w.total;              // spans (one vector each)
    const int stride_m = p.w.carry_iv + 1;    // vectors between consecutive mid indices
    int m = 0, off = 0;
#pragma unroll 1
    for (int q0 = 0; q0 < total; q0 += LANE_TOKEN_UNROLL) {
        uint4 v[LANE_TOKEN_UNROLL];
#pragma unroll
        for (int u = 0; u < LANE_TOKEN_UNROLL; ++u)
            v[u] = (kind == KIND_FAST && q0 + u < total) ? load_once(src + q0 + u) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < LANE_TOKEN_UNROLL; ++u) {
            if (q0 + u < total) {
                store_vec(dst + off, v[u]);
                off += stride_m;
                if (++m == p.w.mid) {
                    m = 0;
                    off += p.w.carry_m;
                }
            }
        }
    }
}

// The warp's tokens of one batch: lane j resolved token j (kind, token address, tensor index).  Two
// passes keep the generic path's registers out of the fast loop: SLOW = false copies the fast
// tokens (and zero-fills those of fast variables) and returns whether any token was left for the
// SLOW = true pass, which a warp runs over its range again only then (never for CuPy allocations).
template <bool TO_TENSOR, bool SLOW>
__device__ __forceinline__ bool copy_batch(const VarPlan& p, const long long* geo, unsigned long long tensor,
                                           int n, int kind, unsigned long long token, long long index,
                                           int rows, int time, int lane) {
    if (SLOW) {
        for (int j = 0; j < n; ++j) {
            const int kind_j = __shfl_sync(0xffffffffu, kind, j);
            const unsigned long long token_j = __shfl_sync(0xffffffffu, token, j);
            const long long index_j = __shfl_sync(0xffffffffu, index, j);
            if (kind_j == KIND_SLOW) copy_slow<TO_TENSOR>(geo, tensor, token_j, index_j * geo[2], rows, time, lane);
            else if (TO_TENSOR && kind_j == KIND_NONE && !p.fast) zero_slow(geo, tensor, index_j * geo[2], rows, time, lane);
        }
        return false;
    }
    const bool left = __any_sync(0xffffffffu, lane < n && (kind == KIND_SLOW || (TO_TENSOR && kind == KIND_NONE && !p.fast)));
    if (TO_TENSOR && p.fast && p.w.V == 1) {
        if (lane < n) merge_lane_token(p, kind, token, tensor + (unsigned long long)(index * p.span_bytes));
        return left;
    }
    for (int j = 0; j < n;) {
        const int kind_j = __shfl_sync(0xffffffffu, kind, j);
        const unsigned long long token_j = __shfl_sync(0xffffffffu, token, j);
        const long long index_j = __shfl_sync(0xffffffffu, index, j);
        const unsigned long long ten_j = tensor + (unsigned long long)(index_j * p.span_bytes);
#if STATE_COPY_GROUP >= 2
        const int kind_k = __shfl_sync(0xffffffffu, kind, (j + 1) & 31);
        if (kind_j == KIND_FAST && kind_k == KIND_FAST && j + 1 < n) {
            const unsigned long long token_k = __shfl_sync(0xffffffffu, token, j + 1);
            const long long index_k = __shfl_sync(0xffffffffu, index, j + 1);
            const unsigned long long tok2[2] = {token_j, token_k};
            const unsigned long long ten2[2] = {ten_j, tensor + (unsigned long long)(index_k * p.span_bytes)};
            copy_fast<TO_TENSOR, 2>(tok2, ten2, p.w, lane);
            j += 2;
            continue;
        }
#endif
        if (kind_j == KIND_FAST) {
            const unsigned long long tok1[1] = {token_j};
            const unsigned long long ten1[1] = {ten_j};
            copy_fast<TO_TENSOR, 1>(tok1, ten1, p.w, lane);
        } else if (TO_TENSOR && kind_j == KIND_NONE && p.fast) {
            zero_walk<uint4>(ten_j, p.w, lane);
        }
        j += 1;
    }
    return left;
}

template <bool B> struct PassTag { static constexpr bool slow = B; };

// This warp's contiguous share [begin, end) of total (variable, token) copies.
__device__ __forceinline__ void warp_range(long long total, long long& begin, long long& end) {
    const long long warps = (long long)gridDim.x * WARPS_PER_BLOCK;
    const long long warp = (long long)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    begin = total / warps * warp + min(warp, total % warps);
    end = begin + total / warps + (warp < total % warps ? 1 : 0);
}

// ---- merge ----------------------------------------------------------------------------------------
// grid: 1-D, sized to the resident blocks of the device; block: 32 * WARPS_PER_BLOCK threads.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK, MIN_BLOCKS_PER_SM)
merge_states(const long long* __restrict__ geometry,
             const unsigned long long* __restrict__ slab_table, int chunk_stride, int slots_per_chunk,
             int capacity, STATE_POINTERS outputs,
             const int* __restrict__ history, int history_width, const int* __restrict__ lengths,
             int num_rows, int out_rows, int out_time, int max_history, int keep_first, int left_aligned,
             int* __restrict__ prefix_lengths, int num_variables) {
    const int lane = threadIdx.x & 31;
    if (prefix_lengths != nullptr) {
        for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < out_rows; b += gridDim.x * blockDim.x) {
            int kept = 0;
            if (b < num_rows) {
                const int length = min(max(lengths[b], 0), history_width);
                kept = min(length, max_history);
            }
            prefix_lengths[b] = kept;
        }
    }
    const long long per_var = (long long)out_rows * out_time;
    long long begin, end;
    warp_range(per_var * num_variables, begin, end);
    auto pass = [&](auto tag) -> bool {
        long long s = begin;
        bool left = false;
        int planned = -1;
        VarPlan p;
        while (s < end) {
            const int var = (int)(s / per_var);
            const long long r0 = s - var * per_var;
            const int n = (int)min(min((long long)TOKENS_PER_BATCH, end - s), per_var - r0);
            const long long* geo = geometry + (long long)var * GEOMETRY_FIELDS;
            const unsigned long long tensor = STATE_POINTER(outputs, var);
            if (var != planned) {
                p = plan_variable(geo, tensor, slab_table + (long long)var * chunk_stride, out_rows, out_time, lane);
                planned = var;
            }
            int kind = KIND_NONE;
            unsigned long long token = 0;
            long long index = 0;
            if (lane < n) {
                const long long r = r0 + lane;
                const int b = (int)(r / out_time);
                const int t = (int)(r - (long long)b * out_time);
                index = (long long)b * p.w.mid * out_time + t;
                if (left_aligned) kind = KIND_SKIP;
                if (b < num_rows) {
                    const int length = min(max(lengths[b], 0), history_width);
                    const int kept = min(length, max_history);
                    const int pad = left_aligned ? 0 : out_time - kept;
                    if (t >= pad && t - pad < kept) {
                        kind = KIND_NONE;  // a slot outside the pool reads as a zero state
                        const int j = t - pad;
                        const int position = (keep_first && j == 0) ? 0 : length - kept + j;
                        const int slot = history[(long long)b * history_width + position];
                        if (slot >= 0 && slot < capacity) {
                            const int chunk = slot / slots_per_chunk;
                            const int row = slot - chunk * slots_per_chunk;
                            token = p.slabs[chunk] + (unsigned long long)((long long)row * p.token_bytes);
                            kind = (p.fast && (token & 15ull) == 0) ? KIND_FAST : KIND_SLOW;
                        }
                    }
                }
            }
            left |= copy_batch<true, decltype(tag)::slow>(p, geo, tensor, n, kind, token, index, out_rows, out_time, lane);
            s += n;
        }
        return left;
    };
    if (pass(PassTag<false>{})) pass(PassTag<true>{});
}

// ---- split ----------------------------------------------------------------------------------------
// grid: 1-D, sized to the resident blocks of the device; block: 32 * WARPS_PER_BLOCK threads.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK, MIN_BLOCKS_PER_SM)
split_states(const long long* __restrict__ geometry,
             const unsigned long long* __restrict__ slab_table, int chunk_stride, int slots_per_chunk,
             int capacity, STATE_POINTERS sources,
             int num_rows, int src_time, int num_new, const int* __restrict__ src_positions,
             int* __restrict__ new_slots,
             const int* __restrict__ free_stack, int* __restrict__ counters, unsigned char* __restrict__ allocated,
             int num_variables) {
    const int lane = threadIdx.x & 31;
    const long long per_var = (long long)num_rows * num_new;
    // read by every thread before any block can reach the counter update below
    const int num_free = free_stack != nullptr ? counters[0] : 0;
    long long begin, end;
    warp_range(per_var * num_variables, begin, end);
    auto pass = [&](auto tag) -> bool {
        long long s = begin;
        bool left = false;
        int planned = -1;
        VarPlan p;
        while (s < end) {
            const int var = (int)(s / per_var);
            const long long r0 = s - var * per_var;
            const int n = (int)min(min((long long)TOKENS_PER_BATCH, end - s), per_var - r0);
            const long long* geo = geometry + (long long)var * GEOMETRY_FIELDS;
            const unsigned long long tensor = STATE_POINTER(sources, var);
            if (var != planned) {
                p = plan_variable(geo, tensor, slab_table + (long long)var * chunk_stride, num_rows, src_time, lane);
                planned = var;
            }
            int kind = KIND_NONE;
            unsigned long long token = 0;
            long long index = 0;
            if (lane < n) {
                const long long r = r0 + lane;
                int slot;
                if (free_stack != nullptr) {
                    const long long position = num_free - 1 - r;
                    slot = position >= 0 ? free_stack[position] : -1;
                    if (var == 0) {
                        new_slots[r] = slot;
                        if (slot >= 0) allocated[slot] = 1; else counters[2] = 1;
                    }
                } else {
                    slot = new_slots[r];
                }
                if (slot >= 0 && slot < capacity) {
                    const int b = (int)(r / num_new);
                    const int p_new = (int)(r - (long long)b * num_new);
                    const int first = src_positions != nullptr
                                          ? min(max(src_positions[b], 0), src_time - num_new)
                                          : src_time - num_new;
                    const int t = first + p_new;
                    index = (long long)b * p.w.mid * src_time + t;
                    const int chunk = slot / slots_per_chunk;
                    const int row = slot - chunk * slots_per_chunk;
                    token = p.slabs[chunk] + (unsigned long long)((long long)row * p.token_bytes);
                    kind = (p.fast && (token & 15ull) == 0) ? KIND_FAST : KIND_SLOW;
                }
            }
            left |= copy_batch<false, decltype(tag)::slow>(p, geo, tensor, n, kind, token, index, num_rows, src_time, lane);
            s += n;
        }
        return left;
    };
    if (pass(PassTag<false>{})) pass(PassTag<true>{});
    if (free_stack == nullptr) return;
    __shared__ bool last_block;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(reinterpret_cast<unsigned int*>(&counters[3]), 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last_block && threadIdx.x == 0) {
        const int remaining = (int)max((long long)num_free - per_var, 0ll);
        counters[0] = remaining;
        counters[1] = max(counters[1], capacity - remaining);
        counters[3] = 0;
    }
}

// ---- resident steps -------------------------------------------------------------------------------
// A greedy search's states can stay in the captured step's own state inputs between steps
// (gpudecode/session/step_model.py: ResidentRows), with no pool at all: after each step the new token
// state of row b, at time positions[b] of the state output src[var] (a left-aligned Hugging Face
// present: [pre, rows, mid, src_time, inner], each row's history first, its new step at its length),
// is written at the same time of the state input dst[var] ([pre, rows, mid, dst_time, inner], same
// dtype), for rows b < num_rows; a position outside [0, min(src_time, dst_time)) is left alone (the
// caller moves whole histories into a larger time bucket itself).
// grid: 1-D; block: 32 * WARPS_PER_BLOCK threads.  One warp per (variable, row, span), its lanes over
// the span's 4-byte words (bytes where a span or an address is not a multiple of 4).
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK)
copy_steps(const long long* __restrict__ geometry, STATE_POINTERS sources, STATE_POINTERS targets,
           int num_rows, int rows, int src_time, int dst_time, const int* __restrict__ positions,
           int num_variables) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long num_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (int var = 0; var < num_variables; ++var) {
        const long long* geo = geometry + (long long)var * GEOMETRY_FIELDS;
        const long long mid = geo[1], inner = geo[2], itemsize = geo[7];
        const long long spans = geo[0] * mid;
        const long long span_bytes = inner * itemsize;
        const unsigned long long src = STATE_POINTER(sources, var), dst = STATE_POINTER(targets, var);
        const bool words = (span_bytes & 3) == 0 && ((src | dst) & 3ull) == 0;
        for (long long item = warp; item < (long long)num_rows * spans; item += num_warps) {
            const int b = (int)(item / spans);
            const long long q = item - (long long)b * spans;  // q = a * mid + m
            const int t = positions[b];
            if (t < 0 || t >= src_time || t >= dst_time) continue;
            const long long a = q / mid, m = q - a * mid;
            const long long row = (a * rows + b) * mid + m;
            const unsigned char* from = reinterpret_cast<const unsigned char*>(src) + (row * src_time + t) * span_bytes;
            unsigned char* to = reinterpret_cast<unsigned char*>(dst) + (row * dst_time + t) * span_bytes;
            if (words) {
                for (long long w = lane; w < span_bytes / 4; w += 32)
                    reinterpret_cast<unsigned int*>(to)[w] = reinterpret_cast<const unsigned int*>(from)[w];
            } else {
                for (long long x = lane; x < span_bytes; x += 32) to[x] = from[x];
            }
        }
    }
}
