"""Compiles CUDA kernel source for the CPU emulation (runtime.h) and launches its kernels on numpy
arrays with CuPy's RawKernel calling convention: ``kernel(grid, block, args, shared_mem=0)``.

Checks per launch (an EmulationError on any):
- the arguments against the kernel's C signature: a pointer takes a C-contiguous array whose item
  size and kind (int/float) match the pointee, or the null np.uint64(0); a scalar takes a numpy
  scalar of exactly the parameter's size and kind (CuPy packs a scalar by its own dtype);
- every launch runs twice from the same inputs, threads scheduled forward then in reverse and
  shared memory poisoned with different bytes: the outputs must agree bit for bit (catches missing
  barriers and reads of unwritten shared memory);
- the arrays are copied into buffers with guard zones: writes outside an array are reported, and
  nothing may be written through a pointer-to-const;
- deadlocks (barriers not reached by all threads, warp collectives with missing lanes).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RUNTIME = HERE / "runtime.h"
BUILD = Path(os.environ.get("CTCEMU_BUILD", HERE.parent / "build"))
CXXFLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-fno-ipa-reference",
            "-fno-omit-frame-pointer", "-Wno-unused-function", "-Wno-unused-variable"]
GUARD = 4096  # bytes of guard zone either side of every array
GUARD_BYTE = 0xA5

launch_log: list[str] = []  # kernel names, in launch order


class EmulationError(RuntimeError):
    pass


def _strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: " " * len(m.group(0)) if "\n" not in m.group(0)
                  else re.sub(r"[^\n]", " ", m.group(0)), src, flags=re.S)


def _dynamic_shared(src: str) -> str:
    """``extern __shared__ T name[];`` -> a pointer to the launch's dynamic shared buffer."""
    plain = _strip_comments(src)
    out, last = [], 0
    pattern = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:\s]+?)\s+"
                         r"(?:__align__\(\s*\d+\s*\)\s+)?(\w+)\s*\[\s*\]\s*;")
    for m in pattern.finditer(plain):
        depth = plain.count("{", 0, m.start()) - plain.count("}", 0, m.start())
        kind, name = m.group(1).strip(), m.group(2)
        if depth > 0:
            repl = f"{kind}* const {name} = ({kind}*)emu_dynamic_shared;"
        else:
            repl = f"\n#define {name} (({kind}*)emu_dynamic_shared)\n"
        out.append(src[last:m.start()])
        out.append(repl)
        last = m.end()
    out.append(src[last:])
    return "".join(out)


def _kernel_names(src: str, workdir: Path) -> list[str]:
    probe = workdir / "probe.cu"
    probe.write_text(src)
    cmd = ["g++", "-E", "-P", "-x", "c++", "-D__global__=EMU_KERNEL_MARK", "-D__launch_bounds__(...)=",
           "-D__device__=", "-D__forceinline__=", "-D__host__=", str(probe)]
    pre = subprocess.run(cmd, capture_output=True, text=True)
    if pre.returncode:
        raise EmulationError("preprocessing failed:\n" + pre.stderr[-4000:])
    names = re.findall(r"EMU_KERNEL_MARK\s+void\s+(\w+)\s*\(", pre.stdout)
    if not names:
        raise EmulationError("no __global__ kernels found in the source")
    return list(dict.fromkeys(names))


def compile_source(code: str) -> "Library":
    BUILD.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256((RUNTIME.read_text() + "\0" + " ".join(CXXFLAGS) + "\0" + code).encode()).hexdigest()[:20]
    so = BUILD / f"k_{key}.so"
    meta = BUILD / f"k_{key}.names"
    if not so.exists() or not meta.exists():
        work = BUILD / f"w_{key}_{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        src = _dynamic_shared(code)
        names = _kernel_names(code, work)
        unit = work / "unit.cpp"
        unit.write_text(f'#include "{RUNTIME}"\n#line 1 "kernel.cu"\n{src}\n\n// ---- emulator glue\n'
                        + "".join(f"EMU_KERNEL({n})\n" for n in names))
        (work / "kernel.cu").write_text(code)
        tmp = work / "lib.so"
        res = subprocess.run(["g++", *CXXFLAGS, "-o", str(tmp), str(unit)], capture_output=True, text=True)
        (work / "build.log").write_text(res.stdout + res.stderr)
        if res.returncode:
            raise EmulationError(f"g++ failed (see {work}/build.log):\n" + res.stderr[-6000:])
        os.replace(tmp, so)
        meta.write_text("\n".join(names))
        shutil.rmtree(work, ignore_errors=True)
    return Library(so, meta.read_text().split())


class Library:
    _cache: dict = {}

    def __init__(self, so: Path, names: list[str]):
        self.lib = ctypes.CDLL(str(so))
        self.lib.emu_error_message.restype = ctypes.c_char_p
        self.names = names
        self.signatures = {}
        for n in names:
            info = (ctypes.c_int * (4 * 128))()  # up to 128 parameters
            count = getattr(self.lib, f"emu_info_{n}")(info)
            self.signatures[n] = [tuple(info[4 * i:4 * i + 4]) for i in range(count)]

    def kernel(self, name: str) -> "Kernel":
        if name not in self.signatures:
            raise EmulationError(f"no kernel {name!r} in the module (has {self.names})")
        return Kernel(self, name)


def _dims(value, what):
    value = tuple(int(v) for v in (value if isinstance(value, tuple | list) else (value,)))
    if not 1 <= len(value) <= 3:
        raise EmulationError(f"{what} {value}")
    return value + (1,) * (3 - len(value))


class Kernel:
    def __init__(self, library: Library, name: str):
        self.library, self.name = library, name
        self.launch = getattr(library.lib, f"emu_launch_{name}")
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

    def __call__(self, grid, block, args, *, shared_mem=0, **_):
        name, sig = self.name, self.library.signatures[self.name]
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if block[1] != 1 or block[2] != 1:
            raise EmulationError(f"{name}: only 1-D blocks are emulated, got {block}")
        args = tuple(args)
        if len(args) != len(sig):
            raise EmulationError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
        launch_log.append(name)
        if 0 in grid:
            return
        # the arrays (deduplicated by memory), each copied into a guarded buffer per run
        arrays: list[np.ndarray] = []
        slot_of_arg: dict[int, int] = {}
        scalars: dict[int, bytes] = {}
        for i, (a, (size, kind, esize, ekind)) in enumerate(zip(args, sig)):
            where = f"{name} argument {i}"
            if kind in (2, 3):  # pointer
                if isinstance(a, np.ndarray) and a.ndim >= 0 and not isinstance(a, np.generic):
                    if not a.flags.c_contiguous:
                        raise EmulationError(f"{where}: a non-contiguous array (shape {a.shape}, strides {a.strides})")
                    if ekind != 2 and a.size and a.dtype.itemsize != esize:
                        raise EmulationError(f"{where}: {a.dtype} array for a pointer to {esize}-byte items")
                    if ekind != 2 and a.size and (ekind == 1) != (a.dtype.kind == "f"):
                        raise EmulationError(f"{where}: {a.dtype} array for a pointer to "
                                             f"{'float' if ekind == 1 else 'integer'} items")
                    ptr = a.__array_interface__["data"][0]
                    for j, b in enumerate(arrays):
                        pb = b.__array_interface__["data"][0]
                        if ptr < pb + b.nbytes and pb < ptr + a.nbytes:
                            if ptr != pb or a.nbytes != b.nbytes:
                                raise EmulationError(f"{where}: overlaps another argument partially")
                            slot_of_arg[i] = j
                            break
                    else:
                        slot_of_arg[i] = len(arrays)
                        arrays.append(a)
                elif isinstance(a, np.integer | int) and not isinstance(a, bool) and int(a) == 0 and (
                        not isinstance(a, np.generic) or a.dtype.itemsize == 8):
                    scalars[i] = bytes(8)  # null
                else:
                    raise EmulationError(f"{where}: {type(a).__name__} {a!r} for a pointer parameter")
            elif kind in (0, 1):
                if isinstance(a, np.generic):
                    value = a
                elif isinstance(a, bool):
                    value = np.bool_(a)
                elif isinstance(a, int):
                    value = np.int64(a)
                elif isinstance(a, float):
                    value = np.float64(a)
                else:
                    raise EmulationError(f"{where}: {type(a).__name__} for a scalar parameter")
                if value.dtype.itemsize != size or (value.dtype.kind == "f") != (kind == 1):
                    raise EmulationError(f"{where}: {value.dtype} value for a {size}-byte "
                                         f"{'float' if kind == 1 else 'integer'} parameter")
                scalars[i] = value.tobytes()
            else:
                raise EmulationError(f"{where}: parameter of an unsupported type (size {size})")
        const_slots = {slot_of_arg[i] for i, s in enumerate(sig) if s[1] == 3 and i in slot_of_arg}
        written_slots = {slot_of_arg[i] for i, s in enumerate(sig) if s[1] == 2 and i in slot_of_arg}

        results = []
        for order, poison in ((0, 0xFF), (1, 0x7F)):
            bufs = []
            for a in arrays:
                raw = np.full(a.nbytes + 2 * GUARD, GUARD_BYTE, dtype=np.uint8)
                raw[GUARD:GUARD + a.nbytes] = np.frombuffer(a.tobytes(), dtype=np.uint8)
                bufs.append(raw)
            keep = []
            argv = (ctypes.c_void_p * len(args))()
            for i in range(len(args)):
                if i in slot_of_arg:
                    cell = ctypes.c_void_p(bufs[slot_of_arg[i]].ctypes.data + GUARD)
                else:
                    cell = ctypes.create_string_buffer(scalars[i], max(len(scalars[i]), 8))
                keep.append(cell)
                argv[i] = ctypes.addressof(cell)
            self.library.lib.emu_set_label(f"{name} (order {order})".encode())
            rc = self.launch(grid[0], grid[1], grid[2], block[0], int(shared_mem), ctypes.cast(argv, ctypes.c_void_p),
                             order, poison)
            if rc:
                raise EmulationError(f"{name} (grid {grid}, block {block}, order {order}): "
                                     + self.library.lib.emu_error_message().decode())
            for j, (a, raw) in enumerate(zip(arrays, bufs)):
                if (raw[:GUARD] != GUARD_BYTE).any() or (raw[GUARD + a.nbytes:] != GUARD_BYTE).any():
                    before = np.flatnonzero(raw[:GUARD] != GUARD_BYTE)
                    after = np.flatnonzero(raw[GUARD + a.nbytes:] != GUARD_BYTE)
                    raise EmulationError(f"{name}: write outside array {j} (shape {a.shape}, {a.dtype}): "
                                         f"{len(before)} bytes before it, {len(after)} bytes after it")
                if j in const_slots and j not in written_slots and \
                        raw[GUARD:GUARD + a.nbytes].tobytes() != a.tobytes():
                    raise EmulationError(f"{name}: wrote through a pointer to const (array {j}, shape {a.shape})")
            results.append(bufs)
        for j, a in enumerate(arrays):
            first, second = results[0][j][GUARD:GUARD + a.nbytes], results[1][j][GUARD:GUARD + a.nbytes]
            if first.tobytes() != second.tobytes():
                diff = np.flatnonzero(first != second)
                raise EmulationError(
                    f"{name}: array {j} (shape {a.shape}, {a.dtype}) differs between the forward and the reverse "
                    f"thread schedule ({len(diff)} bytes, first at byte {diff[0]}): a race or a read of unwritten "
                    "shared memory")
        for j, a in enumerate(arrays):
            if j in written_slots:
                if a.nbytes:
                    ctypes.memmove(a.ctypes.data, results[0][j].ctypes.data + GUARD, a.nbytes)
