"""The numpy reference of sparse24/v1 (tf_sparse24.format) against a per-group loop and by hand."""

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_sparse24 import format as fmt

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def loop_compress(w):
    """Straight transcription of the byte-by-byte rules in docs/FORMAT.md, one group at a time."""
    k, n = w.shape
    values = np.zeros((n, k // 2), w.dtype)
    meta = np.zeros((n, math.ceil(k / 8)), np.uint8)
    for col in range(n):
        for g in range(k // 4):
            nonzero = [p for p in range(4) if w[4 * g + p, col] != 0]
            assert len(nonzero) <= 2
            pos = sorted(nonzero + [p for p in range(4) if p not in nonzero][: 2 - len(nonzero)])
            for j, p in enumerate(pos):
                values[col, 2 * g + j] = w[4 * g + p, col] if p in nonzero else 0
            meta[col, g // 2] |= (pos[0] | pos[1] << 2) << (4 * (g % 2))
    return values, meta


def random_24(rng, k, n, dtype, density=0.35):
    """Random 2:4 matrix with groups of 0, 1 and 2 non-zeros (some of them -0.0, NaN, inf)."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[rng.random((k, n)) > density] = 0
    groups = w.T.reshape(n, k // 4, 4)  # view into w
    for col, g in zip(*np.nonzero((groups != 0).sum(-1) > 2), strict=True):
        drop = rng.permutation(np.flatnonzero(groups[col, g]))[2:]
        groups[col, g, drop] = 0
    w = w.astype(dtype)
    zeros = np.argwhere(w == 0)
    if len(zeros):
        r, c = zeros[rng.integers(len(zeros))]
        w[r, c] = -0.0
    return w


def bits(a):
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def test_worked_example_from_docs():
    # The example in docs/FORMAT.md, K=12 (K % 8 == 4), N=2.
    w = np.zeros((12, 2), np.float32)
    w[[1, 3], 0] = [1.5, -2.0]  # group 0: positions 1, 3
    w[6, 0] = 4.0  # group 1: one non-zero at position 2 -> (0, 2), pad at 0
    # group 2 of column 0 is all zero -> (0, 1)
    w[[4, 5], 1] = [7.0, 8.0]  # column 1, group 1: positions 0, 1
    w[[10, 11], 1] = [9.0, -1.0]  # group 2: positions 2, 3
    values, meta = fmt.compress(w)
    np.testing.assert_array_equal(values, [[1.5, -2.0, 0.0, 4.0, 0.0, 0.0], [0, 0, 7, 8, 9, -1]])
    assert meta.tolist() == [[0x8D, 0x04], [0x44, 0x0E]]
    np.testing.assert_array_equal(fmt.decompress(values, meta, 12), w)


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(0, 9),
    n=st.integers(0, 7),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_compress_matches_loop_and_round_trips(groups, n, dtype, seed):
    rng = np.random.default_rng(seed)
    w = random_24(rng, 4 * groups, n, dtype)
    values, meta = fmt.compress(w)
    ref_values, ref_meta = loop_compress(w)
    assert values.dtype == w.dtype and meta.dtype == np.uint8
    np.testing.assert_array_equal(bits(values), bits(ref_values))  # pads are +0.0, bit for bit
    np.testing.assert_array_equal(meta, ref_meta)
    back = fmt.decompress(values, meta, 4 * groups)
    assert back.shape == w.shape and back.dtype == w.dtype
    np.testing.assert_array_equal(back, w)  # == treats -0.0 as 0.0 and NaN needs equal_nan
    if groups % 2:
        assert not (meta[:, -1] >> 4).any()


@pytest.mark.parametrize("block", [1, 7, 36, 44, 400])
def test_compress_in_column_blocks_matches_loop(monkeypatch, block):
    """Blocks of 1 column (fewer weights than K), several, a tail block, one block."""
    monkeypatch.setattr(fmt, "COMPRESS_BLOCK_ELEMENTS", block)
    for dtype, (k, n) in zip(DTYPES, [(36, 9), (44, 5), (8, 11)]):
        w = random_24(np.random.default_rng(block), k, n, dtype)
        values, meta = fmt.compress(w)
        ref_values, ref_meta = loop_compress(w)
        np.testing.assert_array_equal(bits(values), bits(ref_values))
        np.testing.assert_array_equal(meta, ref_meta)


def test_nan_counts_as_non_zero_and_is_kept():
    w = np.zeros((4, 1), np.float32)
    w[[0, 2], 0] = [np.nan, np.inf]
    values, meta = fmt.compress(w)
    assert np.isnan(values[0, 0]) and values[0, 1] == np.inf and meta[0, 0] == (0 | 2 << 2)
    w[3, 0] = np.nan
    with pytest.raises(ValueError, match="3 non-zeros"):
        fmt.compress(w)


def test_check_2to4_names_first_bad_group():
    w = np.zeros((16, 5), np.float32)
    w[8:11, 3] = 1.0  # group 2, column 3
    w[12:16, 1] = 1.0  # group 3, column 1 (later in memory order)
    with pytest.raises(
        ValueError, match=r"group g=2 \(rows k=8..11\) of column n=3 .*k=\[8, 9, 10\]"
    ):
        fmt.check_2to4(w)
    with pytest.raises(ValueError, match="multiple of 4.*K=6"):
        fmt.check_2to4(np.zeros((6, 2)))
    with pytest.raises(ValueError, match="2-D"):
        fmt.check_2to4(np.zeros(8))


def test_decompress_rejects_bad_meta():
    values = np.ones((2, 8), np.float32)
    good = np.array([[0x4E, 0x4E], [0x4E, 0x4E]], np.uint8)
    fmt.decompress(values, good, 16)
    for byte, group, pos in [(0x4A, 2, "(2, 2)"), (0x4B, 2, "(3, 2)"), (0x14, 3, "(1, 0)")]:
        bad = good.copy()
        bad[1, 1] = byte  # row 1, groups 2 (low nibble) and 3 (high nibble)
        with pytest.raises(
            ValueError, match=re.escape(f"row n=1, group g={group} has positions {pos}")
        ):
            fmt.decompress(values, bad, 16)
    with pytest.raises(ValueError, match="high nibble"):
        fmt.decompress(np.ones((1, 6), np.float32), np.array([[0x4E, 0x1E]], np.uint8), 12)
    with pytest.raises(ValueError, match=r"values must be \[N, K/2\] = \[2, 8\]"):
        fmt.decompress(np.ones((2, 6), np.float32), good, 16)
    with pytest.raises(ValueError, match="uint8"):
        fmt.decompress(values, good.astype(np.int32), 16)


def test_check_meta_names_first_row_with_a_high_nibble():
    # Rows 1 and 2 both have a non-zero unused high nibble (K % 8 == 4); the first one is named,
    # as Sparse24Decompress / Sparse24MatMul do, not the one with the largest nibble.
    meta = np.array([[0x8D, 0x04], [0x44, 0x1E], [0x44, 0x5E]], np.uint8)
    with pytest.raises(ValueError, match=re.escape("row n=1, last byte 0x1e has a non-zero high")):
        fmt.check_meta(meta, 12)


@pytest.mark.parametrize(
    "shape,axis,k",
    [
        ((8, 3), 0, 8),
        ((3, 3, 8, 5), 2, 72),
        ((8, 2, 16), 0, 8),
        ((2, 4, 16), 1, 8),
        ((4, 6), -2, 4),
    ],
)
def test_to_2d_follows_grouping_rule(shape, axis, k):
    w = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    w2 = fmt.to_2d(w, axis)
    assert w2.shape == (k, w.size // k)
    ax = axis % len(shape)
    # Row k of the view is the multi-index over shape[:axis+1] with `axis` fastest.
    idx = np.unravel_index(np.arange(k), shape[: ax + 1])
    np.testing.assert_array_equal(w2[:, 0], w[idx + (0,) * (len(shape) - ax - 1)])
    np.testing.assert_array_equal(fmt.from_2d(w2, shape), w)
    with pytest.raises(ValueError, match="out of range"):
        fmt.to_2d(w, len(shape))
    with pytest.raises(ValueError, match="cannot reshape"):
        fmt.from_2d(w2, (1, 2))


def test_large_matrix_round_trip():
    rng = np.random.default_rng(0)
    w = random_24(rng, 1028, 300, np.float32)  # K % 8 == 4
    values, meta = fmt.compress(w)
    assert values.shape == (300, 514) and meta.shape == (300, 129)
    np.testing.assert_array_equal(fmt.decompress(values, meta, 1028), w)
    assert np.count_nonzero(values) == np.count_nonzero(w)


def test_check_meta_and_decompress_refuse_misshaped_inputs():
    """A meta with a spare byte, a K that is not a multiple of 4, values transposed to [K/2, N]
    (the same size): each is refused, not read past or reinterpreted."""
    w = np.zeros((16, 2), np.float32)
    w[[1, 3], 0] = [1.0, 2.0]
    w[[8, 14], 1] = [3.0, 4.0]
    values, meta = fmt.compress(w)
    assert values.shape == (2, 8) and meta.shape == (2, 2)
    spare = np.concatenate([meta, np.zeros((2, 1), np.uint8)], axis=1)  # [N, 3] for K=16
    with pytest.raises(ValueError, match=r"\[N, 2\] for K=16. Received: dtype=uint8, shape=\(2, 3\)"):
        fmt.check_meta(spare, 16)
    with pytest.raises(ValueError, match=r"shape=\(2, 3\)"):
        fmt.decompress(values, spare, 16)
    with pytest.raises(ValueError, match="multiple of 4.*K=6"):
        fmt.check_meta(meta[:, :1], 6)  # ceil(6/8) = 1 byte: the shape alone would pass
    wide = np.zeros((8, 8), np.float32)  # K=8, N=8: values [8, 4]; transposed [4, 8] same size
    wide[0, :] = np.arange(1, 9)
    v8, m8 = fmt.compress(wide)
    assert v8.shape == (8, 4)
    np.testing.assert_array_equal(fmt.decompress(v8, m8, 8), wide)
    with pytest.raises(ValueError, match=r"values must be \[N, K/2\] = \[8, 4\].*\(4, 8\)"):
        fmt.decompress(np.ascontiguousarray(v8.T), m8, 8)


def test_to_2d_of_an_empty_reduction_axis():
    w = np.zeros((0, 3), np.float32)
    assert fmt.to_2d(w, 0).shape == (0, 3)
    assert fmt.to_2d(np.zeros((2, 0, 3), np.float32), 1).shape == (0, 3)
    assert fmt.to_2d(np.zeros((4, 0), np.float32), 0).shape == (4, 0)
