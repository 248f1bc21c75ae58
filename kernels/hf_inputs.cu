// The per-row inputs of a Hugging Face decoder step in ONE launch (gpudecode/session/hf.py,
// write_attention_inputs; the array version is hf_attention_inputs there).
//
// Memory layout
// -------------
//   prefix          [rows] int32: each row's history length (labels in the past positions)
//   attention_mask  [rows, past_time + num_new] int64 or int32 (the _i64 / _i32 kernel), or null:
//                   left-aligned histories (left != 0): 1 over the row's first prefix + num_new
//                   positions; right-aligned: 1 over its last prefix + num_new positions; else 0
//   position_ids    [rows, num_new] of the same type, or null: prefix + p for new token p
// One thread per mask element (or per position where the mask is null).

template <typename T>
__device__ __forceinline__ void step_inputs(const int* __restrict__ prefix, long long rows, long long past_time,
                                            int num_new, int left, T* __restrict__ mask, T* __restrict__ positions) {
    const long long width = past_time + num_new;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long columns = mask != nullptr ? width : num_new;
    if (i >= rows * columns) return;
    const long long r = i / columns, c = i % columns;
    const long long length = prefix[r];
    if (mask != nullptr) mask[i] = (T)(left ? c < length + num_new : c >= past_time - length);
    if (positions != nullptr && c < num_new) positions[r * num_new + c] = (T)(length + c);
}

#define STEP_INPUTS(SUFFIX, T)                                                                                     \
    extern "C" __global__ void hf_step_inputs_##SUFFIX(const int* prefix, long long rows, long long past_time,    \
                                                       int num_new, int left, T* mask, T* positions) {            \
        step_inputs<T>(prefix, rows, past_time, num_new, left, mask, positions);                                  \
    }

STEP_INPUTS(i64, long long)
STEP_INPUTS(i32, int)
