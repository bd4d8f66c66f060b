"""The sparse24 TF ops against the numpy reference (format.py), float64 numpy and dense TF."""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_sparse24 import format as fmt
from tf_sparse24 import ops

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Tolerance relative to sum_k |x[m, k] * W[k, n]|: the dtype's output rounding + fp32 accumulation.
RTOL = {"float32": 2e-6, "float16": 1.5e-3, "bfloat16": 1.2e-2}
ISAS = list(ops.CPU_ISAS[1:])


def random_24(rng, k, n, dtype, specials=False):
    """Random 2:4 [K, N] matrix: groups with 0, 1 and 2 non-zeros, optionally NaN/inf/-0.0.

    The count is drawn per group: drawn once per matrix (as it was), a third of all matrices
    were all zeros, and the tests that used them compared 0 with 0.
    """
    w = rng.standard_normal((k, n)).astype(np.float32)
    rank = rng.random((n, k // 4, 4)).argsort(axis=-1)  # a random permutation of 0..3 per group
    mask = rank < rng.integers(0, 3, size=(n, k // 4, 1))  # that many random positions kept
    mask &= rng.random(mask.shape) < 0.9  # some groups with fewer non-zeros
    w *= mask.reshape(n, k).T
    if specials and w.size:
        flat = w.reshape(-1)
        nonzero = np.flatnonzero(flat)
        for value in (np.nan, np.inf, -np.inf)[: len(nonzero)]:
            flat[nonzero[rng.integers(len(nonzero))]] = value
        flat[np.flatnonzero(flat == 0)[:1]] = -0.0
    return w.astype(dtype)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def tf_dtype(name):
    return tf.as_dtype(name)


@pytest.fixture
def isa(request, monkeypatch):
    """Forces the CPU kernel variant for the test (or checks the error where the CPU lacks it)."""
    monkeypatch.setenv(ops.ISA_ENV_VAR, request.param)
    return request.param


# --------------------------------------------------------------------------------------------------
# Compress / decompress: bit for bit against format.py


@settings(max_examples=25, deadline=None)
@given(
    groups=st.integers(0, 11),
    n=st.integers(0, 9),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**32 - 1),
)
def test_compress_decompress_bit_exact(groups, n, dtype, seed):
    rng = np.random.default_rng(seed)
    k = 4 * groups
    w = random_24(rng, k, n, DTYPES[dtype], specials=True)
    values, meta = ops.sparse24_compress(tf.constant(w))
    ref_values, ref_meta = fmt.compress(w)
    assert values.dtype == tf_dtype(dtype) and meta.dtype == tf.uint8
    np.testing.assert_array_equal(bits(values.numpy()), bits(ref_values))
    np.testing.assert_array_equal(meta.numpy(), ref_meta)
    dense = ops.sparse24_decompress(values, meta, k)
    np.testing.assert_array_equal(
        bits(dense.numpy()), bits(fmt.decompress(ref_values, ref_meta, k))
    )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_large_and_odd_shapes(dtype):
    rng = np.random.default_rng(1)
    for k, n in [(1028, 300), (4, 1), (12, 1), (2048, 64)]:  # K % 8 == 4, N == 1, large
        w = random_24(rng, k, n, DTYPES[dtype])
        values, meta = ops.sparse24_compress(tf.constant(w))
        ref_values, ref_meta = fmt.compress(w)
        np.testing.assert_array_equal(bits(values.numpy()), bits(ref_values))
        np.testing.assert_array_equal(meta.numpy(), ref_meta)
        # w + 0 turns the -0.0 of masked negatives into the +0.0 that decompress writes.
        np.testing.assert_array_equal(
            bits(ops.sparse24_decompress(values, meta, k).numpy()), bits(w + 0)
        )


def test_high_level_compress_any_rank():
    rng = np.random.default_rng(2)
    shape, axis = (3, 3, 8, 6), 2  # Conv2D kernel: K = 3*3*8 with the in-channel fastest
    w = fmt.from_2d(random_24(rng, 72, 6, np.float32), shape)
    cw = ops.compress(w, axis=axis)
    assert (cw.k, cw.n, cw.axis, cw.shape, cw.dtype) == (
        72,
        6,
        2,
        tf.TensorShape(shape),
        tf.float32,
    )
    ref_values, ref_meta = fmt.compress(fmt.to_2d(w, axis))
    np.testing.assert_array_equal(cw.values.numpy(), ref_values)
    np.testing.assert_array_equal(cw.meta.numpy(), ref_meta)
    np.testing.assert_array_equal(ops.decompress(cw).numpy(), w)
    x = rng.standard_normal((5, 3, 3, 8)).astype(np.float32)
    y = ops.sparse_matmul(x, cw)
    np.testing.assert_allclose(
        y.numpy(), np.tensordot(x.astype(np.float64), w, 3), rtol=1e-5, atol=1e-5
    )
    # No input channels (K = 0): still N = 4 columns, not the spatial taps folded in.
    empty = ops.compress(np.zeros((3, 3, 0, 4), np.float32), axis=2)
    assert (empty.values.shape, empty.meta.shape) == ((4, 0), (4, 0))
    # MHA output projection [heads, dim, d], axis 1.
    w = fmt.from_2d(random_24(rng, 16, 5, np.float32), (2, 8, 5))
    x = rng.standard_normal((4, 7, 2, 8)).astype(np.float32)
    y = ops.sparse_matmul(x, ops.compress(w, axis=1))
    assert y.shape == (4, 7, 5)
    np.testing.assert_allclose(
        y.numpy(), np.tensordot(x.astype(np.float64), w, 2), rtol=1e-5, atol=1e-5
    )
    # EinsumDense [d, heads, dim], axis 0: output keeps the kernel's trailing dims.
    w = random_24(rng, 8, 6, np.float32).reshape(8, 2, 3)
    y = ops.sparse_matmul(rng.standard_normal((4, 8)).astype(np.float32), ops.compress(w))
    assert y.shape == (4, 2, 3)


# --------------------------------------------------------------------------------------------------
# MatMul against numpy float64, on every SIMD path


def check_matmul(dtype, batch, k, n, rng):
    w = random_24(rng, k, n, DTYPES[dtype])
    x = rng.standard_normal(batch + (k,)).astype(DTYPES[dtype])
    values, meta = fmt.compress(w)
    y = ops.sparse24_matmul(tf.constant(x), tf.constant(values), tf.constant(meta))
    assert y.dtype == tf_dtype(dtype) and y.shape == batch + (n,)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    scale = np.abs(x64) @ np.abs(w64)
    err = np.abs(y.numpy().astype(np.float64) - ref)
    atol = 2.0**-24 if dtype == "float16" else 1e-30  # float16 subnormal spacing
    assert np.all(err <= RTOL[dtype] * scale + atol), (dtype, batch, k, n, float(err.max()))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_matmul_matches_float64(isa, dtype):
    if isa not in ops.supported_cpu_isas():
        with pytest.raises(
            tf.errors.InvalidArgumentError, match=f"{isa} asks for a kernel variant"
        ):
            check_matmul(dtype, (2,), 8, 3, np.random.default_rng(0))
        return
    rng = np.random.default_rng(3)
    # M = 1..4 run the GEMV kernels, larger M the panel kernels; odd N and K % 8 == 4 hit the tails.
    for batch, k, n in [
        ((1,), 4, 1),
        ((3,), 12, 5),
        ((2, 2), 64, 17),
        ((37,), 260, 33),
        ((2, 35), 128, 67),
        ((1,), 1024, 40),
        ((0,), 8, 3),
        ((4, 0, 2), 8, 3),
        ((2,), 0, 3),
        ((3,), 8, 0),
    ]:
        check_matmul(dtype, batch, k, n, rng)


@settings(max_examples=20, deadline=None)
@given(
    batch=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    groups=st.integers(1, 40),
    n=st.integers(1, 40),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_random_shapes_auto_isa(batch, groups, n, dtype, seed):
    check_matmul(dtype, batch, 4 * groups, n, np.random.default_rng(seed))


def test_concurrent_calls_from_many_threads_give_the_serial_results():
    # TF Serving runs requests side by side: calls from several threads share the intra-op pool
    # and each caller's retained pack buffer (spmm.cc, PackMemory), here with shapes that grow and
    # shrink it and switch between the GEMV (M <= 4) and panel kernels, in every dtype.
    rng = np.random.default_rng(11)
    cases = []
    # Calls of ~5-20 ms, so that they overlap.
    for i, (m, k, n) in enumerate([(1, 4096, 1024), (3, 2048, 512), (256, 2048, 256),
                                   (400, 1024, 300), (4, 4096, 256), (193, 4096, 130)]):
        dtype = sorted(DTYPES)[i % 3]
        w = random_24(rng, k, n, DTYPES[dtype])
        x = rng.standard_normal((m, k)).astype(DTYPES[dtype])
        values, meta = fmt.compress(w)
        serial = ops.sparse24_matmul(x, values, meta).numpy()
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        assert np.all(np.abs(serial.astype(np.float64) - x64 @ w64)
                      <= RTOL[dtype] * (np.abs(x64) @ np.abs(w64)) + 2.0**-24), (dtype, m, k, n)
        cases.append((x, values, meta, serial))

    def run(i):
        x, values, meta, _ = cases[i % len(cases)]
        return i % len(cases), ops.sparse24_matmul(x, values, meta).numpy()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(12 * len(cases))))
    for i, y in results:
        np.testing.assert_array_equal(bits(y), bits(cases[i][3]))


@pytest.mark.parametrize("isa", ["scalar", "avx2"], indirect=True)
def test_nan_inf_propagate_like_dense(isa):
    if isa not in ops.supported_cpu_isas():
        pytest.skip(f"{isa} checked by test_matmul_matches_float64")
    rng = np.random.default_rng(4)
    k, n = 16, 6
    w = random_24(rng, k, n, np.float32)
    w[fmt.kept_positions(w)[2, 1, 0] + 4, 2] = np.nan  # a NaN weight at a kept position
    for m in (1, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, 6] = np.inf
        x[m - 1, 13] = -np.inf
        x[m // 2, 1] = np.nan
        values, meta = fmt.compress(w)
        y = ops.sparse24_matmul(x, values, meta).numpy()
        dense = tf.matmul(x, w).numpy()  # stock TF: 0 * inf = NaN, NaN spreads
        np.testing.assert_array_equal(np.isnan(y), np.isnan(dense))
        np.testing.assert_array_equal(np.isinf(y), np.isinf(dense))
        np.testing.assert_allclose(np.nan_to_num(y), np.nan_to_num(dense), rtol=1e-5, atol=1e-5)
        assert np.isnan(y).any() and (m == 1 or not np.isnan(y).all())


def test_forcing_isa(monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV_VAR, "auto")  # restored after the test, whatever set_cpu_isa did
    supported = ops.supported_cpu_isas()
    assert "scalar" in supported
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        ops.set_cpu_isa("sse9")
    monkeypatch.setenv(ops.ISA_ENV_VAR, "sse9")
    with pytest.raises(tf.errors.InvalidArgumentError, match="'sse9' is not a CPU kernel variant"):
        ops.sparse24_matmul(np.ones((1, 4), np.float32), np.ones((1, 2), np.float32), [[4]])
    for name in ISAS:
        if name in supported:
            ops.set_cpu_isa(name)
            assert ops.cpu_isa() == name
        else:
            with pytest.raises(ValueError, match=f"cannot run the '{name}'"):
                ops.set_cpu_isa(name)
    ops.set_cpu_isa("auto")
    assert ops.cpu_isa() == supported[-1]


# --------------------------------------------------------------------------------------------------
# Gradients against tf.GradientTape on the dense equivalent


@pytest.mark.parametrize("batch", [(6,), (2, 3)])
def test_gradients_match_dense(batch):
    rng = np.random.default_rng(5)
    k, n = 20, 7
    w = random_24(rng, k, n, np.float32)
    x = tf.constant(rng.standard_normal(batch + (k,)).astype(np.float32))
    r = tf.constant(rng.standard_normal(batch + (n,)).astype(np.float32))
    values, meta = (tf.constant(a) for a in fmt.compress(w))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, values])
        cw = ops.CompressedWeight(values=values, meta=meta, shape=w.shape, dtype=tf.float32)
        loss = tf.reduce_sum(ops.sparse_matmul(x, cw) * r)
        w_dense = ops.decompress(cw)  # through Sparse24Decompress's gradient
        loss_via_dense = tf.reduce_sum(tf.matmul(x, w_dense) * r)
    dx, dvalues = tape.gradient(loss, [x, values])
    dx2, dvalues2 = tape.gradient(loss_via_dense, [x, values])

    wt = tf.constant(w)
    with tf.GradientTape() as dense_tape:
        dense_tape.watch([x, wt])
        dense_loss = tf.reduce_sum(tf.matmul(x, wt) * r)
    dx_ref, dw_ref = dense_tape.gradient(dense_loss, [x, wt])
    rows = fmt.unpack_meta(meta.numpy(), k)  # [N, K/4, 2] positions
    kept = (rows + 4 * np.arange(k // 4)[:, None]).reshape(n, k // 2)
    dvalues_ref = np.take_along_axis(dw_ref.numpy().T, kept, axis=1)
    for got in (dx, dx2):
        np.testing.assert_allclose(got.numpy(), dx_ref.numpy(), rtol=1e-5, atol=1e-5)
    for got in (dvalues, dvalues2):
        np.testing.assert_allclose(got.numpy(), dvalues_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n", [(0, 0, 4), (0, 8, 0), (3, 0, 4), (3, 8, 0), (0, 8, 4)])
def test_gradients_of_empty_shapes_are_empty_zeros(m, k, n):
    # reshape(t, [-1, n]) of an empty t gives one row, not zero: the gradient must not use it.
    x = tf.constant(np.ones((m, k), np.float32))
    values = tf.constant(np.ones((n, k // 2), np.float32))
    meta = tf.constant(np.full((n, (k + 7) // 8), 0x44, np.uint8))
    with tf.GradientTape() as tape:
        tape.watch([x, values])
        y = ops.sparse24_matmul(x, values, meta)
    dx, dvalues = tape.gradient(y, [x, values])
    np.testing.assert_array_equal(dx.numpy(), np.zeros((m, k), np.float32))
    np.testing.assert_array_equal(dvalues.numpy(), np.zeros((n, k // 2), np.float32))


def test_gradient_takes_k_from_x_when_values_shape_is_unknown():
    """In a tf.function whose values/meta have unknown shapes, K comes from x's static shape."""
    rng = np.random.default_rng(8)
    k, n = 16, 5
    w = random_24(rng, k, n, np.float32)
    values, meta = (tf.constant(a) for a in fmt.compress(w))
    x = tf.constant(rng.standard_normal((3, k)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, k]), tf.TensorSpec([None, None]),
                                  tf.TensorSpec([None, None], tf.uint8)])  # fmt: skip
    def grads(x, values, meta):
        with tf.GradientTape() as tape:
            tape.watch([x, values])
            loss = tf.reduce_sum(ops.sparse24_matmul(x, values, meta))
        return tape.gradient(loss, [x, values])

    dx, dvalues = grads(x, values, meta)
    np.testing.assert_allclose(dx.numpy(), np.ones((3, n)) @ w.T, rtol=1e-5, atol=1e-6)
    kept = fmt.unpack_meta(meta.numpy(), k) + 4 * np.arange(k // 4)[:, None]
    want = np.take_along_axis((x.numpy().T @ np.ones((3, n))).T, kept.reshape(n, k // 2), axis=1)
    np.testing.assert_allclose(dvalues.numpy(), want, rtol=1e-5, atol=1e-5)


def test_gradient_takes_k_from_values_when_x_has_no_static_k():
    """x's last dimension unknown in a tf.function: K = 2 * values' static [N, K/2] width."""
    rng = np.random.default_rng(11)
    k, n = 16, 5
    w = random_24(rng, k, n, np.float32)
    values, meta = (tf.constant(a) for a in fmt.compress(w))
    x = rng.standard_normal((3, k)).astype(np.float32)
    dy = rng.standard_normal((3, n)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None]), tf.TensorSpec([n, k // 2]),
                                  tf.TensorSpec([n, k // 8], tf.uint8)])  # fmt: skip
    def grads(x, values, meta):
        with tf.GradientTape() as tape:
            tape.watch([x, values])
            loss = tf.reduce_sum(ops.sparse24_matmul(x, values, meta) * dy)
        return tape.gradient(loss, [x, values])

    dx, dvalues = grads(tf.constant(x), values, meta)
    w64, x64, dy64 = (a.astype(np.float64) for a in (w, x, dy))
    np.testing.assert_allclose(dx.numpy(), dy64 @ w64.T, rtol=1e-5, atol=1e-5)
    kept = fmt.unpack_meta(meta.numpy(), k) + 4 * np.arange(k // 4)[:, None]
    want = np.take_along_axis((x64.T @ dy64).T, kept.reshape(n, k // 2), axis=1)
    np.testing.assert_allclose(dvalues.numpy(), want, rtol=1e-5, atol=1e-5)


def test_compress_takes_a_negative_axis_and_compressed_weight_refuses_an_axis_out_of_range():
    rng = np.random.default_rng(12)
    w = fmt.from_2d(random_24(rng, 24, 4, np.float32), (3, 8, 4))  # Conv1D [taps, in, out]
    for axis in (1, -2):
        cw = ops.compress(w, axis=axis)
        assert (cw.axis, cw.k, cw.n) == (1, 24, 4)
        ref_values, ref_meta = fmt.compress(fmt.to_2d(w, 1))
        np.testing.assert_array_equal(cw.values.numpy(), ref_values)
        np.testing.assert_array_equal(cw.meta.numpy(), ref_meta)
    with pytest.raises(ValueError, match="out of range"):
        ops.compress(w, axis=3)
    values, meta = (tf.constant(a) for a in fmt.compress(np.zeros((16, 3), np.float32)))
    for axis in (2, -1):
        with pytest.raises(ValueError, match=rf"axis {axis} is out of range for kernel shape"):
            ops.CompressedWeight(values=values, meta=meta, shape=[16, 3], dtype=tf.float32,
                                 axis=axis)


def test_sparse_matmul_with_a_1d_kernel_contracts_it_away_and_meta_must_be_uint8():
    """Grouped along its last axis, a kernel has N = 1 and no output dims: tensordot gives [...]."""
    rng = np.random.default_rng(13)
    w = random_24(rng, 12, 1, np.float32)[:, 0]
    assert np.count_nonzero(w)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    cw = ops.compress(w)
    assert (cw.k, cw.n) == (12, 1)
    y = ops.sparse_matmul(x, cw)
    assert y.shape == (3,)
    np.testing.assert_allclose(y.numpy(), np.tensordot(x.astype(np.float64), w, 1), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="values of dtype float32 and uint8 meta. Received: "
                                         "values float32, meta int32"):
        ops.CompressedWeight(values=cw.values, meta=tf.cast(cw.meta, tf.int32), shape=[12],
                             dtype=tf.float32)


def test_compress_gradient_scatters_back():
    rng = np.random.default_rng(6)
    w = tf.constant(random_24(rng, 8, 3, np.float32))
    c = rng.standard_normal((3, 4)).astype(np.float32)
    with tf.GradientTape() as tape:
        tape.watch(w)
        values, _ = ops.sparse24_compress(w)
        loss = tf.reduce_sum(values * c)
    _, ref_meta = fmt.compress(w.numpy())
    np.testing.assert_array_equal(tape.gradient(loss, w).numpy(), fmt.decompress(c, ref_meta, 8))


# --------------------------------------------------------------------------------------------------
# tf.function, shape functions, SavedModel


def test_tf_function_shapes_and_saved_model(tmp_path):
    rng = np.random.default_rng(7)
    w = random_24(rng, 16, 5, np.float32)
    cw = ops.compress(w)
    spec = ops.CompressedWeight.Spec(
        values=tf.TensorSpec([5, 8]),
        meta=tf.TensorSpec([5, 2], tf.uint8),
        shape=tf.TensorShape([16, 5]),
        dtype=tf.float32,
        axis=0,
    )

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.cw = cw

        @tf.function(input_signature=[tf.TensorSpec([None, None, 16])])
        def __call__(self, x):
            return ops.sparse_matmul(x, self.cw)

        @tf.function(input_signature=[spec, tf.TensorSpec([None, 16])])
        def apply(self, weight, x):
            return ops.sparse_matmul(x, weight)

    module = Module()
    assert module.__call__.get_concrete_function().structured_outputs.shape.as_list() == [
        None,
        None,
        5,
    ]
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    expected = module(x).numpy()
    assert np.count_nonzero(w) and np.count_nonzero(expected)
    np.testing.assert_allclose(expected, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    tf.saved_model.save(module, str(tmp_path / "m"))
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    np.testing.assert_array_equal(loaded(x).numpy(), expected)
    # 3 rows instead of 6 may take another kernel (another summation order): not bit for bit.
    np.testing.assert_allclose(loaded.apply(cw, x[0]).numpy(), x[0].astype(np.float64) @ w,
                               rtol=1e-5, atol=1e-5)

    @tf.function
    def f(x, values, meta):
        return ops.sparse24_matmul(x, values, meta)

    out = f.get_concrete_function(
        tf.TensorSpec([None, 7, 12]), tf.TensorSpec([None, 6]), tf.TensorSpec([None, 2], tf.uint8)
    ).structured_outputs
    assert out.shape.as_list() == [None, 7, None]
    with pytest.raises(ValueError, match="Dimension must be 6 but is 7"):
        f.get_concrete_function(
            tf.TensorSpec([2, 12]), tf.TensorSpec([5, 7]), tf.TensorSpec([5, 2], tf.uint8)
        )
    with pytest.raises(ValueError, match="multiple of 4"):
        f.get_concrete_function(
            tf.TensorSpec([2, 10]), tf.TensorSpec([5, 5]), tf.TensorSpec([5, 2], tf.uint8)
        )


# --------------------------------------------------------------------------------------------------
# Bad input


def test_compress_rejects_non_24_naming_row_column_group():
    w = np.zeros((16, 5), np.float32)
    w[8:11, 3] = 1.0
    w[12:16, 1] = 1.0  # later in memory order
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"group g=2 \(rows k=8..11\) of column n=3 has 3 non-zeros at rows k=\[8, 9, 10\]",
    ):
        ops.sparse24_compress(w)
    with pytest.raises(tf.errors.InvalidArgumentError, match="of column n=3"):
        ops.compress(w.reshape(4, 4, 5), axis=1)
    with pytest.raises(
        ValueError, match=r"multiple of 4. Received: kernel shape \(2, 2, 5\), axis=1"
    ):
        ops.compress(np.zeros((2, 2, 5), np.float32), axis=1)
    for axis in (True, 1.0, "1", None):  # True would compress along axis 1
        with pytest.raises(TypeError, match=re.escape(f"integer axis. Received: axis={axis!r}")):
            ops.compress(np.zeros((4, 4), np.float32), axis=axis)
    assert ops.compress(np.zeros((4, 4), np.float32), axis=np.int64(-1)).axis == 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of 4"):
        ops.sparse24_compress(np.zeros((6, 3), np.float32))


def test_bad_shapes_and_dtypes():
    values, meta = (tf.constant(a) for a in fmt.compress(np.zeros((16, 3), np.float32)))
    x = tf.ones((2, 16))
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"values must be \[N, 8\] and meta \[N, 2\]"
    ):
        ops.sparse24_matmul(x, tf.ones((3, 10)), meta)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"same N, got values \[3,8\] and meta \[4,2\]"
    ):
        ops.sparse24_matmul(x, values, tf.zeros((4, 2), tf.uint8) + 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="K=6"):
        ops.sparse24_matmul(tf.ones((2, 6)), tf.ones((3, 3)), tf.zeros((3, 1), tf.uint8))
    # x of the wrong size for weights that agree with each other: x is named, not the weights.
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(
            "x [2,12] has K=12 in its last dimension, but the weight (values [3,8]) is stored for "
            "K=16: x must be [..., 16]")):
        ops.sparse24_matmul(tf.ones((2, 12)), values, meta)
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of 4, got K=6"):
        ops.sparse24_decompress(tf.ones((3, 3)), tf.zeros((3, 1), tf.uint8), 6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"for K=20 values must be \[N, 10\]"):
        ops.sparse24_decompress(values, meta, 20)
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match="int32"):
        ops.sparse24_compress(tf.zeros((4, 4), tf.int32))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match="uint8"):
        ops.sparse24_matmul(x, values, tf.cast(meta, tf.int32))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match="half|float16"):
        ops.sparse24_matmul(x, tf.cast(values, tf.float16), meta)
    with pytest.raises(ValueError, match="values of dtype float32 and uint8 meta"):
        ops.CompressedWeight(
            values=tf.cast(values, tf.float16), meta=meta, shape=[16, 3], dtype=tf.float32
        )
    with pytest.raises(TypeError, match=r"k must be an integer. Received: k=16\.0"):
        ops.sparse24_decompress(values, meta, 16.0)  # was int(16.7) -> 16, silently
    assert ops.sparse24_decompress(values, meta, np.int64(16)).shape == (16, 3)
    cw32 = ops.CompressedWeight(values=values, meta=meta, shape=[16, 3], dtype=tf.float32)
    with pytest.raises(TypeError, match=re.escape(
            "sparse_matmul: x is bfloat16 but the compressed kernel is float32; cast one")):
        ops.sparse_matmul(tf.ones((2, 16), tf.bfloat16), cw32)
    with pytest.raises(TypeError, match="x is float64"):
        ops.sparse_matmul(tf.Variable(tf.ones((2, 16), tf.float64)), cw32)
    # numpy and Python values are converted to the kernel's dtype, as TensorFlow's ops do
    assert ops.sparse_matmul(np.ones((2, 16)), cw32).dtype == tf.float32
    with pytest.raises(ValueError, match="must end with the kernel's contracted dims"):
        ops.sparse_matmul(
            tf.ones((2, 8)),
            ops.CompressedWeight(values=values, meta=meta, shape=[16, 3], dtype=tf.float32),
        )
    # K = 2 * 8 = 16 fits values and meta, but the grouping axis has 2 elements: groups of the
    # [K, N] view would straddle it (and [6, 8] is not even a K % 4 == 0 kernel).
    for shape, axis, size in [([8, 2, 3], 1, 2), ([6, 3], 0, 6)]:
        message = f"multiple of 4. Received: kernel shape {tuple(shape)}, axis={axis} (size {size})"
        with pytest.raises(ValueError, match=re.escape(message)):
            ops.CompressedWeight(values=values, meta=meta, shape=shape, dtype=tf.float32, axis=axis)
    # values / meta that do not fit the kernel shape: the message names which one, the shape it
    # must have and the kernel's (format.py's [N, K/2] and [N, ceil(K/8)]), not just two shapes.
    want_values, want_meta = (a.shape for a in fmt.compress(np.zeros((12, 4), np.float32)))
    for name, bad, want in [("values", {"values": tf.ones((4, 8))}, want_values),
                            ("values", {"values": tf.ones((3, 6))}, want_values),
                            ("meta", {"meta": tf.zeros((4, 1), tf.uint8)}, want_meta)]:
        parts = {"values": tf.ones(want_values), "meta": tf.zeros(want_meta, tf.uint8), **bad}
        got = list(parts[name].shape)
        message = (f"CompressedWeight: {name} must be {list(want)} for kernel shape (12, 4), "
                   f"axis=0 (K=12, N=4). Received: {name} shape {got}")
        with pytest.raises(ValueError, match=re.escape(message)):
            ops.CompressedWeight(shape=[12, 4], dtype=tf.float32, **parts)


@pytest.mark.parametrize("m", [2, 64, 200])  # GEMV kernel, one panel, several row blocks
def test_matmul_names_the_first_bad_meta_row_whichever_work_unit_meets_it(m):
    # Each work unit checks its own columns' meta; the message must still name the first bad row.
    rng = np.random.default_rng(9)
    k, n = 64, 600
    values, meta = fmt.compress(random_24(rng, k, n, np.float32))
    x = tf.constant(rng.standard_normal((m, k)).astype(np.float32))
    bad = meta.copy()
    bad[517, 3] = 0x4B  # high nibble fine, low nibble (3, 2)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=re.escape("row n=517, group g=6 has positions (3, 2)")
    ):
        ops.sparse24_matmul(x, values, tf.constant(bad))
    bad[20, 0] = 0x81  # now also an earlier row: low nibble (1, 0)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=re.escape("row n=20, group g=0 has positions (1, 0)")
    ):
        ops.sparse24_matmul(x, values, tf.constant(bad))


def run_child(code):
    """Runs `code` in a fresh Python with `ops` and `tf` imported and returns its stdout: an abort
    in a kernel (a TensorShape CHECK) fails the test instead of killing pytest."""
    result = subprocess.run(
        [sys.executable, "-c", "import tensorflow as tf\nfrom tf_sparse24 import ops\n" + code],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, f"child exited with {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


# The largest K an int64 holds that is a multiple of 4. An empty weight [K, 0] stored for it is
# values [0, 2^62 - 2] and meta [0, 2^60]; ceil(K/8) computed as (K + 7) / 8 overflows there.
BIG_K = 2**63 - 4


def test_largest_k_of_an_empty_weight_is_no_overflow():
    # Compress used to abort (a negative meta width in TensorShape), so it runs in a child.
    out = run_child(
        "big = 2**63 - 4\n"
        "v, m = ops.sparse24_compress(tf.zeros([big, 0]))\n"
        "print(v.shape.as_list(), m.shape.as_list())\n"
        "graph = tf.function(ops.sparse24_compress).get_concrete_function(\n"
        "    tf.TensorSpec([big, 0], tf.float32))\n"
        "print([s.as_list() for s in graph.output_shapes])\n"
    )
    assert out.splitlines() == [
        f"[0, {2**62 - 2}] [0, {2**60}]", f"[[0, {2**62 - 2}], [0, {2**60}]]"
    ]
    # Decompress and MatMul rejected the right meta width (naming a negative one as expected).
    values, meta = tf.zeros([0, 2**62 - 2]), tf.zeros([0, 2**60], tf.uint8)
    assert ops.sparse24_decompress(values, meta, BIG_K).shape == (BIG_K, 0)
    assert ops.sparse24_matmul(tf.zeros([0, BIG_K]), values, meta).shape == (0, 0)
    graph = tf.function(lambda v, m: ops.sparse24_decompress(v, m, BIG_K)).get_concrete_function(
        tf.TensorSpec(values.shape, tf.float32), tf.TensorSpec(meta.shape, tf.uint8)
    )
    assert graph.output_shapes.as_list() == [BIG_K, 0]
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"meta \[N, {2**60}\]"):
        ops.sparse24_decompress(values, tf.zeros([0, 2**60 - 1], tf.uint8), BIG_K)
    # A values width whose K (twice it) is past int64 is refused as not matching x, not wrapped.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"for K=8 values must be \[N, 4\]"):
        ops.sparse24_matmul(tf.zeros([0, 8]), tf.zeros([0, 2**62 + 2]), tf.zeros([0, 1], tf.uint8))


def test_matmul_output_past_int64_is_an_error_not_an_abort():
    # With K = 0, x [2^40, 0] is empty, but y [2^40, 2^30] has 2^70 elements: this aborted the
    # process in TensorShape::set_dim, so it runs in a child.
    out = run_child(
        "try:\n"
        "    ops.sparse24_matmul(tf.zeros([2**40, 0]), tf.zeros([2**30, 0]),\n"
        "                        tf.zeros([2**30, 0], tf.uint8))\n"
        "except tf.errors.InvalidArgumentError as e:\n"
        "    print(e.message)\n"
    )
    assert "Sparse24MatMul: the output [..., N] for x [1099511627776,0] and N=1073741824 would " \
           "have more elements than int64 holds" in out, out
    # Up to int64, the empty sum is zeros as before.
    y = ops.sparse24_matmul(tf.zeros([3, 0]), tf.zeros([5, 0]), tf.zeros([5, 0], tf.uint8))
    np.testing.assert_array_equal(y.numpy(), np.zeros((3, 5), np.float32))


def test_matmul_out_of_memory_is_resource_exhausted_not_a_crash():
    # The CPU kernel's float32 copy / packed panels of x (128-206 MiB here) come from new; under an
    # address-space limit 48 MiB above the process's current size, std::bad_alloc used to unwind
    # through TensorFlow and kill the process (SIGSEGV in pybind11). In a child, for that reason.
    out = run_child(
        "import resource\n"
        "m, k, n = 4096, 8192, 16\n"
        "x = tf.zeros([m, k], tf.bfloat16)\n"
        "values = tf.zeros([n, k // 2], tf.bfloat16)\n"
        "meta = tf.fill([n, k // 8], tf.constant(0x44, tf.uint8))\n"
        "for isa in ('scalar', 'auto'):\n"
        "    ops.set_cpu_isa(isa)\n"
        "    ops.sparse24_matmul(x[:8], values, meta)  # the pool's threads, the small buffers\n"
        "    status = open('/proc/self/status').read()\n"
        "    vm = int(status.split('VmSize:')[1].split()[0]) * 1024\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))\n"
        "    try:\n"
        "        ops.sparse24_matmul(x, values, meta)\n"
        "        print(isa, 'no error')\n"
        "    except tf.errors.ResourceExhaustedError as e:\n"
        "        print(isa, e.message)\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)\n"
        "    print(isa, ops.sparse24_matmul(x, values, meta).shape.as_list())\n"
    )
    for isa in ("scalar", "auto"):
        assert re.search(rf"^{isa} .*Sparse24MatMul: out of memory for the working copies of x "
                         r"\[4096,8192\] \(its float32 copy, packed panels or a kernel's "
                         r"reordered rows\)", out, re.M), out
        assert f"{isa} [4096, 16]" in out, out  # and the next call, with memory, runs


@pytest.mark.parametrize("op", ["matmul", "decompress"])
def test_bad_meta_is_rejected_naming_row_and_group(op):
    rng = np.random.default_rng(8)
    k, n = 28, 4  # K % 8 == 4: 4 meta bytes, the last with one group
    values, meta = fmt.compress(random_24(rng, k, n, np.float32))

    def run(meta):
        if op == "matmul":
            return ops.sparse24_matmul(tf.ones((3, k)), values, tf.constant(meta))
        return ops.sparse24_decompress(values, tf.constant(meta), k)

    for byte_index, byte, group, positions in [
        (1, 0x4A, 2, "(2, 2)"),
        (2, 0x74, 5, "(3, 1)"),
        (3, 0x05, 6, "(1, 1)"),
    ]:
        bad = meta.copy()
        bad[2, byte_index] = byte
        with pytest.raises(
            tf.errors.InvalidArgumentError,
            match=re.escape(f"row n=2, group g={group} has positions {positions}"),
        ):
            run(bad)
    bad = meta.copy()
    bad[1, 3] |= 0x40  # unused high nibble of the last byte
    with pytest.raises(tf.errors.InvalidArgumentError, match="row n=1, last byte .* high nibble"):
        run(bad)


def test_missing_or_foreign_library_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_library", None)
    monkeypatch.setattr(ops, "library_path", lambda: str(tmp_path / "_sparse24_ops.so"))
    with pytest.raises(
        ops.OpLibraryError,
        match=rf"expected {tmp_path}/_sparse24_ops.so for TensorFlow {tf.__version__}",
    ):
        ops.load_library()
    (tmp_path / "_sparse24_ops.so").write_bytes(b"not a shared library")
    with pytest.raises(
        ops.OpLibraryError,
        match=rf"could not load .*_sparse24_ops.so.* into TensorFlow {tf.__version__}",
    ):
        ops.load_library()
    assert ops._library is None


def test_library_without_the_ops_is_refused(monkeypatch, tmp_path):
    # What a build from a source tree without cc/ used to install: a library that loads but
    # registers nothing (the error only came with the first op call).
    empty = tmp_path / "_sparse24_ops.so"
    (tmp_path / "empty.cc").write_text("int tf_sparse24_nothing() { return 0; }\n")
    subprocess.run(["g++", "-shared", "-fPIC", str(tmp_path / "empty.cc"), "-o", str(empty)],
                   check=True)
    monkeypatch.setattr(ops, "_library", None)
    monkeypatch.setattr(ops, "library_path", lambda: str(empty))
    with pytest.raises(ops.OpLibraryError, match=r"does not define the ops \['sparse24_compress'"):
        ops.load_library()
    assert ops._library is None


def test_library_built_for_another_tf_is_refused(monkeypatch):
    monkeypatch.setattr(ops, "_library", None)
    monkeypatch.setattr(ops, "_built_tf_version", lambda path: "2.20.0")
    with pytest.raises(
        ops.OpLibraryError,
        match=rf"built for TensorFlow 2.20.0, but TensorFlow {tf.__version__} is running.*make ops",
    ):
        ops.load_library()


def test_library_records_its_tf_version():
    built = ops._built_tf_version(ops.library_path())
    assert built.split(".")[:2] == tf.__version__.split(".")[:2]
    assert ops.load_library() is ops.load_library()


def test_import_without_a_usable_library_says_why(tmp_path):
    """A package whose library is missing (or built for another TF) still imports, and says so."""
    package = tmp_path / "tf_sparse24"
    package.mkdir()
    for source in Path(ops.__file__).parent.glob("*.py"):  # the Python files, no library
        shutil.copy(source, package)
    result = subprocess.run(
        [sys.executable, "-c", "import tf_sparse24; print('imported', tf_sparse24.__file__)"],
        env={**os.environ, "PYTHONPATH": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3"},
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.stdout.strip() == f"imported {package / '__init__.py'}", result.stderr
    assert "UserWarning: tf_sparse24 op library not found" in result.stderr
    assert "portable exports work" in result.stderr
