"""Transposable 2:4 masks: 2:4 along both K and N of a `[K, N]` weight (4x4 blocks).

A 2:4 mask along K makes the forward product `x @ W` sparse-friendly; the backward product
`dy @ W^T` contracts over N instead, so it needs 2:4 along N too. A mask with exactly 2 kept per
row and per column of every 4x4 block satisfies both (Hubara et al., "Accelerated Sparse Neural
Training", NeurIPS 2021). There are 90 such 4x4 patterns.

Two mask methods over the `[groups, 4, P]` view of `tf_sparse24.masks` (P = the N axis of the 2-D
view, so a 4x4 block is 4 consecutive K of a group x 4 consecutive N):
- "transposable": exact, the highest-magnitude pattern of the 90 for every block (ties: the first
  pattern in lexicographic order of its 16 flattened bits, highest first).
- "transposable_greedy": visit a block's elements by decreasing magnitude (ties: lower index along
  K, then N), keep one while its row and column hold fewer than 2. Cheaper, and may keep fewer than
  2 in some row/column (still valid 2:4 both ways).

Example:
    >>> mask = tf_sparse24.compute_mask(kernel, method="transposable")
    >>> model = tf_sparse24.prune(model, method="transposable")
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import tensorflow as tf


def _patterns() -> np.ndarray:
    """The 90 4x4 0/1 patterns with exactly 2 ones per row and column, `[90, 4, 4]`."""
    rows = [r for r in itertools.product((1, 0), repeat=4) if sum(r) == 2]  # highest bits first
    found = [np.array(p) for p in itertools.product(rows, repeat=4) if np.all(np.sum(p, axis=0) == 2)]
    return np.stack(found).astype(np.float32)


PATTERNS_4X4 = _patterns()


def _block_problem(name: str, shape, n: int) -> str | None:
    """Why a `[G, M, P]` groups view cannot take mask method `name` (4x4 blocks), or None.
    Checked eagerly by `compute_mask` (naming the weight) and again in `_blocks`."""
    if n != 2 or shape[1] != 4:
        return f"mask method {name!r} is defined for the 2:4 pattern only. Received: {n}:{shape[1]}"
    if shape[2] is not None and shape[2] % 4:
        return (f"mask method {name!r} needs 4x4 blocks: the weight's size after the grouping axis "
                f"(N of its [K, N] view) must be a multiple of 4. Received: N={shape[2]}")
    return None


def _blocks(groups: tf.Tensor, n: int, name: str) -> tf.Tensor:
    """`[G, 4, P]` -> `[G, P/4, 4 (k), 4 (n)]` magnitudes in float64 for every dtype: a float32
    sum of 8 float32 magnitudes rounds away differences between patterns (2^24 + 3 vs 2^24 + 2),
    and float32 cannot order integers above 2^24. Exact for floats up to 32 bits and integers up
    to 2^53 (the 8-term scores: up to float64 rounding)."""
    if problem := _block_problem(name, tuple(groups.shape), n):
        raise ValueError(problem)
    p = tf.shape(groups)[2]  # dynamic under compute_mask's tf.function
    message = f"mask method {name!r} needs N (of the [K, N] view) to be a multiple of 4"
    checks = [tf.debugging.assert_equal(p % 4, 0, message=message)]
    with tf.control_dependencies(checks):
        mag = tf.abs(tf.cast(groups, tf.float64))
    return tf.transpose(tf.reshape(mag, [-1, 4, p // 4, 4]), [0, 2, 1, 3])


def _unblock(keep: tf.Tensor, shape) -> tf.Tensor:
    return tf.reshape(tf.transpose(keep, [0, 2, 1, 3]), shape)


def transposable_exact(groups: tf.Tensor, n: int) -> tf.Tensor:
    """Best of the 90 transposable patterns per 4x4 block; bool tensor shaped like `groups`."""
    blocks = _blocks(groups, n, "transposable")
    patterns = tf.constant(PATTERNS_4X4.reshape(90, 16), blocks.dtype)
    scores = tf.einsum("gbi,pi->gbp", tf.reshape(blocks, [-1, tf.shape(blocks)[1], 16]), patterns)
    best = tf.gather(patterns, tf.argmax(scores, axis=-1, output_type=tf.int32))
    keep = tf.reshape(best, tf.shape(blocks)) > 0
    return _unblock(keep, tf.shape(groups))


def transposable_greedy(groups: tf.Tensor, n: int) -> tf.Tensor:
    """Greedy transposable mask per 4x4 block; bool tensor shaped like `groups`."""
    blocks = _blocks(groups, n, "transposable_greedy")
    flat = tf.reshape(blocks, [-1, 16])
    order = tf.argsort(flat, axis=-1, direction="DESCENDING", stable=True)
    row_count = tf.zeros_like(flat[:, :4])
    col_count = tf.zeros_like(flat[:, :4])
    keep = tf.zeros_like(flat)
    for step in range(16):
        idx = order[:, step]
        row = tf.one_hot(idx // 4, 4, dtype=flat.dtype)
        col = tf.one_hot(idx % 4, 4, dtype=flat.dtype)
        room = (tf.reduce_sum(row * row_count, -1) < 2) & (tf.reduce_sum(col * col_count, -1) < 2)
        take = tf.cast(room, flat.dtype)[:, None]
        row_count += row * take
        col_count += col * take
        keep += tf.one_hot(idx, 16, dtype=flat.dtype) * take
    return _unblock(tf.reshape(keep > 0, tf.shape(blocks)), tf.shape(groups))


TRANSPOSABLE_METHODS = {"transposable": transposable_exact, "transposable_greedy": transposable_greedy}
TRANSPOSABLE_CHECKS = {name: functools.partial(_block_problem, name) for name in TRANSPOSABLE_METHODS}
