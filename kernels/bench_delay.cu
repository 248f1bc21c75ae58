// A GPU-side delay for benchmarks (gpudecode/bench/state_copy.py): one thread spins on the global
// nanosecond timer. Work queued behind it while it spins starts back to back when it ends, so CUDA
// events around that work time the GPU alone, without the host's launch preparation (nvbench's
// "blocking kernel").
//
// Memory layout: none; the kernel touches no memory. Launch with one block of one thread.

extern "C" __global__ void gpu_delay(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
