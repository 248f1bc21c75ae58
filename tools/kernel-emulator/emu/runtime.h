// CPU emulation runtime for CUDA kernels (compiled with g++ together with a kernel family's source).
//
// Every CUDA thread of a block is a fiber (own stack, hand-written x86-64 context switch); blocks
// run one after another. Fibers switch only at synchronisation points (__syncthreads*, warp
// collectives: __shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp), which really block
// until every participant has arrived. Between two synchronisation points a thread runs alone, in
// a schedule order chosen per launch (forward or reverse thread order), so a launch can be run
// under two orders and compared: a missing barrier between a write and a read of different threads
// shows as different results. Static __shared__ memory lives in the "emu_shared" section and the
// dynamic shared buffer is filled with a poison byte at every block start (different per run), so
// reads of unwritten shared memory also show as differences.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <csignal>
#include <unistd.h>
#include <sys/mman.h>

struct emu_dim3 {
    unsigned x = 1, y = 1, z = 1;
};
emu_dim3 threadIdx, blockIdx, gridDim, blockDim;
typedef emu_dim3 dim3;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("emu_shared")))
#define __constant__ static
#define warpSize 32

using std::isfinite;
using std::isinf;
using std::isnan;

// ---- fibers --------------------------------------------------------------------------------------
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch,.-emu_switch
)");

static const int EMU_MAX_THREADS = 1024;
static const size_t EMU_STACK = 256 * 1024;
struct EmuWait {
    const long* gen;  // the generation counter waited on (null: runnable)
    long value;
};
void* emu_sched_sp;
void* emu_fiber_sp[EMU_MAX_THREADS];
bool emu_done[EMU_MAX_THREADS];
EmuWait emu_wait[EMU_MAX_THREADS];
int emu_nthreads, emu_cur, emu_exited;
void (*emu_body)();
char* emu_stacks;
int emu_error;  // 0 ok, else the first error
char emu_error_text[512];
void* emu_dynamic_shared;
void** emu_args;

static void emu_fail(int code, const char* what) {
    if (!emu_error) {
        emu_error = code;
        if (emu_cur >= 0)
            snprintf(emu_error_text, sizeof emu_error_text, "block (%u,%u,%u) thread %d: %s", blockIdx.x, blockIdx.y,
                     blockIdx.z, emu_cur, what);
        else
            snprintf(emu_error_text, sizeof emu_error_text, "block (%u,%u,%u): %s", blockIdx.x, blockIdx.y,
                     blockIdx.z, what);
    }
}

static inline void emu_yield() { emu_switch(&emu_fiber_sp[emu_cur], emu_sched_sp); }

// ---- block barrier (counts exited threads as arrived, like sm_70+) --------------------------------
struct EmuBlockBarrier {
    int count = 0;
    long gen = 0;
    int acc_count = 0, acc_or = 0, acc_and = 1;
    int res_count[2] = {0, 0}, res_or[2] = {0, 0}, res_and[2] = {0, 0};
};
EmuBlockBarrier emu_block_bar;

static void emu_block_release() {
    EmuBlockBarrier& b = emu_block_bar;
    const int p = (int)(b.gen & 1);
    b.res_count[p] = b.acc_count;
    b.res_or[p] = b.acc_or;
    b.res_and[p] = b.acc_and;
    b.acc_count = 0;
    b.acc_or = 0;
    b.acc_and = 1;
    b.count = 0;
    ++b.gen;
}

// returns the parity of the generation arrived at (for the reductions)
static int emu_block_arrive(int pred) {
    EmuBlockBarrier& b = emu_block_bar;
    const long g = b.gen;
    b.acc_count += pred != 0;
    b.acc_or |= pred != 0;
    b.acc_and &= pred != 0;
    emu_wait[emu_cur] = {&b.gen, g};
    if (++b.count == emu_nthreads - emu_exited) emu_block_release();
    emu_yield();
    return (int)(g & 1);
}

static inline void __syncthreads() { emu_block_arrive(1); }
static inline int __syncthreads_count(int pred) {
    const int p = emu_block_arrive(pred);
    return emu_block_bar.res_count[p];
}
static inline int __syncthreads_or(int pred) {
    const int p = emu_block_arrive(pred);
    return emu_block_bar.res_or[p];
}
static inline int __syncthreads_and(int pred) {
    const int p = emu_block_arrive(pred);
    return emu_block_bar.res_and[p];
}

// ---- warp collectives ------------------------------------------------------------------------------
// One slot per (warp, mask); a collective writes its value to buf[gen & 1][lane], waits for the
// mask's lanes, reads. Double buffering by generation parity: a lane writing generation g + 2 has
// passed generation g + 1, which every lane reaches only after reading generation g.
struct EmuWarpSlot {
    unsigned mask = 0;
    int count = 0;
    long gen = 0;
    unsigned long long buf[2][32];
};
static const int EMU_SLOTS = 8;
EmuWarpSlot emu_warp_slots[EMU_MAX_THREADS / 32][EMU_SLOTS];

static unsigned long long* emu_warp_exchange(unsigned mask, unsigned long long value) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!(mask >> lane & 1u)) {
        emu_fail(3, "warp collective called by a lane outside its mask");
        mask |= 1u << lane;
    }
    EmuWarpSlot* slot = nullptr;
    for (int s = 0; s < EMU_SLOTS; ++s) {
        EmuWarpSlot& c = emu_warp_slots[warp][s];
        if (c.mask == mask) { slot = &c; break; }
        if (c.mask == 0) { c.mask = mask; slot = &c; break; }
    }
    if (!slot) {
        emu_fail(3, "too many distinct warp masks");
        abort();
    }
    const long g = slot->gen;
    const int p = (int)(g & 1);
    slot->buf[p][lane] = value;
    emu_wait[emu_cur] = {&slot->gen, g};
    if (++slot->count == __builtin_popcount(mask)) {
        slot->count = 0;
        ++slot->gen;
    }
    emu_yield();
    return slot->buf[p];
}

template <typename T>
static inline unsigned long long emu_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
    unsigned long long raw = 0;
    memcpy(&raw, &v, sizeof(T));
    return raw;
}
template <typename T>
static inline T emu_from_bits(unsigned long long raw) {
    T v;
    memcpy(&v, &raw, sizeof(T));
    return v;
}
static inline void emu_check_width(int width) {
    if (width <= 0 || width > 32 || (width & (width - 1))) emu_fail(3, "shuffle width not a power of two <= 32");
}
template <typename T>
static T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    emu_check_width(width);
    const int lane = threadIdx.x & 31;
    const int source = (lane & ~(width - 1)) + (src & (width - 1));
    return emu_from_bits<T>(emu_warp_exchange(mask, emu_bits(v))[source]);
}
template <typename T>
static T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    emu_check_width(width);
    const int lane = threadIdx.x & 31;
    int source = lane ^ lane_mask;
    if (source >= ((lane & ~(width - 1)) + width)) source = lane;
    return emu_from_bits<T>(emu_warp_exchange(mask, emu_bits(v))[source]);
}
template <typename T>
static T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    emu_check_width(width);
    const int lane = threadIdx.x & 31;
    int source = lane - (int)delta;
    if (source < (lane & ~(width - 1))) source = lane;
    return emu_from_bits<T>(emu_warp_exchange(mask, emu_bits(v))[source]);
}
template <typename T>
static T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    emu_check_width(width);
    const int lane = threadIdx.x & 31;
    int source = lane + (int)delta;
    if (source >= (lane & ~(width - 1)) + width) source = lane;
    return emu_from_bits<T>(emu_warp_exchange(mask, emu_bits(v))[source]);
}
static unsigned __ballot_sync(unsigned mask, int pred) {
    const unsigned long long* got = emu_warp_exchange(mask, pred != 0);
    unsigned r = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && got[l]) r |= 1u << l;
    return r;
}
static int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
static void __syncwarp(unsigned mask = 0xffffffffu) { emu_warp_exchange(mask, 0); }

// ---- atomics (fibers never switch inside one: trivially atomic) -----------------------------------
template <typename T, typename U> static T atomicAdd(T* p, U v) { T o = *p; *p = o + (T)v; return o; }
template <typename T, typename U> static T atomicSub(T* p, U v) { T o = *p; *p = o - (T)v; return o; }
template <typename T, typename U> static T atomicMax(T* p, U v) { T o = *p; *p = std::max(o, (T)v); return o; }
template <typename T, typename U> static T atomicMin(T* p, U v) { T o = *p; *p = std::min(o, (T)v); return o; }
template <typename T, typename U> static T atomicExch(T* p, U v) { T o = *p; *p = (T)v; return o; }
template <typename T, typename U> static T atomicOr(T* p, U v) { T o = *p; *p = o | (T)v; return o; }
template <typename T, typename U> static T atomicAnd(T* p, U v) { T o = *p; *p = o & (T)v; return o; }
template <typename T, typename U> static T atomicXor(T* p, U v) { T o = *p; *p = o ^ (T)v; return o; }
template <typename T, typename U, typename W> static T atomicCAS(T* p, U cmp, W v) {
    T o = *p;
    if (o == (T)cmp) *p = (T)v;
    return o;
}
#define atomicAdd_block atomicAdd
#define atomicMax_block atomicMax
static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __threadfence_system() {}
static inline void __nanosleep(unsigned) {}
template <typename T> static inline T __ldg(const T* p) { return *p; }
static long long emu_clock;
static inline long long clock64() { return ++emu_clock; }

// ---- intrinsics ----------------------------------------------------------------------------------
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline long long __double_as_longlong(double d) { long long u; memcpy(&u, &d, 8); return u; }
static inline double __longlong_as_double(long long u) { double d; memcpy(&d, &u, 8); return d; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
template <typename A, typename B> static inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B> static inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)a > (C)b ? (C)a : (C)b;
}

// ---- launch ----------------------------------------------------------------------------------------
extern char __start_emu_shared[] __attribute__((weak));
extern char __stop_emu_shared[] __attribute__((weak));

static void emu_fiber_entry() {
    const int t = emu_cur;
    emu_body();
    emu_done[t] = true;
    emu_wait[t] = {nullptr, 0};
    ++emu_exited;
    EmuBlockBarrier& b = emu_block_bar;
    if (b.count > 0 && b.count == emu_nthreads - emu_exited) emu_block_release();
    emu_switch(&emu_fiber_sp[t], emu_sched_sp);
    abort();  // never resumed
}

// ---- crashes: a fault inside an emulated kernel (out-of-bounds access, fiber stack overflow) ----------
char emu_label[256];
extern "C" void emu_set_label(const char* label) { snprintf(emu_label, sizeof emu_label, "%s", label); }
static void emu_on_fault(int sig, siginfo_t* info, void*) {
    char text[600];
    const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : "signal";
    const int n = snprintf(text, sizeof text,
                           "EMULATED KERNEL CRASH: %s (address %p) in %s, block (%u,%u,%u), thread %d: an "
                           "out-of-bounds access (or a fiber stack overflow)\n",
                           name, info->si_addr, emu_label, blockIdx.x, blockIdx.y, blockIdx.z, emu_cur);
    if (write(2, text, n) < 0) {}
    _exit(86);
}
static void emu_install_fault_handler() {
    static bool done = false;
    if (done) return;
    done = true;
    static char alt[64 * 1024];
    stack_t ss;
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = emu_on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
    sigaction(SIGFPE, &sa, nullptr);
}

// order 0: threads resumed 0, 1, ..., n - 1; 1: n - 1, ..., 0. Returns 0 or an error code.
static int emu_launch(emu_dim3 grid, unsigned threads, size_t shmem, void (*fn)(), int order,
                      unsigned char poison) {
    emu_error = 0;
    emu_error_text[0] = 0;
    emu_install_fault_handler();
    if (threads == 0 || threads > (unsigned)EMU_MAX_THREADS) {
        emu_fail(2, "block size out of range");
        return emu_error;
    }
    if (!emu_stacks) {
        emu_stacks = (char*)mmap(nullptr, EMU_STACK * EMU_MAX_THREADS, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (emu_stacks == MAP_FAILED) abort();
        for (int t = 0; t < EMU_MAX_THREADS; ++t) mprotect(emu_stacks + t * EMU_STACK, 4096, PROT_NONE);  // guard
    }
    static char* shared_raw = nullptr;  // [guard][dynamic shared memory][guard]
    static size_t shared_cap = 0;
    const size_t guard = 4096;
    if (shmem > shared_cap || !shared_raw) {
        free(shared_raw);
        shared_cap = (shmem + 255) / 256 * 256;
        shared_raw = (char*)aligned_alloc(256, shared_cap + 2 * guard);
    }
    char* const shared_buf = shared_raw + guard;
    memset(shared_raw, 0xA5, guard);
    memset(shared_buf + shmem, 0xA5, guard);
    emu_dynamic_shared = shmem ? shared_buf : nullptr;
    emu_nthreads = (int)threads;
    emu_body = fn;
    gridDim = grid;
    blockDim = emu_dim3{threads, 1, 1};
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = emu_dim3{bx, by, bz};
                if (__start_emu_shared && __stop_emu_shared > __start_emu_shared)
                    memset(__start_emu_shared, poison, __stop_emu_shared - __start_emu_shared);
                if (shmem) memset(shared_buf, poison, shmem);
                emu_block_bar = EmuBlockBarrier();
                for (unsigned w = 0; w < (threads + 31) / 32; ++w)
                    for (auto& s : emu_warp_slots[w]) s = EmuWarpSlot();
                emu_exited = 0;
                for (unsigned t = 0; t < threads; ++t) {
                    void** sp = (void**)(emu_stacks + (t + 1) * EMU_STACK) - 8;
                    for (int r = 0; r < 6; ++r) sp[r] = nullptr;
                    sp[6] = (void*)&emu_fiber_entry;
                    sp[7] = nullptr;
                    emu_fiber_sp[t] = sp;
                    emu_done[t] = false;
                    emu_wait[t] = {nullptr, 0};
                }
                for (;;) {
                    bool any = false, progress = false;
                    for (unsigned i = 0; i < threads; ++i) {
                        const unsigned t = order ? threads - 1 - i : i;
                        if (emu_done[t]) continue;
                        any = true;
                        if (emu_wait[t].gen && *emu_wait[t].gen == emu_wait[t].value) continue;
                        emu_wait[t] = {nullptr, 0};
                        emu_cur = (int)t;
                        threadIdx = emu_dim3{t, 0, 0};
                        emu_switch(&emu_sched_sp, emu_fiber_sp[t]);
                        progress = true;
                    }
                    if (!any) break;
                    if (!progress) {
                        int at_block = 0, at_warp = 0, first_block = -1, first_warp = -1;
                        for (unsigned t = 0; t < threads; ++t) {
                            if (emu_done[t]) continue;
                            if (emu_wait[t].gen == &emu_block_bar.gen) {
                                ++at_block;
                                if (first_block < 0) first_block = (int)t;
                            } else {
                                ++at_warp;
                                if (first_warp < 0) first_warp = (int)t;
                            }
                        }
                        char text[200];
                        snprintf(text, sizeof text,
                                 "deadlock: %d threads at __syncthreads (first %d), %d at warp collectives "
                                 "(first %d), %d exited",
                                 at_block, first_block, at_warp, first_warp, emu_exited);
                        emu_cur = -1;
                        emu_fail(1, text);
                        return emu_error;  // the fibers are abandoned (their stacks are reset next block)
                    }
                }
                if (emu_error) return emu_error;
                for (size_t i = 0; i < guard; ++i)
                    if ((unsigned char)shared_raw[i] != 0xA5 || (unsigned char)shared_buf[shmem + i] != 0xA5) {
                        emu_cur = -1;
                        emu_fail(4, "write outside the dynamic shared memory (extern __shared__)");
                        return emu_error;
                    }
            }
    return emu_error;
}

// ---- per-kernel glue: the parameter list, and a body calling the kernel with emu_args ------------
template <typename T>
static int emu_scalar_kind() {
    return std::is_floating_point<T>::value ? 1 : (std::is_integral<T>::value || std::is_enum<T>::value ? 0 : 4);
}
template <typename T>
static void emu_param_info(int* out) {  // size, kind, pointee size, pointee kind
    typedef typename std::remove_cv<T>::type U;
    out[0] = (int)sizeof(U);
    if (std::is_pointer<U>::value) {
        typedef typename std::remove_pointer<U>::type E;
        out[1] = std::is_const<E>::value ? 3 : 2;
        typedef typename std::remove_cv<E>::type F;
        if (std::is_void<F>::value) {
            out[2] = 0;
            out[3] = 2;
        } else {
            out[2] = (int)sizeof(typename std::conditional<std::is_void<F>::value, char, F>::type);
            out[3] = std::is_floating_point<F>::value ? 1 : (std::is_integral<F>::value ? 0 : 2);
        }
    } else {
        out[1] = emu_scalar_kind<U>();
        out[2] = 0;
        out[3] = 0;
    }
}

template <typename F> struct EmuSig;
template <typename... A> struct EmuSig<void (*)(A...)> {
    static int info(int* out) {
        int i = 0;
        (void)std::initializer_list<int>{(emu_param_info<A>(out + 4 * i++), 0)...};
        return (int)sizeof...(A);
    }
    template <void (*K)(A...), size_t... I> static void call(std::index_sequence<I...>) {
        K(*(typename std::remove_cv<A>::type*)emu_args[I]...);
    }
    template <void (*K)(A...)> static void body() { call<K>(std::index_sequence_for<A...>{}); }
};

#define EMU_KERNEL(NAME)                                                                                    \
    extern "C" int emu_info_##NAME(int* out) { return EmuSig<decltype(&NAME)>::info(out); }                \
    extern "C" int emu_launch_##NAME(unsigned gx, unsigned gy, unsigned gz, unsigned threads,              \
                                     unsigned long long shmem, void** args, int order, int poison) {       \
        emu_args = args;                                                                                   \
        return emu_launch(emu_dim3{gx, gy, gz}, threads, (size_t)shmem,                                    \
                          &EmuSig<decltype(&NAME)>::template body<&NAME>, order, (unsigned char)poison);   \
    }

extern "C" const char* emu_error_message() { return emu_error_text; }
