"""The CUDA kernels of cc/sparse24/gpu_kernels.cu, run on the CPU (this machine has no GPU).

The .cu file is compiled by g++ as C++ with tests/cuda_on_cpu/cuda_on_cpu.h force-included, which
runs every CUDA thread of a launch as a fiber and every barrier (__syncthreads, __syncthreads_or,
the warp shuffles) as a real rendezvous of the block's threads; the file's `<<<...>>>` launches are
rewritten into calls first. The kernels are checked against independent references: compress,
check_meta and decompress bit for bit against format.py, the plain SpMM and the NaN/Inf propagation
against a float64 dense matmul, the weight fingerprint against a numpy transcription of its
formula. What needs the GPU (speed, coalescing, cuSPARSELt, TensorFlow's stream) is for
scripts/gpu_check.sh.

Needs the CUDA headers (cuda_fp16.h, cuda_runtime_api.h; not nvcc): fails under CI=true without
them and skips elsewhere.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import pathlib
import re
import subprocess
import tempfile

import ml_dtypes
import numpy as np
import pytest
from cc_build import load_setup_module, tool_missing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_format import bits, random_24

from tf_sparse24 import format as fmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "cc", "sparse24", "gpu_kernels.cu")
EMULATION = os.path.join(ROOT, "tests", "cuda_on_cpu")
DTYPES = {np.float32: 0, ml_dtypes.bfloat16: 1, np.float16: 2}  # sparse24::DType
OUT_EPS = {np.float32: 2.0**-24, ml_dtypes.bfloat16: 2.0**-8, np.float16: 2.0**-11}
NO_ERROR = 2**64 - 1  # gpu::kNoError
U64 = 2**64 - 1
# `kernel<template args><<<grid, block, shmem, stream>>>(` (template args without nested <>).
LAUNCH = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\(", re.DOTALL)

i64, vp, u64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64
SIGNATURES = {
    "sim_reset_error_slots": [vp, ctypes.c_int],
    "sim_compress": [ctypes.c_int, vp, i64, i64, vp, vp, vp],
    "sim_check_meta": [vp, i64, i64, vp],
    "sim_decompress": [ctypes.c_int, vp, vp, i64, i64, ctypes.c_int, vp],
    "sim_spmm_simple_unless": [ctypes.c_int, vp, vp, vp, i64, i64, i64, vp, vp, u64],
    "sim_propagate_nonfinite": [ctypes.c_int, vp, vp, vp, i64, i64, i64, vp],
    "sim_fingerprint_weight": [vp, i64, vp, i64, vp],
}


def rewrite_launches(source: str) -> str:
    """`k<<<g, b, s, st>>>(args)` -> `::cuda_on_cpu::launch(g, b, s, st, &k)(args)`, every one."""
    rewritten, count = LAUNCH.subn(
        lambda m: f"::cuda_on_cpu::launch({m.group(2)}, &{m.group(1)})(", source
    )
    assert count == source.count("<<<") > 0, "a launch the rewrite does not recognise"
    return rewritten


def _build(out_dir: str, include: str) -> str:
    """g++ builds gpu_kernels.cu (launches rewritten) with the emulation into
    out_dir/libgpu_kernels_<hash>.so once per source state."""
    headers = [os.path.join(ROOT, "cc", "sparse24", h) for h in ("gpu_kernels.h", "dtype.h")]
    inputs = [SOURCE, *headers, *sorted(glob.glob(os.path.join(EMULATION, "*")))]
    digest = hashlib.sha1(b"".join(pathlib.Path(p).read_bytes() for p in inputs)).hexdigest()[:12]
    lib = os.path.join(out_dir, f"libgpu_kernels_{digest}.so")
    if os.path.exists(lib):
        return lib
    tmp = tempfile.mkdtemp(dir=out_dir)
    with open(SOURCE) as f:
        source = rewrite_launches(f.read())
    rewritten = os.path.join(tmp, "gpu_kernels_on_cpu.cc")
    with open(rewritten, "w") as f:
        f.write(f'#line 1 "{SOURCE}"\n{source}')
    flags = ["-std=c++17", "-O1", "-fPIC", "-Wall", "-Werror", f"-I{ROOT}", f"-I{include}"]
    # -Bsymbolic: our cudaMemsetAsync / cudaGetLastError stand-ins, not the CUDA stubs a loaded
    # TensorFlow exports under the same names.
    subprocess.run(
        ["g++", *flags, "-include", os.path.join(EMULATION, "cuda_on_cpu.h"), rewritten,
         os.path.join(EMULATION, "gpu_kernels_entry.cc"), "-shared", "-Wl,-Bsymbolic",
         "-o", os.path.join(tmp, "lib.so")],
        check=True,
    )  # fmt: skip
    os.replace(os.path.join(tmp, "lib.so"), lib)  # atomic: parallel workers may race here
    return lib


@pytest.fixture(scope="module")
def gpu() -> ctypes.CDLL:
    include = os.path.join(load_setup_module().cuda_home(), "include")
    if not os.path.exists(os.path.join(include, "cuda_fp16.h")):
        tool_missing(f"the CUDA headers ({include}/cuda_fp16.h)", "install the CUDA toolkit")
    out_dir = os.path.join(ROOT, "build", "gpu_kernels_on_cpu")
    os.makedirs(out_dir, exist_ok=True)
    lib = ctypes.CDLL(_build(out_dir, include))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return lib


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def call(lib: ctypes.CDLL, name: str, *args) -> None:
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


def spmm(gpu, x, values, meta, k, fingerprint=None, expected=0, y=None) -> np.ndarray:
    m, n = x.shape[0], values.shape[0]
    y = poisoned((m, n), x.dtype) if y is None else y
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


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), groups=st.integers(1, 24), n=st.integers(1, 40),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_spmm_simple_matches_float64(gpu, m, groups, n, dtype, seed):
    """Rows 1..9 (tiles of 4 rows, a partial last one), K up to 96 (the lanes of a warp split the
    groups: some lanes get none, some two)."""
    rng = np.random.default_rng(seed)
    k = 4 * groups
    x = rng.standard_normal((m, k)).astype(dtype)
    w = random_24(rng, k, n, dtype)
    values, meta = fmt.compress(w)
    y = spmm(gpu, x, values, meta, k).astype(np.float64)
    ref = dense_reference(x, w)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    bound = OUT_EPS[dtype] * np.abs(ref) + k * 2.0**-24 * magnitude + 2.0**-130
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"


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
    ref = dense_reference(x, w)
    y = y.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(y) & (y > 0), np.isinf(ref) & (ref > 0))
    np.testing.assert_array_equal(np.isinf(y) & (y < 0), np.isinf(ref) & (ref < 0))
    finite = np.isfinite(ref)
    assert finite[[0, 2, 5, 6, 7, 9, 10, 11]].all() and not finite[[1, 3, 12]].any()
    np.testing.assert_allclose(y[finite], ref[finite], rtol=2 * OUT_EPS[dtype] + 1e-5, atol=1e-5)


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
