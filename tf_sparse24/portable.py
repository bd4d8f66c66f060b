"""Decompression of `sparse24/v1` weights with stock TensorFlow ops only.

A `portable` export rebuilds its pruned kernels inside the serving graph with this function, so the
SavedModel runs on stock TensorFlow and TensorFlow Serving (no custom op library). It uses only
bitwise ops, `Equal`, `Select` and reshapes: the result is bit-exact (no arithmetic on the values,
so NaN, Inf and -0.0 survive unchanged). `tf_sparse24.format.decompress` is the numpy definition it
matches.

Example:
    >>> values = tf.constant([[1.0, 2.0]])          # N=1, K=4: column 0 keeps rows 0 and 2
    >>> meta = tf.constant([[0b1000]], tf.uint8)     # positions 0 and 2
    >>> decompress(values, meta, 4).numpy().ravel().tolist()
    [1.0, 0.0, 2.0, 0.0]
"""

from __future__ import annotations

import math

import tensorflow as tf

M = 4  # group size along K


def decompress(values: tf.Tensor, meta: tf.Tensor, k: int) -> tf.Tensor:
    """Rebuilds the dense [K, N] matrix from `values` [N, K/2] and `meta` [N, ceil(K/8)] uint8.

    Args:
        values: kept elements, row n holding column n's kept elements in K order.
        meta: uint8 in-group positions, two 2-bit fields per group, two groups per byte.
        k: K, the dense reduction size (a multiple of 4, static).

    Returns:
        The [K, N] dense matrix in `values`' dtype; dropped positions hold zeros.

    Raises:
        ValueError: if `k` is not a multiple of 4 or the static shapes disagree with it.
    """
    values = tf.convert_to_tensor(values)
    meta = tf.convert_to_tensor(meta, tf.uint8)
    if k % M:
        raise ValueError(f"K must be a multiple of {M}. Received: k={k}")
    n = values.shape[0]
    expected_values, expected_meta = [n, k // 2], [n, math.ceil(k / 8)]
    if values.shape.as_list() != expected_values or meta.shape.as_list() != expected_meta:
        raise ValueError(
            f"for K={k}, values must be {expected_values} and meta {expected_meta}. "
            f"Received: values {values.shape.as_list()}, meta {meta.shape.as_list()}"
        )
    groups = k // M
    bits = tf.cast(meta, tf.int32)
    nibbles = tf.stack([tf.bitwise.bitwise_and(bits, 15), tf.bitwise.right_shift(bits, 4)], -1)
    # [N, G]; drops the unused high nibble of the last byte when K % 8 == 4.
    nibbles = tf.reshape(nibbles, [n, 2 * expected_meta[1]])[:, :groups]
    first = tf.bitwise.bitwise_and(nibbles, 3)[..., None]  # [N, G, 1]
    second = tf.bitwise.right_shift(nibbles, 2)[..., None]
    slots = tf.range(M, dtype=tf.int32)  # [4]
    kept = tf.reshape(values, [n, groups, 2])
    # A scalar, broadcast by `where` (SelectV2). Not `zeros_like(kept[..., :1])`: with static
    # shapes Grappler folds that into an [N, G, 1] constant (a quarter of the dense kernel's bytes)
    # kept in the optimized load-time function, in memory for as long as the loaded model.
    zeros = tf.zeros([], values.dtype)
    dense = tf.where(
        tf.equal(first, slots),
        kept[..., :1],
        tf.where(tf.equal(second, slots), kept[..., 1:], zeros),
    )  # [N, G, 4]
    return tf.transpose(tf.reshape(dense, [n, k]))
