"""The GPU path's code run on the CPU (this machine has no GPU): the CUDA kernels of
cc/sparse24/gpu_kernels.cu, the host code around them (gpu_matmul.cu's SparseMatMul with its
weight cache, gpu_spmm.cu's cuSPARSELt calls, gpu_blas.cu's cuBLAS fallback, the library loading),
and the gpu_check harness that scripts/gpu_check.sh runs on a GPU.

The GPU sources are compiled by g++ as C++. For gpu_kernels.cu, tests/cuda_on_cpu/cuda_on_cpu.h
(force-included) runs every CUDA thread of a launch as a fiber and every barrier (__syncthreads,
__syncthreads_or, the warp shuffles) as a real rendezvous of the block's threads; the file's
`<<<...>>>` launches are rewritten into calls first. cuda_runtime_on_cpu.cc stands in for the CUDA
runtime, fake_cusparselt.cc and fake_cublas.cc (written from NVIDIA's API documentation) for the
libraries, loaded the way the op loads the real ones ($TF_SPARSE24_CUSPARSELT, $TF_SPARSE24_CUBLAS).

Checked against independent references: compress, check_meta and decompress bit for bit against
format.py; the plain SpMM, NaN/Inf propagation and every SparseMatMul path against a float64 dense
matmul; the fingerprint against a numpy transcription of its formula; the cache's hits, repairs of
weights changed in place, evictions, fallbacks, errors and log lines; the harness's own checks all
passing. What needs the GPU (the real cuSPARSELt's layout and numbers, speed, TensorFlow's stream
and allocator) is for scripts/gpu_check.sh.

Needs the CUDA headers (cuda_fp16.h, cuda_runtime.h; not nvcc): fails under CI=true without
them and skips elsewhere.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from cc_build import load_setup_module, tool_missing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_format import bits, random_24

from tf_sparse24 import format as fmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC = os.path.join(ROOT, "cc", "sparse24")
KERNELS = os.path.join(CC, "gpu_kernels.cu")
HARNESS = os.path.join(CC, "gpu_check.cu")
HOST_SOURCES = [*(os.path.join(CC, f"gpu_{name}.cu") for name in ("matmul", "spmm", "blas", "dlopen")),
                os.path.join(CC, "cusparselt.cc")]  # fmt: skip
EMULATION = os.path.join(ROOT, "tests", "cuda_on_cpu")
DTYPES = {np.float32: 0, ml_dtypes.bfloat16: 1, np.float16: 2}  # sparse24::DType
OUT_EPS = {np.float32: 2.0**-24, ml_dtypes.bfloat16: 2.0**-8, np.float16: 2.0**-11}
NO_ERROR = 2**64 - 1  # gpu::kNoError
U64 = 2**64 - 1
# `kernel<template args><<<grid, block, shmem, stream>>>(` (template args without nested <>).
LAUNCH = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\(", re.DOTALL)

i64, vp, u64, cint, text = (
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_uint64,
    ctypes.c_int,
    ctypes.c_char_p,
)
SIGNATURES = {  # name: (argument types, result type)
    "sim_reset_error_slots": ([vp, cint], cint),
    "sim_compress": ([cint, vp, i64, i64, vp, vp, vp], cint),
    "sim_check_meta": ([vp, i64, i64, vp], cint),
    "sim_decompress": ([cint, vp, vp, i64, i64, cint, vp], cint),
    "sim_spmm_simple_unless": ([cint, vp, vp, vp, i64, i64, i64, vp, vp, u64], cint),
    "sim_propagate_nonfinite": ([cint, vp, vp, vp, i64, i64, i64, vp], cint),
    "sim_fingerprint_weight": ([vp, i64, vp, i64, vp], cint),
    "sim_session_new": ([cint, u64, u64], vp),
    "sim_session_delete": ([vp], None),
    "sim_session_max_alloc": ([vp, u64], None),
    "sim_session_matmul": ([vp, cint, vp, vp, vp, i64, i64, i64, vp, text, i64], cint),
    "sim_session_stats": ([vp, vp], None),
    "sim_session_logs": ([vp, text, i64], None),
    "sim_compress_checked": ([vp, cint, vp, i64, i64, vp, vp, text, i64], cint),
    "sim_decompress_checked": ([vp, cint, vp, vp, i64, i64, vp, text, i64], cint),
    "sim_events_not_ready": ([cint], None),
    "sim_live_buffers": ([], ctypes.c_longlong),
    "sim_live_pinned": ([], ctypes.c_longlong),
    "sim_live_events": ([], ctypes.c_longlong),
}


def rewrite_launches(source: str) -> str:
    """`k<<<g, b, s, st>>>(args)` -> `::cuda_on_cpu::launch(g, b, s, st, &k)(args)`, every one."""
    rewritten, count = LAUNCH.subn(
        lambda m: f"::cuda_on_cpu::launch({m.group(2)}, &{m.group(1)})(", source
    )
    assert count == source.count("<<<") > 0, "a launch the rewrite does not recognise"
    return rewritten


def _compile_all(tmp: str, include: str) -> None:
    """Compiles the GPU sources (the .cu files with kernels rewritten first) and the emulation,
    links tmp/libgpu.so, tmp/gpu_check and the fake libraries."""
    flags = ["-std=c++17", "-O1", "-fPIC", "-Wall", "-Werror", f"-I{ROOT}", f"-I{include}"]
    jobs = {}  # object name: compiler arguments
    for name, path in (("kernels", KERNELS), ("harness", HARNESS)):
        with open(path) as f:
            source = rewrite_launches(f.read())
        rewritten = os.path.join(tmp, f"{name}.cc")
        with open(rewritten, "w") as f:
            f.write(f'#line 1 "{path}"\n{source}')
        jobs[name] = ["-include", os.path.join(EMULATION, "cuda_on_cpu.h"), rewritten]
    for src in HOST_SOURCES:
        jobs[os.path.basename(src)] = ["-x", "c++", src]
    for name in ("cuda_runtime_on_cpu", "gpu_entry"):
        jobs[name] = [os.path.join(EMULATION, f"{name}.cc")]

    def compile_one(name: str) -> subprocess.CompletedProcess:
        cmd = ["g++", *flags, "-c", *jobs[name], "-o", os.path.join(tmp, f"{name}.o")]
        return subprocess.run(cmd, capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for done in pool.map(compile_one, jobs):
            assert done.returncode == 0, done.stderr[-3000:]
    objects = {name: os.path.join(tmp, f"{name}.o") for name in jobs}
    common = [o for name, o in objects.items() if name not in ("harness", "gpu_entry")]
    # -Bsymbolic: our cuda* stand-ins, not the CUDA stubs a loaded TensorFlow exports.
    link = ["g++", "-shared", "-Wl,-Bsymbolic"]
    libs = ["-ldl", "-lpthread"]
    libgpu = os.path.join(tmp, "libgpu.so")
    subprocess.run([*link, *common, objects["gpu_entry"], "-o", libgpu, *libs], check=True)
    harness = [objects["harness"], *common]
    subprocess.run(["g++", *harness, "-o", os.path.join(tmp, "gpu_check"), *libs], check=True)
    fakes = {"libcusparseLt.so.0": ("fake_cusparselt", []), "libcublas.so.13": ("fake_cublas", []),
             # cuSPARSELt 0.6 / 0.7: no cusparseLtMatmulAlgSelectionDestroy (added in 0.8.0)
             "libcusparseLt-0.7.so.0": ("fake_cusparselt", ["-DFAKE_CUSPARSELT_0_7"])}
    for name, (fake, defines) in fakes.items():
        source = os.path.join(EMULATION, f"{fake}.cc")
        subprocess.run([*link, *flags, *defines, source, "-o", os.path.join(tmp, name)],
                       check=True)


def _build(out_dir: str, include: str) -> dict[str, str]:
    """Builds, once per source state, into out_dir/<hash>/: libgpu.so (the GPU sources, the
    kernels' launches rewritten, with the runtime stand-in and the C entry points), the gpu_check
    harness on the same objects, and the fake libraries libcusparseLt.so.0 and libcublas.so.13.
    Returns their paths by those names. A file lock makes parallel workers share one build."""
    sources = sorted(
        glob.glob(os.path.join(CC, "gpu_*.*")) + glob.glob(os.path.join(CC, "cusparselt*"))
    )
    inputs = [*sources, *(os.path.join(CC, h) for h in ("dtype.h", "half.h")),
              *sorted(glob.glob(os.path.join(EMULATION, "*"))), __file__]  # fmt: skip
    key = hashlib.sha1(include.encode())  # and this file: the compile commands
    for path in inputs:
        key.update(pathlib.Path(path).read_bytes())
    out = os.path.join(out_dir, key.hexdigest()[:12])
    names = ("libgpu.so", "gpu_check", "libcusparseLt.so.0", "libcublas.so.13",
             "libcusparseLt-0.7.so.0")
    with open(os.path.join(out_dir, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(out):
            tmp = tempfile.mkdtemp(dir=out_dir)
            _compile_all(tmp, include)
            os.rename(tmp, out)
    return {name: os.path.join(out, name) for name in names}


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    include = os.path.join(load_setup_module().cuda_home(), "include")
    if not os.path.exists(os.path.join(include, "cuda_fp16.h")):
        tool_missing(f"the CUDA headers ({include}/cuda_fp16.h)", "install the CUDA toolkit")
    out_dir = os.path.join(ROOT, "build", "gpu_on_cpu")
    os.makedirs(out_dir, exist_ok=True)
    return _build(out_dir, include)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


@pytest.fixture(scope="module")
def gpu(built) -> ctypes.CDLL:
    """The GPU sources on the CPU, finding the fake cuSPARSELt and cuBLAS (each library instance
    loads them once, at first use: tests of other settings load a copy of the library)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TF_SPARSE24_CUSPARSELT", built["libcusparseLt.so.0"])
        env.setenv("TF_SPARSE24_CUBLAS", built["libcublas.so.13"])
        lib = load(built["libgpu.so"])
        with Session(lib) as session:  # loads both libraries while the variables are set
            for dtype, m, k, n in [(ml_dtypes.bfloat16, 1, 16, 16), (np.float32, 9, 4, 1)]:
                session.check(*problem(np.random.default_rng(0), dtype, m, k, n))
            assert session.stats()["compressions"] == 1 and session.stats()["dense_calls"] == 1
    return lib


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def call(lib: ctypes.CDLL, name: str, *args) -> None:  # a launcher: returns a cudaError_t
    assert getattr(lib, name)(*args) == 0, f"{name} returned a CUDA error"


def poisoned(shape, dtype) -> np.ndarray:
    """An output buffer whose every element a kernel must overwrite (0x5a bytes: finite, odd)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(size, 0x5A, np.uint8).view(dtype).reshape(shape)


def with_specials(rng, w: np.ndarray) -> np.ndarray:
    """w with NaN, +inf and -inf at random non-zeros (non-zeros to compression)."""
    flat = w.reshape(-1)
    nonzero = np.flatnonzero(flat)
    for value in (np.nan, np.inf, -np.inf)[: len(nonzero)]:
        flat[nonzero[rng.integers(len(nonzero))]] = value
    return w


def compress(gpu, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    k, n = w.shape
    values, meta = poisoned((n, k // 2), w.dtype), poisoned((n, (k + 7) // 8), np.uint8)
    first_bad = np.zeros(1, np.uint64)
    call(gpu, "sim_reset_error_slots", ptr(first_bad), 1)
    call(gpu, "sim_compress", DTYPES[w.dtype.type], ptr(w), k, n, ptr(values), ptr(meta),
         ptr(first_bad))  # fmt: skip
    return values, meta, int(first_bad[0])


def check_meta(gpu, meta: np.ndarray, k: int) -> tuple[int, int]:
    slots = np.zeros(2, np.uint64)
    call(gpu, "sim_reset_error_slots", ptr(slots), 2)
    call(gpu, "sim_check_meta", ptr(meta), k, meta.shape[0], ptr(slots))
    return int(slots[0]), int(slots[1])


def spmm(gpu, x, values, meta, k, fingerprint=None, expected=0) -> np.ndarray:
    """spmm_simple_unless into a poisoned y (the plain SpMM when no fingerprint is given)."""
    m, n = x.shape[0], values.shape[0]
    y = poisoned((m, n), x.dtype)
    call(gpu, "sim_spmm_simple_unless", DTYPES[x.dtype.type], ptr(x), ptr(values), ptr(meta), m,
         k, n, ptr(y), ptr(fingerprint), expected)  # fmt: skip
    return y


# --------------------------------------------------------------------------------------------------
# compress / check_meta / decompress: bit for bit against format.py


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 11), n=st.integers(1, 40), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_compress_matches_format(gpu, groups, n, dtype, seed):
    rng = np.random.default_rng(seed)
    w = with_specials(rng, random_24(rng, 4 * groups, n, dtype))
    values, meta, first_bad = compress(gpu, w)
    ref_values, ref_meta = fmt.compress(w)
    np.testing.assert_array_equal(bits(values), bits(ref_values))  # pads +0.0, -0.0 kept or not
    np.testing.assert_array_equal(meta, ref_meta)
    assert first_bad == NO_ERROR


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compress_names_the_first_group_with_three_nonzeros(gpu, dtype):
    rng = np.random.default_rng(3)
    k, n = 36, 29
    w = random_24(rng, k, n, dtype)
    bad = [(7, 20), (2, 25), (2, 26), (8, 0)]  # (group, column); first in memory order: (2, 25)
    for g, col in bad:
        w[4 * g : 4 * g + 3, col] = np.array([1.5, -2.0, 3.0], np.float32).astype(dtype)
    assert compress(gpu, w)[2] == min(g * n + col for g, col in bad)
    with pytest.raises(ValueError, match="2:4"):  # format.py refuses the same matrix
        fmt.compress(w)


@pytest.mark.parametrize("k", [40, 44])  # K % 8 == 0 and == 4 (a half-used last meta byte)
def test_check_meta_finds_the_first_bad_group_and_pad(gpu, k):
    rng = np.random.default_rng(k)
    n, groups = 23, k // 4
    _, meta = fmt.compress(random_24(rng, k, n, np.float32))
    assert check_meta(gpu, meta, k) == (NO_ERROR, NO_ERROR)
    invalid = [nib for nib in range(16) if (nib & 3) >= (nib >> 2)]  # not p0 < p1

    def broken(bad: dict[tuple[int, int], int]) -> np.ndarray:
        out = meta.copy()
        for (col, g), nibble in bad.items():
            shift = 4 * (g % 2)
            out[col, g // 2] = (int(out[col, g // 2]) & ~(0xF << shift)) | (nibble << shift)
        return out

    for nibble in invalid:  # each kind of bad nibble alone: equal, then descending positions
        col, g = int(rng.integers(n)), int(rng.integers(groups))
        assert check_meta(gpu, broken({(col, g): nibble}), k)[0] == col * groups + g, hex(nibble)
    bad = {(int(rng.integers(n)), int(rng.integers(groups))): nib for nib in invalid[:5]}
    assert check_meta(gpu, broken(bad), k)[0] == min(col * groups + g for col, g in bad)
    with pytest.raises(ValueError):
        fmt.check_meta(broken(bad), k)
    if k % 8 == 4:  # the unused high nibble of the last byte must be zero
        padded = meta.copy()
        padded[[17, 9], -1] |= 0x40
        assert check_meta(gpu, padded, k) == (NO_ERROR, 9)
        with pytest.raises(ValueError):
            fmt.check_meta(padded, k)


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 11), n=st.integers(1, 40), dtype=st.sampled_from(list(DTYPES)),
       transposed=st.booleans(), seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_decompress_matches_format(gpu, groups, n, dtype, transposed, seed):
    rng = np.random.default_rng(seed)
    k = 4 * groups
    values, meta = fmt.compress(with_specials(rng, random_24(rng, k, n, dtype)))
    out = poisoned((n, k) if transposed else (k, n), dtype)
    call(gpu, "sim_decompress", DTYPES[dtype], ptr(values), ptr(meta), k, n, int(transposed),
         ptr(out))  # fmt: skip
    ref = fmt.decompress(values, meta, k)
    np.testing.assert_array_equal(bits(out), bits(ref.T if transposed else ref))


# --------------------------------------------------------------------------------------------------
# The plain SpMM and NaN/Inf propagation: against a float64 dense matmul


def dense_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float64) @ w.astype(np.float64)


def assert_nonfinite_like_dense(y, x, w) -> np.ndarray:
    """y is NaN, +Inf and -Inf exactly where float64 x @ w is, and close to it elsewhere; returns
    where x @ w is finite."""
    ref, y = dense_reference(x, w), y.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(y) & (y > 0), np.isinf(ref) & (ref > 0))
    np.testing.assert_array_equal(np.isinf(y) & (y < 0), np.isinf(ref) & (ref < 0))
    finite = np.isfinite(ref)
    rtol = 2 * OUT_EPS[x.dtype.type] + 1e-5
    np.testing.assert_allclose(y[finite], ref[finite], rtol=rtol, atol=1e-5)
    return finite


def problem(rng, dtype, m, k, n):
    """x [m, k], a 2:4 W [k, n] and its compressed form, in dtype."""
    x = rng.standard_normal((m, k)).astype(dtype)
    w = random_24(rng, k, n, dtype)
    return (x, w, *fmt.compress(w))


def assert_close(y, x, w):
    """y = x @ w up to rounding to y's dtype and float32 accumulation over K (K 2^-24 sum|x w|)."""
    ref = dense_reference(x, w)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    bound = OUT_EPS[x.dtype.type] * np.abs(ref) + x.shape[1] * 2.0**-24 * magnitude + 2.0**-130
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound).all(), f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), groups=st.integers(1, 40), n=st.integers(1, 40),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_spmm_simple_matches_float64(gpu, m, groups, n, dtype, seed):
    """Rows 1..9 (tiles of 4 rows, a partial last one), K up to 160 (the 32 lanes of a warp split
    the groups: below 32 groups some lanes get none, above it some get two)."""
    x, w, values, meta = problem(np.random.default_rng(seed), dtype, m, 4 * groups, n)
    assert_close(spmm(gpu, x, values, meta, 4 * groups), x, w)


def test_spmm_simple_unless_leaves_y_when_the_fingerprint_matches(gpu):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    w = random_24(rng, 32, 11, np.float32)
    values, meta = fmt.compress(w)
    fingerprint = np.array([0x1234_5678_9ABC_DEF0], np.uint64)
    kept = spmm(gpu, x, values, meta, 32, fingerprint, 0x1234_5678_9ABC_DEF0)
    np.testing.assert_array_equal(bits(kept), bits(poisoned(kept.shape, np.float32)))
    y = spmm(gpu, x, values, meta, 32, fingerprint, 0x1234_5678_9ABC_DEF1)
    np.testing.assert_allclose(y, dense_reference(x, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_nonfinite_x_gives_what_a_dense_matmul_gives(gpu, dtype, aligned):
    """spmm_simple then propagate_nonfinite: NaN exactly where x @ W in float64 is NaN (a NaN/Inf
    x meeting a pruned zero, a kept zero, or +inf and -inf products), +-inf where it is +-inf.
    `unaligned`: x one element past an 8-byte boundary (the kernel's element-wise scan)."""
    rng = np.random.default_rng(11)
    m, k, n = 13, 44, 37
    storage = np.zeros(m * k + 1, dtype)
    x = storage[int(not aligned) :][: m * k].reshape(m, k)
    x[...] = rng.standard_normal((m, k)).astype(dtype)
    assert (x.ctypes.data % 8 == 0) == aligned
    x[1, 5] = np.nan
    x[3, 0] = np.inf
    x[4, [7, 30]] = [np.inf, -np.inf]
    x[8, 43] = -np.inf
    x[12, :] = np.inf  # rows 0, 2, 5-7, 9-11 finite
    w = random_24(rng, k, n, dtype)  # groups with fewer non-zeros keep explicit zeros
    values, meta = fmt.compress(w)
    y = spmm(gpu, x, values, meta, k)
    call(gpu, "sim_propagate_nonfinite", DTYPES[dtype], ptr(x), ptr(values), ptr(meta), m, k, n,
         ptr(y))  # fmt: skip
    finite = assert_nonfinite_like_dense(y, x, w)
    assert finite[[0, 2, 5, 6, 7, 9, 10, 11]].all() and not finite[[1, 3, 12]].any()


# --------------------------------------------------------------------------------------------------
# The weight fingerprint: against a numpy transcription of its formula


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _terms(words: np.ndarray, positions: np.ndarray, salt: int) -> int:
    keys = (np.uint64(4) * positions.astype(np.uint64) + np.uint64(salt)) * np.uint64(
        0x9E3779B97F4A7C15
    )
    return int(_mix64(words.astype(np.uint64) ^ keys).sum(dtype=np.uint64))


def reference_fingerprint(data: np.ndarray, salt: int) -> int:
    """gpu_kernels.cu's fingerprint_add: 8-byte words at positions 0, 1, ... of a 16-byte aligned
    buffer's whole 16-byte chunks, then each remaining byte j at position bytes / 8 + 1 + j (every
    byte so when the buffer is not 16-byte aligned); keys (4 * position + salt) * golden ratio."""
    size = data.size
    chunks = size // 16 if data.ctypes.data % 16 == 0 else 0
    total = _terms(data[: 16 * chunks].view("<u8"), np.arange(2 * chunks), salt)
    tail = np.arange(16 * chunks, size)
    total += _terms(data[tail], size // 8 + 1 + tail, salt)
    return total & U64


def at_offset(data: np.ndarray, offset: int) -> np.ndarray:
    """A copy of the bytes `data` starting `offset` bytes past a 64-byte boundary."""
    storage = np.zeros(data.size + 128, np.uint8)
    start = (-storage.ctypes.data) % 64 + offset
    out = storage[start : start + data.size]
    out[...] = data
    return out


def fingerprint(gpu, values: np.ndarray, meta: np.ndarray) -> int:
    out = np.zeros(1, np.uint64)
    call(gpu, "sim_fingerprint_weight", ptr(values), values.size, ptr(meta), meta.size, ptr(out))
    return int(out[0])


@pytest.mark.parametrize("offset", [0, 16, 1, 8])
@pytest.mark.parametrize("sizes", [(0, 0), (1, 3), (16, 15), (5000, 625), (48, 17)])
def test_fingerprint_matches_its_formula(gpu, sizes, offset):
    rng = np.random.default_rng(sizes[0] + offset)
    values = at_offset(rng.integers(0, 256, sizes[0], np.uint8), offset)
    meta = at_offset(rng.integers(0, 256, sizes[1], np.uint8), offset)
    expected = (reference_fingerprint(values, 1) + reference_fingerprint(meta, 2)) & U64
    assert fingerprint(gpu, values, meta) == expected


def test_fingerprint_of_a_large_weight_matches_its_formula(gpu):
    """4 MiB + 1 KiB of values: more 16-byte chunks than the 1,024-block grid has threads, so
    threads take several (the grid-stride loop) and 1,024 block sums meet in one atomic."""
    rng = np.random.default_rng(1)
    values = at_offset(rng.integers(0, 256, (4 << 20) + 1024, np.uint8), 0)
    meta = at_offset(rng.integers(0, 256, 4096, np.uint8), 0)
    expected = (reference_fingerprint(values, 1) + reference_fingerprint(meta, 2)) & U64
    assert fingerprint(gpu, values, meta) == expected


def test_fingerprint_sees_every_byte_and_buffer(gpu):
    rng = np.random.default_rng(2)
    values = at_offset(rng.integers(0, 256, 1000, np.uint8), 0)
    meta = at_offset(rng.integers(0, 256, 125, np.uint8), 0)
    base = fingerprint(gpu, values, meta)
    assert fingerprint(gpu, at_offset(values, 0), at_offset(meta, 0)) == base  # a copy: same
    for buffer, i in [(values, 0), (values, 999), (values, 512), (meta, 0), (meta, 124)]:
        buffer[i] ^= 0x01
        assert fingerprint(gpu, values, meta) != base, f"byte {i} of a {buffer.size}-byte buffer"
        buffer[i] ^= 0x01
    swapped = values.copy()
    swapped[[0, 8]] = swapped[[8, 0]]  # the same words at other positions
    assert values[0] == values[8] or fingerprint(gpu, swapped, meta) != base
    # The same bytes split differently between values and meta.
    joined = np.concatenate([values, meta])
    assert fingerprint(gpu, at_offset(joined[:1016], 0), at_offset(joined[1016:], 0)) != base


# --------------------------------------------------------------------------------------------------
# SparseMatMul (gpu_matmul.cu): every path against a float64 dense matmul, the cache, the errors

OK, INVALID_ARGUMENT, FAILED_PRECONDITION = 0, 1, 2  # gpu::Status::Code
STATS = ("cached_weights", "cached_bytes", "compressions", "decompressions", "plain_calls",
         "dense_calls")  # fmt: skip


class Session:
    """One SparseMatMul (as one TF kernel instance holds) with a counting allocator."""

    def __init__(self, lib, trust=False, max_weights=1024, max_bytes=2 << 30):
        self.lib = lib
        self.handle = lib.sim_session_new(int(trust), max_weights, max_bytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lib.sim_session_delete(self.handle)

    def matmul(self, x, values, meta, k) -> tuple[int, str, np.ndarray]:
        """(status code, message, y) of y = x @ W on this session (y poisoned first)."""
        y = poisoned((x.shape[0], values.shape[0]), x.dtype)
        message = ctypes.create_string_buffer(4096)
        code = self.lib.sim_session_matmul(self.handle, DTYPES[x.dtype.type], ptr(x), ptr(values),
                                           ptr(meta), x.shape[0], k, values.shape[0], ptr(y),
                                           message, len(message))  # fmt: skip
        return code, message.value.decode(), y

    def check(self, x, w, values, meta) -> np.ndarray:
        """Runs the matmul, asserts it succeeded and matches float64 x @ w; returns y."""
        code, message, y = self.matmul(x, values, meta, w.shape[0])
        assert code == OK, message
        assert_close(y, x, w)
        return y

    def stats(self) -> dict[str, int]:
        out = np.zeros(len(STATS), np.int64)
        self.lib.sim_session_stats(self.handle, ptr(out))
        return dict(zip(STATS, out.tolist(), strict=True))

    def logs(self) -> list[str]:
        """The logged messages (each "key<TAB>message")."""
        out = ctypes.create_string_buffer(1 << 16)
        self.lib.sim_session_logs(self.handle, out, len(out))
        return out.value.decode().splitlines()


@pytest.mark.parametrize(
    "dtype, m, k, n, path",
    [
        (ml_dtypes.bfloat16, 16, 64, 32, "compressions"),  # cuSPARSELt
        (ml_dtypes.bfloat16, 5, 48, 16, "compressions"),  # ... x padded to 16 rows
        (np.float16, 37, 32, 48, "compressions"),
        (np.float32, 8, 64, 32, "plain_calls"),  # float32: no 2:4 mode; few rows: plain kernel
        (np.float32, 9, 64, 32, "dense_calls"),  # ... more rows: cuBLAS on the dense weight
        (ml_dtypes.bfloat16, 3, 20, 7, "plain_calls"),  # K, N not multiples of 16
        (np.float16, 24, 36, 16, "dense_calls"),
    ],
)
def test_matmul_matches_float64_on_every_path(gpu, dtype, m, k, n, path):
    with Session(gpu) as session:
        session.check(*problem(np.random.default_rng(m + k + n), dtype, m, k, n))
        stats = session.stats()
        assert stats[path] == 1 and sum(stats[p] for p in STATS[2:]) == 1 + (path == "dense_calls")
        reasons = [
            line for line in session.logs() if "does not use the Sparse Tensor Cores" in line
        ]
        assert len(reasons) == (path != "compressions")


@pytest.mark.parametrize("dtype, m", [(ml_dtypes.bfloat16, 20), (np.float32, 12)],
                         ids=["cuSPARSELt", "cuBLAS"])  # fmt: skip
def test_cached_weight_changed_in_place_is_repaired_then_rebuilt(gpu, dtype, m):
    """A weight's cached form (cuSPARSELt's operand, or the dense weight) is reused while the
    weight is unchanged; changed in place (same buffers), the next call's y is recomputed on the
    device and the call after rebuilds the form; an event not yet complete only defers that."""
    rng = np.random.default_rng(7)
    form = "compressions" if dtype == ml_dtypes.bfloat16 else "decompressions"
    x, w, values, meta = problem(rng, dtype, m, 32, 16)
    with Session(gpu) as session:
        session.check(x, w, values, meta)
        session.check(rng.standard_normal(x.shape).astype(dtype), w, values, meta)
        assert session.stats()[form] == 1 and session.stats()["cached_weights"] == 1
        w2 = random_24(rng, 32, 16, dtype)
        values[...], meta[...] = fmt.compress(w2)  # in place: the cache's key is unchanged
        session.check(x, w2, values, meta)  # stale form, repaired y
        assert session.stats()[form] == 1
        gpu.sim_events_not_ready(1)  # the fingerprint copy has not arrived yet: keep the entry
        session.check(x, w2, values, meta)
        assert session.stats()[form] == 1
        session.check(x, w2, values, meta)  # now known stale: rebuilt
        assert session.stats()[form] == 2 and session.stats()["cached_weights"] == 1


def test_trusted_weight_address_skips_the_check(gpu):
    """TF_SPARSE24_GPU_TRUST_WEIGHT_ADDRESS=1 (served constants): no fingerprint, so a weight
    changed in place keeps its old cached form, as documented."""
    rng = np.random.default_rng(8)
    x, w, values, meta = problem(rng, ml_dtypes.bfloat16, 16, 32, 16)
    with Session(gpu, trust=True) as session:
        session.check(x, w, values, meta)
        values[...], meta[...] = fmt.compress(random_24(rng, 32, 16, ml_dtypes.bfloat16))
        code, _, y = session.matmul(x, values, meta, 32)
        assert code == OK
        assert_close(y, x, w)  # the old weight's product


def test_cache_keeps_the_most_recently_used_within_its_limits(gpu):
    rng = np.random.default_rng(9)
    weights = [problem(rng, np.float16, 16, 64, 32) for _ in range(3)]
    with Session(gpu, max_weights=2) as session:
        for p in weights:
            session.check(*p)
        session.check(*weights[2])  # newest: a hit
        assert session.stats()["compressions"] == 3 and session.stats()["cached_weights"] == 2
        session.check(*weights[0])  # evicted as least recently used: compressed again
        assert session.stats()["compressions"] == 4 and session.stats()["cached_weights"] == 2
        session.check(*weights[2])  # still cached
        assert session.stats()["compressions"] == 4
        one_weight = session.stats()["cached_bytes"] // 2
    with Session(gpu, max_bytes=one_weight) as session:
        for p in weights:
            session.check(*p)
        assert session.stats()["cached_weights"] == 1
        assert session.stats()["cached_bytes"] == one_weight


@pytest.mark.parametrize("dtype, m, k, n", [(ml_dtypes.bfloat16, 16, 64, 32),
                                            (np.float32, 16, 64, 32), (np.float32, 2, 44, 8)])  # fmt: skip
def test_bad_meta_is_named_before_anything_runs(gpu, dtype, m, k, n):
    x, _, values, meta = problem(np.random.default_rng(10), dtype, m, k, n)
    meta[5, 3] = (meta[5, 3] & 0x0F) | 0x50  # row 5, group 7: positions (1, 1)
    with Session(gpu) as session:
        code, message, y = session.matmul(x, values, meta, k)
        assert code == INVALID_ARGUMENT
        assert message == ("Sparse24MatMul: invalid meta: row n=5, group g=7 has positions that "
                           "are not strictly ascending")  # fmt: skip
        np.testing.assert_array_equal(bits(y), bits(poisoned(y.shape, dtype)))  # y untouched
        assert session.stats()["cached_weights"] == 0


@pytest.mark.parametrize("dtype, m, k, n", [(ml_dtypes.bfloat16, 5, 64, 32), (np.float16, 30, 48, 16),
                                            (np.float32, 12, 64, 32), (np.float32, 3, 20, 7)])  # fmt: skip
def test_nonfinite_x_gives_what_a_dense_matmul_gives_on_every_path(gpu, dtype, m, k, n):
    x, w, values, meta = problem(np.random.default_rng(12), dtype, m, k, n)
    x[0, 3], x[1, 0], x[2, [5, 9]] = np.nan, np.inf, [np.inf, -np.inf]
    with Session(gpu) as session:
        code, message, y = session.matmul(x, values, meta, k)
        assert code == OK, message
    finite = assert_nonfinite_like_dense(y, x, w)
    assert not finite[:3].all() and finite[3:].all()


def test_shape_cusparselt_refuses_falls_back_and_is_logged_once(gpu, monkeypatch):
    monkeypatch.setenv("FAKE_CUSPARSELT_REFUSE_M", "48")  # plans for N = 48 (A = W^T: m = N)
    rng = np.random.default_rng(13)
    with Session(gpu) as session:
        session.check(*problem(rng, ml_dtypes.bfloat16, 16, 32, 48))
        session.check(*problem(rng, ml_dtypes.bfloat16, 16, 32, 48))
        session.check(*problem(rng, ml_dtypes.bfloat16, 4, 32, 32))  # another N: cuSPARSELt
        refusals = [line for line in session.logs() if "cuSPARSELt does not take" in line]
        assert len(refusals) == 1 and "M=16 K=32 N=48" in refusals[0], session.logs()
        assert "CUSPARSE_STATUS_NOT_SUPPORTED (10)" in refusals[0]
        stats = session.stats()
        assert stats["dense_calls"] == 2 and stats["compressions"] == 1


def test_cublas_failing_or_out_of_memory_runs_the_plain_kernel(gpu, monkeypatch):
    rng = np.random.default_rng(14)
    p = problem(rng, np.float32, 12, 64, 32)
    with Session(gpu) as session:
        monkeypatch.setenv("FAKE_CUBLAS_FAIL", "1")
        session.check(*p)
        assert session.stats()["plain_calls"] == 1 and session.stats()["cached_weights"] == 0
        assert any(line.startswith("cuBLAS: cublasGemmEx(M=12 K=64 N=32) returned 13")
                   for line in session.logs()), session.logs()  # fmt: skip
        monkeypatch.delenv("FAKE_CUBLAS_FAIL")
        gpu.sim_session_max_alloc(session.handle, 64 * 32 * 4 - 1)  # no room for the dense W
        session.check(*p)
        assert session.stats()["plain_calls"] == 2 and session.stats()["dense_calls"] == 0
        assert any("no memory for the decompressed weight" in line for line in session.logs())


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"TF_SPARSE24_CUSPARSELT": "/nonexistent/libcusparseLt.so.0"},
         ("cuSPARSELt (libcusparseLt.so.0) could not be loaded; the GPU 2:4 matmul needs it. "
          "Install it with `pip install tf_sparse24[gpu]`")),
        ({"FAKE_CUSPARSELT_VERSION": "502"},
         "cuSPARSELt version code 502 found; tf_sparse24 needs 0.6 (600) or newer"),
    ],
    ids=["missing", "too old"],
)  # fmt: skip
def test_unusable_cusparselt_says_what_to_install(built, tmp_path, monkeypatch, env, expected):
    """A library instance of its own (a copy: it loads cuSPARSELt once per process)."""
    monkeypatch.setenv("TF_SPARSE24_CUSPARSELT", built["libcusparseLt.so.0"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    shutil.copy(built["libgpu.so"], tmp_path / "libgpu.so")
    lib = load(str(tmp_path / "libgpu.so"))
    x, _, values, meta = problem(np.random.default_rng(15), ml_dtypes.bfloat16, 16, 32, 16)
    with Session(lib) as session:
        code, message, _ = session.matmul(x, values, meta, 32)
    assert code == FAILED_PRECONDITION and message.startswith(expected), message


def test_cusparselt_before_0_8_is_used(built, tmp_path, monkeypatch):
    """cuSPARSELt 0.6 and 0.7 (setup.py asks for >= 0.6; PyTorch 2.6 and 2.7 pin 0.6.3) have no
    cusparseLtMatmulAlgSelectionDestroy, which 0.8.0 introduced: the op still loads and uses them,
    and releases its plans without that call. A library instance of its own (a copy)."""
    monkeypatch.setenv("TF_SPARSE24_CUSPARSELT", built["libcusparseLt-0.7.so.0"])
    shutil.copy(built["libgpu.so"], tmp_path / "libgpu.so")
    lib = load(str(tmp_path / "libgpu.so"))
    rng = np.random.default_rng(18)
    with Session(lib) as session:
        session.check(*problem(rng, ml_dtypes.bfloat16, 16, 32, 16))
        session.check(*problem(rng, np.float16, 20, 64, 32))  # another plan (M padded to 32)
        assert session.stats()["compressions"] == 2
    # The plans were destroyed with the session: a new one still works.
    with Session(lib) as session:
        session.check(*problem(rng, ml_dtypes.bfloat16, 16, 32, 16))


def test_checked_compress_and_decompress_name_the_group(gpu):
    rng = np.random.default_rng(16)
    w = random_24(rng, 24, 10, np.float16)
    w[12:15, 6] = [1, 2, 3]  # group 3 of column 6
    values, meta = poisoned((10, 12), np.float16), poisoned((10, 3), np.uint8)
    message = ctypes.create_string_buffer(1024)
    with Session(gpu) as session:
        code = gpu.sim_compress_checked(session.handle, DTYPES[np.float16], ptr(w), 24, 10,
                                        ptr(values), ptr(meta), message, len(message))  # fmt: skip
        assert code == INVALID_ARGUMENT
        assert message.value.decode().startswith(
            "Sparse24Compress: not 2:4 sparse: group g=3 (rows k=12..15) of column n=6 has more "
            "than 2 non-zeros"
        )
        values, meta = fmt.compress(random_24(rng, 24, 10, np.float16))
        meta[9, 0] = 0x33  # row 9, group 0: positions (3, 0)
        out = poisoned((24, 10), np.float16)
        code = gpu.sim_decompress_checked(session.handle, DTYPES[np.float16], ptr(values),
                                          ptr(meta), 24, 10, ptr(out), message, len(message))  # fmt: skip
        assert code == INVALID_ARGUMENT
        assert message.value.decode().startswith(
            "Sparse24Decompress: invalid meta: row n=9, group g=0"
        )


def test_concurrent_calls_and_every_buffer_released(gpu):
    """Two threads share one SparseMatMul (as TF's inter-op threads do); afterwards its buffers,
    pinned slots and events are all released."""
    rng = np.random.default_rng(17)
    problems = [problem(rng, dtype, 20, 32, 16) for dtype in (ml_dtypes.bfloat16, np.float32) * 3]
    before = (gpu.sim_live_buffers(), gpu.sim_live_pinned(), gpu.sim_live_events())
    with Session(gpu) as session, ThreadPoolExecutor(2) as pool:
        for y, (x, w, _, _) in zip(pool.map(lambda p: session.check(*p), problems * 2),
                                   problems * 2, strict=True):  # fmt: skip
            assert_close(y, x, w)
        assert session.stats()["cached_weights"] == len(problems)
        assert gpu.sim_live_events() - before[2] == len(problems)
    assert (gpu.sim_live_buffers(), gpu.sim_live_pinned(), gpu.sim_live_events()) == before


# --------------------------------------------------------------------------------------------------
# The gpu_check harness (scripts/gpu_check.sh runs it on a GPU), run whole on the emulation


def test_gpu_check_harness_runs_through(built, tmp_path):
    """Every check of the harness passes and its benchmark table is printed and written, on the
    emulation with the stand-in libraries (--small-checks: its large check shapes scaled down;
    its times are CPU times, meaningless). So the one run on a GPU does not find harness bugs. Its
    three checks that need a kernel holding the stream are skipped (the emulated device has no
    memory pools), so the run ends INCOMPLETE, exit status 3, as it would on such a GPU."""
    cmd = [built["gpu_check"], "--small-checks", "--sizes", "32", "--ffn", "32x64",
           "--batches", "1,16", "--warmup", "1", "--reps", "2", "--out", str(tmp_path),
           "--cusparselt", built["libcusparseLt.so.0"], "--cublas", built["libcublas.so.13"]]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 3, run.stdout[-5000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "gpu_check: INCOMPLETE (0 failed checks, 3 skipped)"
    assert not [line for line in lines if "[FAIL]" in line]
    skips = [line for line in lines if "[skip]" in line]
    assert len(skips) == 3 and all("no memory pools" in line for line in skips), skips
    assert sum("[ok]" in line for line in lines) >= 290
    with open(tmp_path / "gpu_check.csv") as f:
        rows = [line.split(",") for line in f.read().splitlines()]
    assert rows[0][:4] == ["dtype", "M", "K", "N"] and len(rows) == 1 + 2 * 3
    assert {(r[0], r[1], r[2], r[3]) for r in rows[1:]} == {
        (t, m, k, n) for t in ("bf16", "fp16") for m, k, n in [("32",) * 3, ("1", "32", "64"),
                                                               ("16", "32", "64")]
    }  # fmt: skip
    assert all(float(r[8]) < 1e-2 for r in rows[1:])  # rel err of each timed shape
    with open(tmp_path / "gpu_check.log") as f:
        assert f.read() == run.stdout
