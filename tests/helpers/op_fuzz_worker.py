"""Hypothesis fuzz of the sparse24 ops with good and bad inputs; run in a subprocess by the tests.

Usage: python op_fuzz_worker.py [PROPERTY ...]   (default: all; HYPOTHESIS_EXAMPLES sets the count)

Each property draws inputs, calls the ops and checks the outcome against `tf_sparse24.format` (the
numpy definition of sparse24/v1) or float64 numpy: a valid input must give the reference answer bit
for bit (matmul: within dtype tolerance), an invalid one must raise a Python exception of an
expected type with a message. It runs in its own process so a segfault or abort inside a kernel
shows up as the worker dying from a signal, which the test reports as a failure.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.*
from tf_sparse24 import format as fmt  # noqa: E402
from tf_sparse24 import ops  # noqa: E402

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EXPECTED_ERRORS = (tf.errors.InvalidArgumentError, ValueError, TypeError)
SPECIALS = [np.nan, np.inf, -np.inf, -0.0]
PROPERTIES = {}


def prop(fn):
    PROPERTIES[fn.__name__] = fn
    return fn


def raises_clearly(call, must_mention: str | None = None) -> BaseException:
    """Runs `call`, which must fail with an expected exception type and a meaningful message."""
    try:
        result = call()
    except EXPECTED_ERRORS as err:
        message = str(err)
        assert len(message) > 10, f"unhelpful error message: {message!r}"
        if must_mention:
            assert must_mention in message.lower(), (
                f"error does not mention {must_mention!r}: {message}"
            )
        return err
    raise AssertionError(f"bad input accepted silently; got {result!r}")


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@st.composite
def sparse_matrices(draw, max_k: int = 40, max_n: int = 5, valid: bool | None = None):
    """A [K, N] matrix whose groups have 0..4 non-zeros (all <= 2 if valid), with special values."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    k = 4 * draw(st.integers(0, max_k // 4))
    n = draw(st.integers(0, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = rng.standard_normal((k, n)).astype(np.float32)
    counts = [0, 1, 2, 2, 2] + ([] if valid else [3, 4])
    for g in range(k // 4):
        for col in range(n):
            zero = rng.permutation(4)[: 4 - counts[rng.integers(len(counts))]]
            w[4 * g + zero, col] = 0.0
    if k and n and draw(st.booleans()):  # a special value somewhere (only on a non-zero if valid)
        spots = np.argwhere(w != 0) if valid else np.argwhere(np.ones_like(w, bool))
        if len(spots):
            w[tuple(spots[rng.integers(len(spots))])] = draw(st.sampled_from(SPECIALS))
    return w.astype(DTYPES[dtype])


def is_2to4(w: np.ndarray) -> bool:
    try:
        fmt.check_2to4(w)
        return True
    except ValueError:
        return False


@prop
@SETTINGS
@given(sparse_matrices())
def compress_matches_reference_or_names_the_group(w):
    if not is_2to4(w):
        raises_clearly(lambda: ops.sparse24_compress(w), must_mention="group")
        return
    values, meta = (t.numpy() for t in ops.sparse24_compress(w))
    ref_values, ref_meta = fmt.compress(w)
    np.testing.assert_array_equal(bits(values), bits(ref_values))
    np.testing.assert_array_equal(meta, ref_meta)
    dense = ops.sparse24_decompress(values, meta, w.shape[0]).numpy()
    np.testing.assert_array_equal(
        bits(dense), bits(fmt.decompress(ref_values, ref_meta, w.shape[0]))
    )
    assert np.array_equal(dense.astype(np.float32), w.astype(np.float32), equal_nan=True)


@prop
@SETTINGS
@given(st.integers(1, 3), st.integers(0, 2), st.integers(1, 4), st.sampled_from(sorted(DTYPES)))
def compress_rejects_bad_shapes_and_dtypes(rank, k_extra, n, dtype):
    shape = [4 + k_extra + (k_extra > 0), n, 2][:rank]  # rank 1 / 3, or K not a multiple of 4
    w = np.zeros(shape, DTYPES[dtype])
    if rank == 2 and shape[0] % 4 == 0:
        w = w.astype(np.float64 if dtype == "float32" else np.int32)  # unsupported dtype instead
    raises_clearly(lambda: ops.sparse24_compress(tf.constant(w)))


CORRUPTIONS = [
    "flip_meta_bits",
    "k_attr",
    "values_cols",
    "meta_cols",
    "values_rank",
    "meta_dtype",
    "values_dtype",
    "meta_rows",
]


@prop
@SETTINGS
@given(sparse_matrices(valid=True), st.sampled_from(CORRUPTIONS), st.integers(0, 2**31 - 1))
def decompress_corrupted_inputs_raise_or_match_reference(w, corruption, salt):
    k = w.shape[0]
    values, meta = fmt.compress(w)
    rng = np.random.default_rng(salt)
    k_attr = k
    if corruption == "flip_meta_bits" and meta.size:
        meta = meta.copy()
        meta.flat[rng.integers(meta.size)] ^= np.uint8(1 << rng.integers(8))
    elif corruption == "k_attr":
        k_attr = int(rng.choice([k + 1, k + 4, max(k - 4, 0), k + 2, 2**31 - 4, 2**40, 2**62]))
    elif corruption == "values_cols":  # one column too many, or two too few
        extra = np.zeros((values.shape[0], 1), values.dtype)
        values = np.concatenate([values, extra], 1) if rng.integers(2) else values[:, :-2].copy()
    elif corruption == "meta_cols":
        meta = (
            np.ascontiguousarray(meta[:, 1:])
            if meta.shape[1]
            else np.zeros((meta.shape[0], 1), np.uint8)
        )
    elif corruption == "meta_rows":
        meta = (
            np.concatenate([meta, meta[:1]], 0)
            if meta.shape[0]
            else np.zeros((1, meta.shape[1]), np.uint8)
        )
    elif corruption == "values_rank":
        values = values.reshape(-1)
    elif corruption == "meta_dtype":
        meta = meta.astype(np.int32)
    elif corruption == "values_dtype":
        values = values.astype(np.float64)

    def reference():
        if meta.dtype != np.uint8 or values.dtype.name not in DTYPES or values.ndim != 2:
            raise ValueError("bad dtype or rank")
        return fmt.decompress(values, meta, k_attr)

    try:
        want = reference()
    except ValueError:
        raises_clearly(
            lambda: ops.sparse24_decompress(tf.constant(values), tf.constant(meta), k_attr)
        )
        return
    got = ops.sparse24_decompress(values, meta, k_attr).numpy()
    np.testing.assert_array_equal(bits(got), bits(want))


@prop
@SETTINGS
@given(
    sparse_matrices(valid=True, max_k=64, max_n=6),
    st.lists(st.integers(0, 3), max_size=2),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def matmul_matches_float64_and_propagates_specials(w, batch, specials, salt):
    w = np.where(np.isfinite(w.astype(np.float32)), w, np.zeros((), w.dtype)).astype(w.dtype)
    k, n = w.shape
    rng = np.random.default_rng(salt)
    x = rng.standard_normal((*batch, k)).astype(w.dtype)
    if specials and x.size:
        x.flat[rng.integers(x.size)] = rng.choice(SPECIALS[:3])
    values, meta = fmt.compress(w)
    y = ops.sparse24_matmul(x, values, meta).numpy()
    assert y.shape == (*batch, n) and y.dtype == w.dtype, (y.shape, y.dtype)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    with np.errstate(invalid="ignore"):
        terms = np.where(w64 != 0, x64[..., :, None] * w64, 0.0)  # [..., K, N]; zeros skipped
    want = terms.sum(axis=-2)
    y64 = y.astype(np.float64)
    special_out = ~np.isfinite(want)
    assert np.array_equal(np.isnan(y64[np.isnan(want)]), np.ones(np.isnan(want).sum(), bool)), (
        "NaN lost"
    )
    assert not np.isfinite(y64[special_out]).any(), "Inf/NaN input gave a finite output"
    row_finite = np.isfinite(x64).all(axis=-1)[..., None] & ~special_out
    tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}[w.dtype.name]
    scale = np.abs(terms).sum(axis=-2) + 1.0
    # Where x has an Inf that meets only pruned zeros, a dense matmul gives NaN (Inf * 0) and a
    # kernel that skips zeros gives the finite sum: both are fine; a finite answer must be right.
    check = row_finite | (np.isfinite(y64) & ~special_out)
    with np.errstate(invalid="ignore"):
        assert (np.abs(y64 - want)[check] <= tol * scale[check]).all(), "wrong matmul result"


@prop
@SETTINGS
@given(
    sparse_matrices(valid=True, max_k=16, max_n=4),
    st.sampled_from(["x_last_dim", "x_rank0", "x_dtype", "meta_mismatch", "values_dtype"]),
)
def matmul_rejects_inconsistent_inputs(w, bad):
    k, n = w.shape
    values, meta = fmt.compress(w)
    x = np.ones((2, k), w.dtype)
    if bad == "x_last_dim":
        x = np.ones((2, k + 4 if k else 4), w.dtype)
    elif bad == "x_rank0":
        x = np.array(1, w.dtype)
    elif bad == "x_dtype":
        x = x.astype(np.float64)
    elif bad == "meta_mismatch":
        meta = np.zeros((n + 1, meta.shape[1]), np.uint8)
    elif bad == "values_dtype":
        values = values.astype(np.float32 if w.dtype != np.float32 else np.float16)
    raises_clearly(
        lambda: ops.sparse24_matmul(tf.constant(x), tf.constant(values), tf.constant(meta))
    )


@prop
@SETTINGS
@given(st.integers(1, 4), st.integers(-5, 4), st.booleans(), st.integers(0, 2**31 - 1))
def high_level_compress_any_rank(rank, axis, sparse, salt):
    rng = np.random.default_rng(salt)
    shape = [int(rng.choice([1, 2, 4, 8])) for _ in range(rank)]
    w = rng.standard_normal(shape).astype(np.float32)
    if not -rank <= axis < rank or shape[axis] % 4:
        raises_clearly(lambda: ops.compress(w, axis=axis))
        return
    if sparse:
        moved = np.moveaxis(w, axis, -1).copy()
        groups = moved.reshape(-1, 4)
        for g in groups:
            g[rng.permutation(4)[:2]] = 0.0
        w = np.moveaxis(groups.reshape(moved.shape), -1, axis)
    if not is_2to4(fmt.to_2d(w, axis % rank)):
        raises_clearly(lambda: ops.compress(w, axis=axis), must_mention="group")
        return
    cw = ops.compress(w, axis=axis)
    np.testing.assert_array_equal(ops.decompress(cw).numpy(), w)
    contracted = shape[: axis % rank + 1]
    x = rng.standard_normal((3, *contracted)).astype(np.float32)
    want = np.tensordot(x.astype(np.float64), w.astype(np.float64), axes=len(contracted))
    np.testing.assert_allclose(ops.sparse_matmul(x, cw).numpy(), want, rtol=1e-4, atol=1e-4)


@prop
@settings(SETTINGS, max_examples=max(EXAMPLES // 10, 2))
@given(st.sampled_from(sorted(DTYPES)), st.integers(0, 2**31 - 1))
def huge_and_empty_shapes(dtype, salt):
    rng = np.random.default_rng(salt)
    k, n = 1 << 16, 3  # a long reduction: 64 Ki rows, 8 Ki meta bytes per column
    w = rng.standard_normal((k, n)).astype(np.float32)
    w.reshape(k // 4, 4, n)[:, rng.permutation(4)[:2], :] = 0.0
    w = w.astype(DTYPES[dtype])
    values, meta = (t.numpy() for t in ops.sparse24_compress(w))
    np.testing.assert_array_equal(meta, fmt.compress(w)[1])
    x = rng.standard_normal((2, k)).astype(w.dtype)
    want = x.astype(np.float64) @ w.astype(np.float64)
    tol = {"float32": 1e-3, "float16": 0.5, "bfloat16": 2.0}[dtype]  # |terms| ~ sqrt(K/2) ~ 180
    np.testing.assert_allclose(
        ops.sparse24_matmul(x, values, meta).numpy().astype(np.float64), want, atol=tol, rtol=0
    )
    empty = ops.sparse24_matmul(np.zeros((0, 5, k), w.dtype), values, meta)
    assert tuple(empty.shape) == (0, 5, n), empty.shape
    raises_clearly(lambda: ops.sparse24_decompress(tf.constant(values), tf.constant(meta), 1 << 40))


def main(names: list[str]) -> int:
    failed = []
    for name in names or list(PROPERTIES):
        print(f"[op-fuzz] {name}: running", flush=True)
        try:
            PROPERTIES[name]()
        except Exception:  # noqa: BLE001 - report every property, then fail
            traceback.print_exc()
            failed.append(name)
            print(f"[op-fuzz] {name}: FAILED", flush=True)
        else:
            print(f"[op-fuzz] {name}: ok", flush=True)
    print(
        f"[op-fuzz] failed: {failed}" if failed else "[op-fuzz] all properties passed", flush=True
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
