// Dense recurrent states (gpudecode/states/dense.py): the children of one search step, one launch
// per state variable.
//
// Memory layout
// -------------
// A state variable is one C-contiguous array in the model's own layout with the N lanes along its
// batch axis, seen here as [pre, N, row]: pre = product of the dims before the batch axis (the
// layers of an LSTM state [L, N, H]), row = the dims after it (H), counted in copy units of
// sizeof(Unit) bytes (the launcher picks the widest unit that divides the row's bytes and the
// arrays' alignment: 16, 8, 4, 2 or 1 bytes; the dtype does not matter, rows are copied as bits).
//
// Semantics
// ---------
// Lane i of the child step descends from lane parents[i] of this step; it was fed a label when
// labels[i] >= 0. Its state is its parent's new state (the model's output of this step) where it
// was fed a label, else the parent's own state (carried, the model's input of this step):
//     out[a, i, :] = (labels[i] >= 0 ? new_states : old_states)[a, parents[i], :]
// With next_out non-null the launch also writes the labels the child lanes feed next:
//     next_out[i] = labels[i] >= 0 ? labels[i] : next_in[parents[i]]
// out and next_out never alias the inputs (the launcher writes a fresh array or the other of two
// ping-pong buffers).
//
// Thread mapping: a grid-stride loop over the pre * N * row units of the output, so consecutive
// threads copy consecutive units of a row (coalesced reads and writes); the lane bookkeeping is a
// second grid-stride loop over the N lanes.

template <typename Unit>
__device__ void copy_children(const long long* __restrict__ parents, const long long* __restrict__ labels,
                              const Unit* __restrict__ old_states, const Unit* __restrict__ new_states,
                              Unit* __restrict__ out, long long pre, long long num_lanes, long long row_units,
                              const long long* __restrict__ next_in, long long* __restrict__ next_out)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = pre * num_lanes * row_units;
    for (long long k = first; k < total; k += stride) {
        const long long row = k / row_units;
        const long long unit = k - row * row_units;
        const long long a = row / num_lanes;
        const long long lane = row - a * num_lanes;
        const long long parent = parents[lane];
        const Unit* source = labels[lane] >= 0 ? new_states : old_states;
        out[k] = source[(a * num_lanes + parent) * row_units + unit];
    }
    if (next_out != nullptr) {
        for (long long lane = first; lane < num_lanes; lane += stride) {
            const long long label = labels[lane];
            next_out[lane] = label >= 0 ? label : next_in[parents[lane]];
        }
    }
}

// copy units: plain bits of 16, 8, 4, 2 and 1 bytes (whatever the state's dtype)
struct __align__(16) Unit16 { unsigned int v[4]; };
struct __align__(8) Unit8 { unsigned int v[2]; };
struct __align__(4) Unit4 { unsigned int v; };
struct __align__(2) Unit2 { unsigned short v; };
struct Unit1 { unsigned char v; };

#define DENSE_CHILDREN(NAME, UNIT)                                                                     \
    extern "C" __global__ void NAME(const long long* parents, const long long* labels,                 \
                                    const UNIT* old_states, const UNIT* new_states, UNIT* out,         \
                                    long long pre, long long num_lanes, long long row_units,           \
                                    const long long* next_in, long long* next_out)                     \
    {                                                                                                  \
        copy_children<UNIT>(parents, labels, old_states, new_states, out, pre, num_lanes, row_units,   \
                            next_in, next_out);                                                        \
    }

DENSE_CHILDREN(dense_children_16, Unit16)
DENSE_CHILDREN(dense_children_8, Unit8)
DENSE_CHILDREN(dense_children_4, Unit4)
DENSE_CHILDREN(dense_children_2, Unit2)
DENSE_CHILDREN(dense_children_1, Unit1)
