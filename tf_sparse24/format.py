"""Numpy reference of the `sparse24/v1` compressed format: the definition the C++ ops match exactly.

A 2-D weight W `[K, N]` (Keras kernel layout, 2:4 along K) is stored as

* `values [N, K/2]`, W's dtype: row n holds the two kept elements of every group of column n, in K
  order;
* `meta [N, ceil(K/8)]` uint8: byte b of row n covers groups 2b and 2b+1 of column n; bits 0-1 and
  2-3 are the in-group positions (0..3) of the two kept elements of group 2b, bits 4-5 and 6-7 those
  of group 2b+1. When K % 8 == 4 the last byte's high nibble is 0.

A group is 4 consecutive rows 4g..4g+3 of one column. An element counts as non-zero when it compares
unequal to 0 (so NaN is non-zero and -0.0 is zero). A group with fewer than two non-zeros keeps its
non-zeros plus zeros at its lowest unused positions; such a padded element is stored as +0.0 (all
bits clear). Meta is valid when, in every group, the first position is strictly below the second
(the same position twice or a descending pair is rejected) and the unused high nibble (K % 8 == 4)
is 0. Higher-rank kernels go through `to_2d` / `from_2d` (the project's grouping rule). See
docs/FORMAT.md for a byte-by-byte description and a worked example.

Example:
    >>> w = np.array([[1.0], [0.0], [2.0], [0.0]], np.float32)   # K=4, N=1
    >>> values, meta = compress(w)
    >>> values.tolist(), meta.tolist()
    ([[1.0, 2.0]], [[8]])
    >>> bool((decompress(values, meta, 4) == w).all())
    True
"""

from __future__ import annotations

import math

import numpy as np

FORMAT_VERSION = "sparse24/v1"
M = 4  # group size along K
N_KEPT = 2  # elements kept per group


def _check_k(k: int, what: str) -> None:
    if k % M != 0:
        raise ValueError(
            f"{what}: K (the reduction size) must be a multiple of {M} for 2:4 groups. "
            f"Received: K={k}"
        )


def check_2to4(w: np.ndarray) -> None:
    """Checks that a [K, N] matrix is 2:4 sparse along K.

    Args:
        w: the [K, N] matrix.

    Raises:
        ValueError: if `w` is not 2-D, K is not a multiple of 4, or a group holds more than two
            non-zeros; the message names the first such group (scanning W in memory order: group g,
            then column n) by row k, column n and group g.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"check_2to4 expects a 2-D [K, N] matrix. Received shape: {w.shape}")
    k, n = w.shape
    _check_k(k, "check_2to4")
    counts = (w != 0).reshape(k // M, M, n).sum(axis=1, dtype=np.uint8)  # [groups, N]
    bad = np.argwhere(counts > N_KEPT)  # row-major: first by group, then by column
    if bad.size:
        g, col = (int(i) for i in bad[0])
        rows = [4 * g + i for i in range(M) if w[4 * g + i, col] != 0]
        raise ValueError(
            f"not 2:4 sparse: group g={g} (rows k={4 * g}..{4 * g + 3}) of column n={col} has "
            f"{len(rows)} non-zeros at rows k={rows}; at most 2 of every 4 consecutive elements "
            f"along K may be non-zero ({int((counts > N_KEPT).sum())} bad groups in total)"
        )


def _kept_positions_table() -> np.ndarray:
    """[16, 2] kept positions for each non-zero mask of a group (bit p set: element p non-zero)."""
    table = np.zeros((2**M, N_KEPT), np.int64)
    for mask in range(2**M):
        nonzero = [p for p in range(M) if mask >> p & 1]
        unused = [p for p in range(M) if not mask >> p & 1]
        table[mask] = sorted((nonzero + unused)[:N_KEPT])  # masks with > 2 bits never get here
    return table


_KEPT_POSITIONS = _kept_positions_table()


def kept_positions(w: np.ndarray) -> np.ndarray:
    """In-group positions [N, K/4, 2] (ascending) that compression keeps for a 2:4 [K, N] matrix.

    The non-zeros of each group, completed with the lowest unused positions when there are fewer
    than two.
    """
    k, n = w.shape
    nonzero = (w != 0).T.reshape(n, k // M, M)
    return _KEPT_POSITIONS[nonzero @ (1 << np.arange(M))]


# compress() works on blocks of columns of about this many weights, so that its index arrays
# (int64, 2-4x the weights' bytes) stay small next to a large kernel.
COMPRESS_BLOCK_ELEMENTS = 1 << 22


def compress(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compresses a 2:4 sparse [K, N] matrix into (values [N, K/2], meta [N, ceil(K/8)] uint8).

    Args:
        w: the [K, N] matrix, any float dtype (float32, float16, ml_dtypes.bfloat16, ...).

    Returns:
        `(values, meta)` as defined in the module docstring; values keep `w`'s dtype.

    Raises:
        ValueError: if `w` is not 2:4 sparse along K (see `check_2to4`).
    """
    w = np.asarray(w)
    check_2to4(w)
    k, n = w.shape
    values = np.empty((n, k // 2), w.dtype)
    meta = np.empty((n, math.ceil(k / 8)), np.uint8)
    step = max(1, COMPRESS_BLOCK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        columns = slice(start, start + step)
        values[columns], meta[columns] = _compress_columns(w[:, columns])
    return values, meta


def _compress_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`compress` of a checked [K, n] block of columns (each column is compressed on its own)."""
    k, n = w.shape
    pos = kept_positions(w)  # [N, G, 2]
    groups = np.ascontiguousarray(w.T).reshape(n, k // M, M)
    kept = np.take_along_axis(groups, pos, axis=-1)
    values = np.where(kept != 0, kept, np.zeros((), w.dtype)).astype(w.dtype)  # pads are +0.0
    nibbles = (pos[..., 0] | (pos[..., 1] << 2)).astype(np.uint8)  # [N, G]
    if nibbles.shape[1] % 2:
        nibbles = np.concatenate([nibbles, np.zeros((n, 1), np.uint8)], axis=1)
    meta = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
    return values.reshape(n, k // 2), meta


def unpack_meta(meta: np.ndarray, k: int) -> np.ndarray:
    """In-group positions [N, K/4, 2] encoded in `meta` [N, ceil(K/8)] (no validity check)."""
    meta = np.asarray(meta, np.uint8)
    nibbles = np.stack([meta & 0xF, meta >> 4], axis=-1).reshape(meta.shape[0], 2 * meta.shape[1])
    nibbles = nibbles[:, : k // M]
    return np.stack([nibbles & 3, nibbles >> 2], axis=-1).astype(np.int64)


def check_meta(meta: np.ndarray, k: int) -> None:
    """Checks that `meta` [N, ceil(K/8)] is valid for K.

    Raises:
        ValueError: on a wrong shape or dtype, a group whose two positions are not strictly
            ascending (naming its row n and group g), or a non-zero unused high nibble when
            K % 8 == 4.
    """
    meta = np.asarray(meta)
    _check_k(k, "check_meta")
    if meta.dtype != np.uint8 or meta.ndim != 2 or meta.shape[1] != math.ceil(k / 8):
        raise ValueError(
            f"meta must be uint8 [N, ceil(K/8)] = [N, {math.ceil(k / 8)}] for K={k}. "
            f"Received: dtype={meta.dtype}, shape={meta.shape}"
        )
    pos = unpack_meta(meta, k)
    bad = np.argwhere(pos[..., 0] >= pos[..., 1])
    if bad.size:
        n, g = (int(i) for i in bad[0])
        raise ValueError(
            f"invalid meta: row n={n}, group g={g} has positions ({pos[n, g, 0]}, {pos[n, g, 1]}); "
            "the two positions of a group must be strictly ascending"
        )
    if k % 8 == 4 and meta.shape[0] and (meta[:, -1] >> 4).any():
        n = int(np.flatnonzero(meta[:, -1] >> 4)[0])  # the first such row, not the largest nibble
        raise ValueError(
            f"invalid meta: row n={n}, last byte {meta[n, -1]:#04x} has a non-zero high nibble, "
            f"which must be 0 when K % 8 == 4 (K={k})"
        )


def decompress(values: np.ndarray, meta: np.ndarray, k: int) -> np.ndarray:
    """Rebuilds the dense [K, N] matrix from (values, meta).

    Args:
        values: [N, K/2] kept elements.
        meta: [N, ceil(K/8)] uint8 positions.
        k: K, the dense reduction size (a multiple of 4).

    Returns:
        The [K, N] matrix in `values`' dtype; positions not kept hold +0.0.

    Raises:
        ValueError: on inconsistent shapes or invalid meta (see `check_meta`).
    """
    values = np.asarray(values)
    check_meta(meta, k)
    n = meta.shape[0]
    if values.shape != (n, k // 2):
        raise ValueError(
            f"values must be [N, K/2] = [{n}, {k // 2}] to match meta {meta.shape} and K={k}. "
            f"Received: values shape {values.shape}"
        )
    pos = unpack_meta(meta, k)
    groups = np.zeros((n, k // M, M), values.dtype)
    np.put_along_axis(groups, pos, values.reshape(n, k // M, N_KEPT), axis=-1)
    return np.ascontiguousarray(groups.reshape(n, k).T)


def to_2d(w: np.ndarray, axis: int) -> np.ndarray:
    """The [K, N] view of a kernel grouped along `axis` (K = prod(shape[:axis+1]), `axis` fastest).

    Every axis before `axis` is contracted too (Dense: axis 0; ConvND [..., in, out]: axis rank-2).
    """
    w = np.asarray(w)
    axis = _normalize_axis(axis, w.ndim)
    return w.reshape(math.prod(w.shape[: axis + 1]), math.prod(w.shape[axis + 1 :]))


def from_2d(w2d: np.ndarray, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Inverse of `to_2d`: reshapes a [K, N] matrix back to the kernel's `shape`."""
    w2d = np.asarray(w2d)
    if w2d.size != math.prod(shape):
        raise ValueError(f"cannot reshape a {w2d.shape} matrix to kernel shape {tuple(shape)}")
    return w2d.reshape(tuple(shape))


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a rank-{ndim} kernel")
    return axis % ndim
