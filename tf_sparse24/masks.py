"""N:M structured-sparsity masks in pure TensorFlow ops.

"N:M" keeps N of every M consecutive weights along a grouping axis (the paper's notation: "2:4"
keeps 2 of 4). apex ASP's `m4n2` and tfmot's `m_by_n=(2, 4)` ("2 zeros out of 4") name the same
pattern from the other side; we follow the paper.

A mask algorithm is a small pure function over a `[groups, M]` view of the weight, reached through
the `MASK_METHODS` registry.

Tie rule (deterministic): within a group, elements are ranked by magnitude, and among equal
magnitudes the element with the lower index along the grouping axis ranks higher. So
`[1, -1, 1, 1]` under 2:4 keeps positions 0 and 1.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable

import numpy as np
import tensorflow as tf

_PATTERN_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pattern(pattern: str) -> tuple[int, int]:
    """Parses an "N:M" pattern string (keep N of every M) into `(N, M)`.

    Raises:
        ValueError: if the string is not "N:M" with integers 0 < N < M.

    Example:
        >>> parse_pattern("2:4")
        (2, 4)
    """
    match = _PATTERN_RE.match(pattern) if isinstance(pattern, str) else None
    if match is None:
        raise ValueError(
            f'Expected a pattern string "N:M" (keep N of every M), e.g. "2:4". Received: '
            f"pattern={pattern!r}"
        )
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ValueError(
            f"Expected a pattern N:M with 0 < N < M. Received: pattern={pattern!r}"
        )
    return n, m


PAIRWISE_MAX_M = 16  # longer groups are ranked by a sort (magnitude_mask)


def magnitude_mask(groups: tf.Tensor, n: int) -> tf.Tensor:
    """Keeps the `n` largest-magnitude elements of every group of `groups` `[G, M, P]`.

    The in-group position is axis 1 (a `[groups, M]` view with a trailing axis P, so no transpose
    is needed). Element i is kept when fewer than `n` elements of its group beat it, where j beats
    i if `|w_j| > |w_i|`, or `|w_j| == |w_i|` and `j < i` (lower index wins ties). For M up to
    `PAIRWISE_MAX_M` the M(M-1)/2 pairwise comparisons are cheaper than a sort and vectorize
    well; longer groups are ranked by a stable sort instead (the same rule), whose graph does not
    grow with M(M-1)/2 (M=130 took 90 s to trace pairwise).

    Returns:
        A boolean tensor shaped like `groups`.
    """
    if groups.shape[1] > PAIRWISE_MAX_M:
        return _sorted_rank(_magnitude(groups)) < n
    mag = tf.unstack(_magnitude(groups), axis=1)
    beaten_by = [tf.zeros_like(mag[0], dtype=tf.int32) for _ in mag]
    for i in range(len(mag)):
        for j in range(i + 1, len(mag)):
            i_wins = tf.cast(mag[i] >= mag[j], tf.int32)
            beaten_by[j] += i_wins
            beaten_by[i] += 1 - i_wins
    return tf.stack([count < n for count in beaten_by], axis=1)


_UNSIGNED = {tf.int8: tf.uint8, tf.int16: tf.uint16, tf.int32: tf.uint32, tf.int64: tf.uint64}


def _magnitude(w: tf.Tensor) -> tf.Tensor:
    """`|w|`, exact for every dtype: a signed integer's magnitude in the unsigned type of its
    width (`tf.abs` of int8 -128 is -128, which would rank the largest magnitude last), unsigned
    integers as they are, bools as 0/1."""
    if w.dtype == tf.bool:
        return tf.cast(w, tf.uint8)
    if w.dtype.is_unsigned:
        return w
    if w.dtype in _UNSIGNED:
        return tf.bitcast(tf.abs(w), _UNSIGNED[w.dtype])
    return tf.abs(w)


def _sorted_rank(mag: tf.Tensor) -> tf.Tensor:
    """Each element's place (0 = largest) in its group, axis 1 of `mag`: a stable descending
    sort puts equal magnitudes in index order, and sorting the order inverts it."""
    order = tf.argsort(mag, axis=1, direction="DESCENDING", stable=True)
    return tf.argsort(order, axis=1, stable=True)


MASK_METHODS: dict[str, Callable[[tf.Tensor, int], tf.Tensor]] = {
    "magnitude": magnitude_mask
}
DEFAULT_METHOD = "magnitude"
# Shape requirements a method adds: `(groups view shape [G, M, P], n) -> problem or None`, checked
# eagerly by compute_mask (so the error names the weight) before the method's tf.function.
MASK_METHOD_CHECKS: dict[str, Callable[[tuple, int], str | None]] = {}


def _mask_method(method: str) -> Callable[[tf.Tensor, int], tf.Tensor]:
    if method not in MASK_METHODS:
        raise ValueError(
            f"Unknown mask method. Expected one of {sorted(MASK_METHODS)}. Received: method={method!r}"
        )
    return MASK_METHODS[method]


def _weight_name(weight, name: str | None) -> str:
    return (
        name
        or getattr(weight, "path", None)
        or getattr(weight, "name", None)
        or "<tensor>"
    )


def is_integer_axis(axis) -> bool:
    """Whether `axis` can name an axis: a Python or numpy integer, not a bool (True is not 1)."""
    return isinstance(axis, numbers.Integral) and not isinstance(axis, bool)


def _groups_shape(shape: tuple, m: int, axis: int, label: str) -> tuple[int, int, int]:
    """The `[G, M, P]` view of a weight of `shape` in which M consecutive elements along `axis`
    form axis 1; raises ValueError naming the weight if there is none."""
    shape = tuple(shape) if getattr(shape, "rank", 0) is not None else None
    if shape is None or None in shape:
        raise ValueError(f"Weight {label} has shape {shape}: masks need a fully known shape "
                         "(in a tf.function, give the input_signature the weight's shape).")
    if not is_integer_axis(axis):
        raise TypeError(f"Expected an integer axis for weight {label} with shape {shape}. "
                        f"Received: axis={axis!r}")
    axis, rank = int(axis), len(shape)
    if rank == 0 or not -rank <= axis < rank:
        raise ValueError(f"Axis {axis} is out of range for weight {label} with shape {shape}.")
    axis %= rank
    if shape[axis] % m:
        raise ValueError(
            f"Weight {label} with shape {shape} has {shape[axis]} elements along axis "
            f"{axis}, not a multiple of M={m}: it cannot be grouped."
        )
    before = int(np.prod(shape[:axis], dtype=np.int64))
    after = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    return before * (shape[axis] // m), m, after


def check_mask_shape(
    shape: tuple, pattern: str, axis: int, method: str, label: str
) -> tuple[int, int, int]:
    """Raises the ValueError `compute_mask` would for a weight of `shape` (bad pattern, method,
    axis, or a shape the method cannot take), without computing anything; returns the weight's
    `[G, M, P]` groups view shape."""
    n, m = parse_pattern(pattern)
    _mask_method(method)
    groups = _groups_shape(shape, m, axis, label)
    check = MASK_METHOD_CHECKS.get(method)
    if check is not None and (problem := check(groups, n)):
        raise ValueError(f"Weight {label} with shape {tuple(shape)}: {problem}.")
    return groups


@tf.function(reduce_retracing=True, autograph=False)
def _keep_and_finite(
    groups: tf.Tensor, n: int, m: int, method: Callable
) -> tuple[tf.Tensor, tf.Tensor]:
    groups = tf.ensure_shape(
        groups, [None, m, None]
    )  # retracing relaxes shapes; M stays static
    finite = (
        tf.reduce_all(tf.math.is_finite(groups)) if groups.dtype.is_floating else True
    )
    return method(groups, n), finite


@tf.autograph.experimental.do_not_convert  # plain Python: its eager/graph branch is deliberate
def compute_mask(
    weight: tf.Tensor | tf.Variable | np.ndarray,
    pattern: str = "2:4",
    axis: int = 0,
    method: str = "magnitude",
    *,
    name: str | None = None,
) -> tf.Tensor:
    """Computes an N:M mask for `weight` along `axis` (groups of M consecutive elements).

    Args:
        weight: a tensor or variable of any rank and any real dtype (floating point, signed or
            unsigned integer, bool), ranked by exact magnitude (int8 -128 is the largest).
        pattern: "N:M", keep N of every M.
        axis: grouping axis (the layer's reduction axis, see DESIGN.md contract 1).
        method: a key of `MASK_METHODS`.
        name: name used in error messages (defaults to the variable's path).

    Returns:
        A 0/1 tensor with the weight's shape and dtype.

    Raises:
        ValueError: bad pattern or method, `shape[axis] % M != 0`, or NaN/Inf weights (eager; in a
            graph a NaN/Inf raises `tf.errors.InvalidArgumentError` naming the weight).
        TypeError: `axis` is not an integer (a bool is refused too).

    Example:
        >>> compute_mask(tf.constant([[4.0], [1.0], [-3.0], [2.0]])).numpy().ravel()
        array([1., 0., 1., 0.], dtype=float32)
    """
    w = tf.convert_to_tensor(weight)
    label = _weight_name(weight, name)
    groups = tf.reshape(w, check_mask_shape(w.shape, pattern, axis, method, label))
    n, m = parse_pattern(pattern)
    keep, finite = _keep_and_finite(groups, n, m, _mask_method(method))
    if tf.executing_eagerly():
        if not bool(finite):
            bad = int(tf.reduce_sum(tf.cast(~tf.math.is_finite(w), tf.int64)))
            raise ValueError(
                f"Weight {label} with shape {tuple(w.shape)} contains {bad} NaN/Inf value(s); "
                "cannot compute a magnitude mask."
            )
    else:
        check = tf.debugging.Assert(finite, [f"Weight {label} contains NaN/Inf"])
        with tf.control_dependencies([check]):
            keep = tf.identity(keep)
    return tf.reshape(tf.cast(keep, w.dtype), w.shape)


def is_nm_sparse(
    weight: tf.Tensor | tf.Variable | np.ndarray, pattern: str = "2:4", axis: int = 0
) -> bool:
    """True if every group of M consecutive elements along `axis` has at most N non-zeros."""
    n, m = parse_pattern(pattern)
    w = tf.convert_to_tensor(weight)
    groups = tf.reshape(w, _groups_shape(w.shape, m, axis, _weight_name(weight, None)))
    nonzeros = tf.reduce_sum(tf.cast(groups != tf.zeros([], w.dtype), tf.int32), axis=1)  # bool too
    return bool(tf.reduce_all(nonzeros <= n))


def pattern_mismatch(mask: np.ndarray, axis: int, n: int, m: int) -> str | None:
    """How a mask being loaded contradicts pattern N:M, or None: more than N kept in a group, or
    every group keeping the same other count (a mask made for another pattern). All ones (masks
    not computed yet) fit any pattern; uneven counts up to N (a custom method) are left alone."""
    groups = np.moveaxis(mask, axis, -1).reshape(-1, m)
    kept = np.count_nonzero(groups, axis=1)
    if kept.size == 0 or np.all(kept == m):
        return None
    if kept.max() > n:
        return f"keeps up to {kept.max()} of every {m}"
    if kept.min() == kept.max() != n:
        return f"keeps {kept[0]} of every {m} (a {kept[0]}:{m} mask)"
    return None


# Methods defined in their own modules (they only need TF, so importing them last is safe).
from tf_sparse24.transposable import TRANSPOSABLE_CHECKS, TRANSPOSABLE_METHODS  # noqa: E402

MASK_METHODS.update(TRANSPOSABLE_METHODS)
MASK_METHOD_CHECKS.update(TRANSPOSABLE_CHECKS)
