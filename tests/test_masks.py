"""N:M masks against an independent numpy float64 reference."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_sparse24.masks import (
    MASK_METHODS,
    PAIRWISE_MAX_M,
    compute_mask,
    is_nm_sparse,
    parse_pattern,
    pattern_mismatch,
)


def reference_mask(w: np.ndarray, n: int, m: int, axis: int) -> np.ndarray:
    """Keep the n largest |w| of each group of m along axis; ties -> lower index (stable sort)."""
    moved = np.moveaxis(np.asarray(w, np.float64), axis, -1)
    groups = np.abs(moved.reshape(-1, m))
    order = np.argsort(-groups, axis=1, kind="stable")[:, :n]
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, order, True, axis=1)
    return np.moveaxis(keep.reshape(moved.shape), -1, axis)


@st.composite
def weights_and_pattern(draw, m_range=(2, 8)):
    m = draw(st.integers(*m_range))
    n = draw(st.integers(1, m - 1))
    rank = draw(st.integers(1, 4))
    axis = draw(st.integers(-rank, rank - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    shape[axis] = m * draw(st.integers(1, 3))
    # Few distinct values (some negative) so ties and equal magnitudes of opposite sign are common.
    values = draw(st.sampled_from([[-2.0, -1.0, 0.0, 1.0, 2.0], [0.5, -0.5], None]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if values is None:
        w = rng.normal(size=shape)
    else:
        w = rng.choice(values, size=shape)
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64]))
    return w.astype(dtype), n, m, axis


@settings(max_examples=25, deadline=None)
@given(weights_and_pattern())
def test_mask_matches_numpy_reference(case):
    w, n, m, axis = case
    mask = compute_mask(tf.constant(w), f"{n}:{m}", axis=axis).numpy()
    assert mask.dtype == w.dtype and mask.shape == w.shape
    np.testing.assert_array_equal(mask.astype(bool), reference_mask(w, n, m, axis))
    assert is_nm_sparse(w * mask, f"{n}:{m}", axis)


@settings(max_examples=15, deadline=None)
@given(weights_and_pattern(m_range=(PAIRWISE_MAX_M - 1, PAIRWISE_MAX_M + 20)))
def test_long_groups_ranked_by_a_sort_match_the_reference(case):
    """Either side of PAIRWISE_MAX_M: pairwise comparisons, then a stable sort; the same rule."""
    w, n, m, axis = case
    mask = compute_mask(tf.constant(w), f"{n}:{m}", axis=axis).numpy()
    np.testing.assert_array_equal(mask.astype(bool), reference_mask(w, n, m, axis))


@pytest.mark.parametrize("n, m", [(3, 130), (129, 130), (65, 130)])
def test_groups_longer_than_128_keep_exactly_n(n, m):
    """In-group counts reach M - 1: held in int8 they wrapped past 127 and kept up to 172 of 200
    (any 0 < N < M is documented)."""
    w = np.random.default_rng(0).normal(size=(2 * m, 3)).astype(np.float32)
    mask = compute_mask(tf.constant(w), f"{n}:{m}", axis=0).numpy()
    np.testing.assert_array_equal(mask.astype(bool), reference_mask(w, n, m, 0))
    np.testing.assert_array_equal(mask.reshape(2, m, 3).sum(axis=1), n)


def test_tie_rule_keeps_lower_index():
    w = tf.constant([1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    np.testing.assert_array_equal(compute_mask(w).numpy(), [1, 1, 0, 0, 1, 0, 0, 1])


def test_conv_kernel_groups_along_input_channels():
    w = np.random.default_rng(0).normal(size=(3, 3, 8, 5)).astype(np.float32)
    mask = compute_mask(w, "2:4", axis=2).numpy()
    per_group = mask.reshape(3, 3, 2, 4, 5).sum(axis=3)
    np.testing.assert_array_equal(per_group, 2)


def test_mask_in_tf_function_matches_eager():
    w = tf.random.stateless_normal([16, 6], seed=[1, 2])
    graph = tf.function(lambda t: compute_mask(t, "1:4"))(w)
    np.testing.assert_array_equal(graph.numpy(), compute_mask(w, "1:4").numpy())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_names_the_weight(bad):
    w = np.ones((8, 2), np.float32)
    w[5, 1] = bad
    with pytest.raises(ValueError, match=r"dense_7/kernel.*NaN/Inf"):
        compute_mask(w, name="dense_7/kernel")


@pytest.mark.parametrize("shape", [[None, 4], [8, None], None])
def test_unknown_shape_in_graph_names_the_weight(shape):
    @tf.function(input_signature=[tf.TensorSpec(shape, tf.float32, name="w")])
    def mask(w):
        return compute_mask(w, "2:4", axis=0, name="kernel")

    with pytest.raises(ValueError, match=r"Weight kernel has shape .*fully known shape"):
        mask(tf.ones([8, 4]))


def test_non_finite_in_graph_raises():
    fn = tf.function(lambda t: compute_mask(t, name="layer/kernel"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="layer/kernel"):
        fn(tf.constant([1.0, np.nan, 0.0, 2.0]))


@pytest.mark.parametrize("pattern", ["4:2", "2:2", "0:4", "2-4", "", "a:b", None, 24])
def test_invalid_pattern_says_what_was_received(pattern):
    with pytest.raises(ValueError, match="Received: pattern="):
        parse_pattern(pattern)


def test_parse_pattern():
    assert parse_pattern("2:4") == (2, 4)
    assert parse_pattern(" 1 : 8 ") == (1, 8)


def test_axis_not_multiple_of_m():
    with pytest.raises(ValueError, match=r"shape \(6, 3\).*not a multiple of M=4"):
        compute_mask(np.ones((6, 3), np.float32), axis=0)
    with pytest.raises(ValueError, match="out of range"):
        compute_mask(np.ones((8, 4), np.float32), axis=2)


def test_unknown_method_lists_valid_names():
    with pytest.raises(
        ValueError,
        match=r"Expected one of \[.*'magnitude'.*\]. Received: method='random'",
    ):
        compute_mask(np.ones((4, 4), np.float32), method="random")


def test_registry_accepts_new_method():
    def keep_first(groups, n):
        positions = tf.range(groups.shape[1])[None, :, None]
        return tf.broadcast_to(positions < n, tf.shape(groups))

    MASK_METHODS["first"] = keep_first
    try:
        mask = compute_mask(
            np.arange(8, dtype=np.float32).reshape(8, 1), method="first"
        )
    finally:
        del MASK_METHODS["first"]
    np.testing.assert_array_equal(mask.numpy().ravel(), [1, 1, 0, 0, 1, 1, 0, 0])


def test_is_nm_sparse():
    assert is_nm_sparse(np.array([1.0, 0, 0, 2, 0, 0, 0, 0]))
    assert not is_nm_sparse(np.array([1.0, 1, 1, 0]))
    assert is_nm_sparse(np.array([1.0, 1, 1, 0]), "3:4")
    w = np.zeros((4, 4), np.float32)
    w[0, :3] = 1  # three non-zeros in a row: fine along axis 0, not along axis 1
    assert is_nm_sparse(w, axis=0) and not is_nm_sparse(w, axis=1)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64"])
@pytest.mark.parametrize("m", [4, 20])  # pairwise comparisons; a sort (M > PAIRWISE_MAX_M)
def test_signed_integer_minimum_is_the_largest_magnitude(dtype, m):
    """`tf.abs` of the most negative integer overflows to itself: it must still rank first."""
    low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    w = np.zeros((m, 1), dtype)
    w[:4, 0] = [3, low, 1, high]
    np.testing.assert_array_equal(compute_mask(w, f"2:{m}").numpy().ravel()[:4], [0, 1, 0, 1])
    ref = np.abs(w.astype(object)).ravel()  # exact magnitudes (Python ints)
    assert sorted(range(m), key=lambda i: (-ref[i], i))[:2] == [1, 3]


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64", "bool"])
def test_unsigned_and_bool_weights_are_their_own_magnitude(dtype):
    w = np.array([[1], [0], [1], [1], [0], [1], [0], [1]]).astype(dtype)
    if dtype != "bool":
        w[3, 0] = np.iinfo(dtype).max
    mask = compute_mask(w).numpy()
    assert mask.dtype == np.dtype(dtype)
    expected = [1, 0, 0, 1, 0, 1, 0, 1] if dtype != "bool" else [1, 0, 1, 0, 0, 1, 0, 1]
    np.testing.assert_array_equal(mask.ravel().astype(int), expected)
    assert is_nm_sparse(mask) and not is_nm_sparse(w) and is_nm_sparse(w, "3:4")


@pytest.mark.parametrize("axis", [1.0, True, "1", None])
def test_an_axis_that_is_not_an_integer_is_named(axis):
    w = np.ones((4, 4), np.float32)
    for check in (compute_mask, is_nm_sparse):
        message = rf"integer axis for weight .*\(4, 4\)\. Received: axis={axis!r}"
        with pytest.raises(TypeError, match=message):
            check(w, axis=axis)
    np.testing.assert_array_equal(compute_mask(w, axis=np.int64(1)), compute_mask(w, axis=1))


def _kept_counts(mask: np.ndarray, axis: int, m: int) -> list[int]:
    """Kept elements of every group of m along axis, counted one group at a time (reference)."""
    moved = np.moveaxis(mask, axis, -1)
    return [int(sum(row[i : i + m] != 0)) for row in moved.reshape(-1, moved.shape[-1])
            for i in range(0, moved.shape[-1], m)]


@pytest.mark.parametrize("axis", [0, 1])
def test_pattern_mismatch_refuses_any_group_over_n_and_keeps_all_ones(axis):
    """A loaded mask is refused when any one group keeps more than N (a single 3-of-4 group, or
    a single all-ones group among 2:4 ones); an all-ones mask (not computed yet) is accepted."""
    base = np.tile(np.array([1, 0, 1, 0], np.float32), 3)  # every group keeps 2
    mask = np.stack([base] * 2, axis=1 - axis)  # groups along `axis`
    def at(row, col):  # index of element `col` along the grouping axis, in the `row`-th line
        return (col, row) if axis == 0 else (row, col)

    assert pattern_mismatch(mask, axis, 2, 4) is None
    three = mask.copy()
    three[at(1, 5)] = 1  # group 1 of line 1 keeps 3
    assert _kept_counts(three, axis, 4) == [2, 2, 2, 2, 3, 2]
    assert pattern_mismatch(three, axis, 2, 4) == "keeps up to 3 of every 4"
    full = mask.copy()
    full[at(0, 9)] = full[at(0, 11)] = 1  # group 2 of line 0 keeps all 4
    assert _kept_counts(full, axis, 4) == [2, 2, 4, 2, 2, 2]
    assert pattern_mismatch(full, axis, 2, 4) == "keeps up to 4 of every 4"
    assert pattern_mismatch(np.ones_like(mask), axis, 2, 4) is None
    assert pattern_mismatch(np.ones_like(mask), axis, 1, 4) is None
    one = mask.copy()
    one[at(1, 2)] = 0  # uneven counts up to N (a custom method): left alone
    assert pattern_mismatch(one, axis, 2, 4) is None
    assert pattern_mismatch(mask, axis, 3, 4) == "keeps 2 of every 4 (a 2:4 mask)"


@pytest.mark.parametrize("shape, axis", [((8, 0), 0), ((0, 8), 1), ((2, 4, 0), 1)])
def test_an_empty_weight_gets_an_empty_mask(shape, axis):
    w = np.zeros(shape, np.float32)
    mask = compute_mask(w, "2:4", axis=axis).numpy()
    assert mask.shape == shape and mask.dtype == np.float32
    assert is_nm_sparse(w, "2:4", axis)
