"""Kernel-level tests of the C++ SpMM core (cc/sparse24/spmm*.cc), every ISA variant forced; the
AVX-512 ones (avx512, and avx512bf16 with its own bfloat16 kernel) also as "<isa>-emulated" (SIMDe
standing in for their intrinsics on an AVX2 CPU, see tests/emulated_avx512), so they run on any
AVX2 machine, and natively where the CPU has them.

The core is compiled (once per source version, cached under build/) into a small shared library (cc/sparse24/spmm_ctypes_test.cc
gives it C entry points) and driven with ctypes, so odd cases the TF op never passes (row strides,
M=0, uneven thread splits) are covered too. The reference is numpy float64 on the decompressed
matrix (tf_sparse24.format, the format's definition).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cc_build import EMULATION, compile_objects, require_avx512_emulation

from tf_sparse24 import format as fmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISAS = {"scalar": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}  # sparse24::Isa values
EMULATED = ("avx512", "avx512bf16")  # the variants also run as "<isa>-emulated"
DTYPES = {np.float32: 0, ml_dtypes.bfloat16: 1, np.float16: 2}
# Output rounding (half an ulp, relative) per dtype; accumulation is float32 in every variant.
OUT_EPS = {np.float32: 2.0**-24, ml_dtypes.bfloat16: 2.0**-8, np.float16: 2.0**-11}
# Output rounding below the normal range (half the smallest subnormal), absolute, per dtype.
OUT_TINY = {np.float32: 2.0**-150, ml_dtypes.bfloat16: 2.0**-134, np.float16: 2.0**-25}


def _sources() -> list[str]:
    srcs = sorted(glob.glob(os.path.join(ROOT, "cc", "sparse24", "spmm*.cc")))
    programs = ("spmm_threads_test.cc", "spmm_oom_test.cc")  # each has a main
    srcs = [s for s in srcs if not s.endswith(programs)]
    core = os.path.join(ROOT, "cc", "sparse24")
    return srcs + [os.path.join(core, name) for name in ("cpu_features.cc", "format.cc")]


def _build(out_dir: str, emulate_avx512: bool = False) -> str:
    """Compiles the core into out_dir/libspmm[_emulated]_<hash of sources and headers>.so once
    (reused while they match)."""
    srcs = _sources()
    headers = sorted(glob.glob(os.path.join(ROOT, "cc", "sparse24", "*.h")))
    if emulate_avx512:
        headers += sorted(glob.glob(os.path.join(EMULATION, "*")))
    digest = hashlib.sha1(
        b"".join(pathlib.Path(s).read_bytes() for s in srcs + headers)
    ).hexdigest()[:12]
    kind = "_emulated" if emulate_avx512 else ""
    lib_path = os.path.join(out_dir, f"libspmm{kind}_{digest}.so")
    if os.path.exists(lib_path):
        return lib_path
    tmp = tempfile.mkdtemp(dir=out_dir)
    objs = compile_objects(srcs, tmp, ["-O2", "-fPIC"], emulate_avx512=emulate_avx512)
    subprocess.run(
        ["g++", "-shared", *objs, "-o", os.path.join(tmp, "lib.so"), "-lpthread"],
        check=True,
    )
    os.replace(
        os.path.join(tmp, "lib.so"), lib_path
    )  # atomic: parallel workers may race here
    shutil.rmtree(tmp, ignore_errors=True)
    return lib_path


def _load(emulate_avx512: bool = False) -> ctypes.CDLL:
    out_dir = os.path.join(ROOT, "build", "spmm_core_test")
    os.makedirs(out_dir, exist_ok=True)
    lib = ctypes.CDLL(_build(out_dir, emulate_avx512))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.sparse24_test_spmm.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        vp,
        i64,
        vp,
        vp,
        i64,
        i64,
        i64,
        vp,
        i64,
        ctypes.c_int,
    ]
    lib.sparse24_test_spmm.restype = ctypes.c_int
    return lib


@pytest.fixture(scope="session")
def core() -> ctypes.CDLL:
    return _load()


def _supported(core: ctypes.CDLL, isa: str) -> bool:
    return bool(core.sparse24_test_isa_supported(ISAS[isa]))


@pytest.fixture(params=[*ISAS, *(f"{isa}-emulated" for isa in EMULATED)])
def kernel(request, core):
    """`run(x, values, meta, n, **kw)` through one variant (see `_run`); skips what cannot run."""
    variant = request.param
    lib, isa = core, variant
    if variant.endswith("-emulated"):
        lib, isa = request.getfixturevalue("emulated_core"), variant.removesuffix("-emulated")
    elif not _supported(core, isa):
        pytest.skip(f"this CPU cannot run {isa}")
    return lambda x, values, meta, n, **kw: _run(lib, isa, x, values, meta, n, **kw)


@pytest.fixture(scope="session")
def emulated_core() -> ctypes.CDLL:
    """The core with the AVX-512 kernels emulated (skips, or fails under CI, where it cannot run)."""
    require_avx512_emulation()
    return _load(emulate_avx512=True)


def _run(core, isa, x, values, meta, n, *, y_cols=None, threads=2):
    """y = x @ W through the core; x may be a column slice (row stride > K)."""
    m, k = x.shape
    ldy = y_cols or n
    y = np.full(
        (m, ldy), -7.0, x.dtype
    )  # junk in the stride padding must stay untouched
    ldx = x.strides[0] // x.itemsize if m else k
    rc = core.sparse24_test_spmm(
        DTYPES[x.dtype.type],
        ISAS[isa],
        x.ctypes.data,
        ldx,
        values.ctypes.data,
        meta.ctypes.data,
        m,
        k,
        n,
        y.ctypes.data,
        ldy,
        threads,
    )
    assert rc == 0
    if ldy > n:
        assert (y[:, n:] == -7.0).all(), "kernel wrote outside y's columns"
    return y[:, :n]


def _random_2to4(rng, k, n, dtype):
    """A [K, N] 2:4 matrix in `dtype`, with some groups holding fewer than two non-zeros."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    keep = np.argsort(rng.random((k // 4, 4, n)), axis=1)[:, :2]
    mask = np.zeros((k // 4, 4, n), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    mask &= rng.random(mask.shape) > 0.1
    return (w * mask.reshape(k, n)).astype(dtype)


def _check(y, x, w):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    bound = (
        1e-5 * (np.abs(x64) @ np.abs(w64))
        + OUT_EPS[x.dtype.type] * np.abs(ref)
        + OUT_TINY[x.dtype.type]
    )
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound).all(), (
        f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"
    )


SHAPES = [  # (M, K, N): K % 8 == 4, K < one SIMD chunk, N=1, N off every register block, M tails
    (1, 4, 1),
    (1, 12, 3),
    (2, 20, 5),
    (3, 36, 17),
    (4, 64, 33),
    (5, 132, 40),
    (8, 68, 9),
    (16, 260, 64),
    (17, 100, 70),
    (29, 40, 11),
    (33, 196, 31),
    (70, 516, 129),
    (53, 164, 17),  # AVX2's 48-row panels: one full panel + a tail
    (88, 84, 40),  # AVX-512's 96-row panels: tails of 1-6 registers (5 to 88 rows)
    (96, 260, 65),
    (150, 36, 20),  # > 144 rows: rows are split into blocks as well as columns into tiles
    (200, 68, 300),
    (1, 1028, 300),
    (53, 5124, 9),  # long K: dozens of K blocks, partial sums carried across them
    (166, 5124, 9),  # the same on AVX-512's 96-row panels (96 rows + a 70-row tail)
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: np.dtype(d).name)
def test_matches_float64_reference(kernel, dtype):
    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        w = _random_2to4(rng, k, n, dtype)
        values, meta = fmt.compress(w)
        x = rng.standard_normal((m, k)).astype(dtype)
        _check(kernel(x, values, meta, n), x, w)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_strides_and_empty(kernel, dtype):
    rng = np.random.default_rng(1)
    for m, k, n in [(3, 44, 10), (40, 72, 19)]:
        w = _random_2to4(rng, k, n, dtype)
        values, meta = fmt.compress(w)
        x_wide = rng.standard_normal((m, k + 5)).astype(dtype)
        x = x_wide[:, 2 : 2 + k]  # row stride K + 5, unaligned start
        _check(kernel(x, values, meta, n, y_cols=n + 3), x, w)
    values, meta = fmt.compress(_random_2to4(rng, 8, 6, np.float32))
    assert kernel(np.zeros((0, 8), np.float32), values, meta, 6).shape == (
        0,
        6,
    )
    y = kernel(
        np.ones((2, 0), np.float32),
        np.zeros((6, 0), np.float32),
        np.zeros((6, 0), np.uint8),
        6,
    )
    assert (y == 0).all()


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512bf16"])
def test_row_block_major_schedule(core, isa):
    """An x pack over 8 MiB (float32: 12 panels of 48 rows, 0.75 MiB each, for AVX2, 6 of 96 rows,
    1.5 MiB each, for AVX-512; bfloat16 pairs: 6 of 96 rows, 2.3 MiB each) with 16 column tiles:
    the rows are split into blocks, each block's units run before the next block's. Native variants
    only (a 4.4 G multiply-add product, too slow emulated)."""
    if not _supported(core, isa):
        pytest.skip(f"this CPU cannot run {isa}")
    rng = np.random.default_rng(5)
    m, k, n = 530, 4100, 4096  # blocks of 10 (avx2), 5 (avx512) or 3 (bfloat16 pairs) panels
    for dtype in (np.float32, ml_dtypes.bfloat16):
        w = _random_2to4(rng, k, n, dtype)
        values, meta = fmt.compress(w)
        x = rng.standard_normal((m, k)).astype(dtype)
        _check(_run(core, isa, x, values, meta, n), x, w)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: np.dtype(d).name)
def test_nan_inf_propagate_like_dense(kernel, dtype):
    rng = np.random.default_rng(2)
    # GEMV rows, one panel, and the last rows in a later panel (x is packed per panel); rows 9 and
    # 28 are in the second half of a 16-row block (the bfloat16 pair pack reads 8 rows at a time).
    for m, k, n in [(1, 64, 20), (3, 36, 7), (40, 132, 33), (100, 68, 20)]:
        w = _random_2to4(rng, k, n, dtype)
        values, meta = fmt.compress(w)
        x = rng.standard_normal((m, k)).astype(dtype)
        x[0, 5] = np.nan
        x[m - 1, k - 1] = np.inf
        x[m // 2, 0] = -np.inf
        x[min(m - 1, 9), 3] = np.nan
        x[min(m - 1, 28), 7] = -np.inf
        with np.errstate(invalid="ignore"):
            ref = x.astype(np.float64) @ w.astype(np.float64)
        y = kernel(x, values, meta, n).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(y), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(y), np.isneginf(ref))
        finite = np.isfinite(ref)
        np.testing.assert_allclose(y[finite], ref[finite], rtol=1e-2, atol=1e-2)


# Random shapes, seeds and thread counts (hypothesis strategies), for the tests below.
RANDOM_CASES = {
    "m": st.integers(0, 110),
    "groups": st.integers(1, 40),
    "n": st.integers(1, 40),
    "seed": st.integers(0, 2**31 - 1),
    "threads": st.integers(1, 3),
}


def _random_case(m, groups, n, seed, dtype=np.float32):
    """x [m, 4 * groups] in `dtype`, a 2:4 W and its compressed form."""
    rng = np.random.default_rng(seed)
    k = 4 * groups
    w = _random_2to4(rng, k, n, dtype)
    values, meta = fmt.compress(w)
    return rng.standard_normal((m, k)).astype(dtype), w, values, meta


@settings(max_examples=25, deadline=None)
@given(**RANDOM_CASES, dtype=st.sampled_from(list(DTYPES)))
def test_all_isas_agree_on_random_shapes(core, m, groups, n, seed, threads, dtype):
    x, w, values, meta = _random_case(m, groups, n, seed, dtype)
    for isa in ISAS:
        if _supported(core, isa):
            _check(_run(core, isa, x, values, meta, n, threads=threads), x, w)


@settings(max_examples=25, deadline=None)
@given(**RANDOM_CASES, dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16]))
def test_emulated_avx512_on_random_shapes(emulated_core, m, groups, n, seed, threads, dtype):
    x, w, values, meta = _random_case(m, groups, n, seed, dtype)
    for isa in EMULATED:
        _check(_run(emulated_core, isa, x, values, meta, n, threads=threads), x, w)
