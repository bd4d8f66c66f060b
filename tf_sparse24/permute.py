"""Channel permutations that raise the magnitude a 2:4 mask keeps (Pool & Yu, NeurIPS 2021).

2:4 keeps the 2 largest of every 4 consecutive input channels, so which channels share a group
matters: reordering a layer's input channels (and, to keep the network's function unchanged, the
output channels of the layer that produces them) lets large weights avoid competing with each other.

Two parts:
- `search_permutation(weight, axis)`: numpy search for a channel order (group scores in C++). An
  exact local search re-partitions two or three 4-channel stripes at a time (apex ASP's "optimize
  stripe groups" neighbourhood) until no gain is left, then escapes local optima by shuffling a
  few stripes of the best order and searching again ("kicks"), keeping only improvements. Wide
  layers are searched in random blocks of channels, so the cost stays linear in their width.
- `permute(model)`: applies searches to a Keras Functional/Sequential model, permuting each
  eligible layer's input channels together with the output channels of the layers that produce
  them (kernel columns, bias, BatchNormalization or Normalization statistics in between; across
  residual adds all branches and all readers of the sum; through concatenations as a slice), and
  reports per-space gains and skip reasons.

Metric (apex ASP's `permutation_tests`): efficacy = (lost_plain - lost_permuted) /
(lost_plain - lost_rows50), where "lost" is the magnitude 2:4 discards and lost_rows50 is what
keeping the top 50% of each row discards. ASP's matrix is `[filters, channels]` with groups of 4
along channels; a Keras kernel is `[channels, filters]`, so ASP's rows are our output channels (and,
for convolutions, every spatial tap x output channel). `permutation_efficacy` uses ASP's
orientation.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import inspect
import itertools
import math
import os
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf
from tqdm.auto import tqdm

from tf_sparse24.model_copy import (
    check_untied,
    clone_graph,
    copy_layer,
    is_functional,
    symbolic_arguments,
)
from tf_sparse24.prune import _check_selectors, _covered, check_model, pruned_layers
from tf_sparse24.registry import einsum_axis, einsum_parts, own_variables
from tf_sparse24.wrapper import Sparse24, _sublayers, walk_layers

_EPS = 1e-6  # gains below this (in summed |w| / max |w|) are noise: stop searching


# ----------------------------------------------------------------------------------------------
# Metric helpers (ASP orientation: matrix [rows, channels], groups of 4 along channels).


def kept_magnitude(matrix: np.ndarray, permutation: np.ndarray | None = None) -> float:
    """Sum of |w| that 2:4 keeps in `matrix` `[rows, channels]` (groups of 4 along channels)."""
    a = np.abs(np.asarray(matrix, dtype=np.float64))
    if permutation is not None:
        a = a[:, permutation]
    if a.ndim != 2 or a.shape[1] % 4:
        raise ValueError(f"Expected a [rows, channels] matrix with channels % 4 == 0. Received: shape={a.shape}")
    groups = np.sort(a.reshape(a.shape[0], -1, 4), axis=-1)
    return float(groups[..., 2:].sum())


def permutation_efficacy(matrix: np.ndarray, permutation: np.ndarray) -> float:
    """ASP's efficacy (percent) of `permutation` on `matrix` `[rows, channels]`.

    0 = no better than plain 2:4, 100 = as good as keeping the top half of every row.
    """
    return _efficacy([matrix], [permutation])


def _efficacy(matrices: list[np.ndarray], permutations: list[np.ndarray]) -> float:
    """`permutation_efficacy` of several matrices, each with its own permutation, taken
    together (their lost magnitudes summed)."""
    lost_plain = lost_perm = lost_rows = 0.0
    for matrix, permutation in zip(matrices, permutations):
        a = np.abs(np.asarray(matrix, dtype=np.float64))
        total = a.sum()
        lost_plain += total - kept_magnitude(a)
        lost_perm += total - kept_magnitude(a, permutation)
        lost_rows += total - np.sort(a, axis=1)[:, a.shape[1] // 2 :].sum()
    if lost_plain - lost_rows <= 0:
        return 100.0 if lost_perm <= lost_plain else 0.0
    return float(100.0 * (lost_plain - lost_perm) / (lost_plain - lost_rows))


def channel_matrix(weight: np.ndarray, axis: int) -> np.ndarray:
    """`weight` as `[rows, channels]` with `axis` as channels (ASP's orientation)."""
    w = np.asarray(weight)
    return np.moveaxis(w, axis, -1).reshape(-1, w.shape[axis])


# ----------------------------------------------------------------------------------------------
# Search.


def _top2_sum(at: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Kept magnitude (sum over rows of the top 2 of 4) of every 4-channel group.

    Args:
        at: `[channels, rows]` float32 magnitudes (channel-major, so a group reads whole rows).
        groups: int array `[..., 4]` of channel indices.

    Runs the op library's C++ loop (`cc/sparse24/group_scores.cc`, about 10x faster, on all
    cores) when the library is usable, numpy otherwise.
    """
    flat = np.ascontiguousarray(groups.reshape(-1, 4), dtype=np.int64)
    native = _native_top2_group_sums()
    if native is None:
        return _top2_sum_numpy(at, flat).reshape(groups.shape[:-1])
    at = np.ascontiguousarray(at, dtype=np.float32)
    out = np.empty(len(flat), dtype=np.float64)
    native(at.ctypes.data, at.shape[1], flat.ctypes.data, len(flat), out.ctypes.data,
           os.cpu_count() or 1)
    return out.reshape(groups.shape[:-1])


@functools.cache
def _native_top2_group_sums() -> Callable | None:
    """The op library's `tf_sparse24_top2_group_sums`, or None without a usable library."""
    from tf_sparse24 import ops

    try:
        return ops._c_function(
            "tf_sparse24_top2_group_sums",
            None,
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int],
        )
    except (ops.OpLibraryError, AttributeError):  # AttributeError: a library built before it
        return None


def _top2_sum_numpy(at: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """`_top2_sum` of `groups` `[count, 4]` in numpy (the fallback, and the tests' reference)."""
    out = np.empty(len(groups), dtype=np.float64)
    chunk = max(16, 65536 // max(1, at.shape[1]))  # four [chunk, rows] gathers stay in L2
    for start in range(0, len(groups), chunk):
        g = groups[start : start + chunk]
        x0, x1, x2, x3 = at[g[:, 0]], at[g[:, 1]], at[g[:, 2]], at[g[:, 3]]
        hi01, lo01 = np.maximum(x0, x1), np.minimum(x0, x1)
        hi23, lo23 = np.maximum(x2, x3), np.minimum(x2, x3)
        second = np.maximum(np.minimum(hi01, hi23), np.maximum(lo01, lo23))
        out[start : start + len(g)] = np.maximum(hi01, hi23).sum(-1, dtype=np.float64) + second.sum(
            -1, dtype=np.float64
        )
    return out


@functools.cache
def _partitions(stripes: int) -> tuple[np.ndarray, np.ndarray]:
    """All ways to split `4 * stripes` channels into groups of 4.

    Returns `(subsets [S, 4], partitions [P, stripes])`: every 4-subset of positions, and every
    partition as indices into `subsets`; partition 0 is the identity split.
    """
    n = 4 * stripes
    subsets = list(itertools.combinations(range(n), 4))
    index = {s: i for i, s in enumerate(subsets)}
    partitions = []

    def split(rest: tuple[int, ...], acc: list[int]) -> None:
        if not rest:
            partitions.append(acc)
            return
        for others in itertools.combinations(rest[1:], 3):
            group = (rest[0], *others)
            split(tuple(c for c in rest if c not in group), acc + [index[group]])

    split(tuple(range(n)), [])
    return np.array(subsets), np.array(partitions)


class _GroupScores:
    """Kept magnitude of 4-channel groups, memoized in a dense table when it fits.

    A group's score depends only on its set of channels, so the stripe-group search (which sees
    the same sets again and again) looks most of them up instead of recomputing them. Groups are
    keyed by the combinatorial number system over their sorted channels.
    """

    MAX_TABLE = 4_000_000  # entries (32 MB): up to ~100 channels

    def __init__(self, at: np.ndarray):
        self.at = at
        c = at.shape[0]
        self.table = None
        if math.comb(c, 4) <= self.MAX_TABLE:
            self.table = np.full(math.comb(c, 4), np.nan)
            self.binom = np.array([[math.comb(x, k) for x in range(c)] for k in range(5)], dtype=np.int64)

    def __call__(self, groups: np.ndarray, presorted: bool = False) -> np.ndarray:
        if self.table is None:
            return _top2_sum(self.at, groups)
        g = groups if presorted else np.sort(groups, axis=-1)
        keys = (self.binom[1][g[..., 0]] + self.binom[2][g[..., 1]] + self.binom[3][g[..., 2]]
                + self.binom[4][g[..., 3]])
        values = self.table[keys]
        missing = np.isnan(values)
        if missing.any():
            new_keys, first = np.unique(keys[missing], return_index=True)
            self.table[new_keys] = _top2_sum(self.at, g[missing][first])
            values = self.table[keys]
        return values


class _Search:
    """Iterated local search for a channel order of `at` `[channels, rows]`.

    Local search: for every set of 2 (and, when affordable, 3) stripes of 4 channels, try every
    re-partition of their 8 (12) channels into stripes and apply the best disjoint gains, until
    none is left (apex ASP's stripe-group neighbourhood). Gains of stripe sets whose channels did
    not change are kept between rounds, so a round costs only what changed. Escape: shuffle the
    channels of a few random stripes of the best order found ("kick"), search again, keep it if
    better.
    """

    def __init__(self, at: np.ndarray, rng: np.random.Generator):
        self.at = at
        self.rng = rng
        stripes = at.shape[0] // 4
        self.perm = np.arange(at.shape[0])
        self.group_scores = _GroupScores(at)
        # Three-stripe sets are exact but cubic in the stripe count; pairs scale to wide layers.
        widths = [k for k in (2, 3) if k <= stripes and (k == 2 or stripes <= 24)]
        self.neighbourhoods = []
        for k in widths:
            combos = np.array(list(itertools.combinations(range(stripes), k)))
            self.neighbourhoods.append(
                {"k": k, "combos": combos, "gain": np.zeros(len(combos)), "best": np.zeros(len(combos), np.int64),
                 "seen": np.full((stripes, 4), -1)}
            )

    def score(self) -> float:
        return float(self.group_scores(self.perm.reshape(-1, 4)).sum())

    def _refresh(self, hood: dict) -> None:
        """Recomputes the best re-partition of every stripe set whose channels changed."""
        stripes = self.perm.reshape(-1, 4)
        current = np.sort(stripes, axis=1)
        changed = np.any(current != hood["seen"], axis=1)
        if not changed.any():
            return
        hood["seen"] = current
        stripe_scores = self.group_scores(current)
        subsets, partitions = _partitions(hood["k"])
        combos = hood["combos"]
        todo = np.nonzero(changed[combos].any(axis=1))[0]
        per_chunk = max(1, 65536 // len(subsets))
        for s in range(0, len(todo), per_chunk):
            t = todo[s : s + per_chunk]
            # Sorted channels make every subset's channels ascending: the table key needs no sort.
            cols = np.sort(current[combos[t]].reshape(len(t), -1), axis=1)
            kept = self.group_scores(cols[:, subsets], presorted=True)  # [t, subsets] float64
            # float32 is enough to pick the best partition; its gain is then summed in float64.
            kept32 = kept.astype(np.float32)
            totals = kept32[:, partitions[:, 0]]
            for j in range(1, hood["k"]):
                totals += kept32[:, partitions[:, j]]
            best = totals.argmax(axis=1)
            hood["best"][t] = best
            new = np.take_along_axis(kept, partitions[best], axis=1).sum(axis=1)
            hood["gain"][t] = new - stripe_scores[combos[t]].sum(axis=1)

    def _improve(self, hood: dict) -> bool:
        """One round: applies the best disjoint re-partitions with positive gain."""
        self._refresh(hood)
        subsets, partitions = _partitions(hood["k"])
        stripes = self.perm.reshape(-1, 4)  # a view: edits below change self.perm
        used = np.zeros(len(stripes), dtype=bool)
        for t in np.argsort(-hood["gain"], kind="stable"):
            if hood["gain"][t] <= _EPS:
                break
            members = hood["combos"][t]
            if used[members].any():
                continue
            cols = np.sort(stripes[members].reshape(-1))
            stripes[members] = cols[subsets[partitions[hood["best"][t]]]]
            used[members] = True
        return bool(used.any())

    def local_search(self) -> None:
        """Applies stripe-set re-partitions until no set of 2 or 3 stripes can gain."""
        # Cheap pairs to convergence first; a costlier 3-stripe round only when pairs are stuck.
        level = 0
        while level < len(self.neighbourhoods):
            level = 0 if self._improve(self.neighbourhoods[level]) else level + 1

    def iterate(self, kicks: int, bar=None) -> None:
        """Local search, then `kicks` rounds of shuffle-and-search from the best order found."""
        self.local_search()
        best, best_perm = self.score(), self.perm.copy()
        stripes = len(self.perm) // 4
        shuffled = min(6, stripes)
        for _ in range(kicks):
            perm = best_perm.copy().reshape(stripes, 4)
            chosen = self.rng.choice(stripes, shuffled, replace=False)
            perm[chosen] = self.rng.permutation(perm[chosen].reshape(-1)).reshape(shuffled, 4)
            self.perm = perm.reshape(-1)
            self.local_search()
            score = self.score()
            if score > best + _EPS:
                best, best_perm = score, self.perm.copy()
            if bar is not None:
                bar.update(1)
        self.perm = best_perm


def default_kicks(channels: int) -> int:
    """Escape budget: 40 kicks (~4 s CPU for 64 channels), fewer for wide layers."""
    return 40 if channels <= 96 else max(8, 40 * 96 // channels)


def search_permutation(
    weight: np.ndarray,
    axis: int = 0,
    *,
    kicks: int | None = None,
    seed: int = 0,
    progress: bool = False,
    block_channels: int | None = 512,
) -> np.ndarray:
    """Finds an order of `weight`'s channels along `axis` that keeps more magnitude under 2:4.

    Args:
        weight: a kernel in Keras layout; `axis` is its grouping (input-channel) axis, e.g. 0 for a
            Dense kernel `[in, out]`, 2 for a Conv2D kernel `[h, w, in, out]`.
        axis: the channel axis (groups of 4 consecutive channels along it).
        kicks: escape rounds after the first local search of each block (None =
            `default_kicks(block size)`; 0 = plain local search, close to ASP's
            "optimize_stripe_groups" strategy).
        seed: seed of the kicks' and blocks' random generator (the result is deterministic given
            it).
        progress: show a tqdm progress bar over the kicks.
        block_channels: wider weights are searched in random blocks of about this many channels
            (whole groups of 4), each on its own: one search costs about channels^2 x rows,
            blocks make it linear in channels for a little less gain (docs/ACCURACY.md: 2048
            channels x 1024 rows, 88 s and 16.3% efficacy in one search, 30 s and 15.1% in
            blocks). None: one search over all.

    Returns:
        `perm` (int64 `[channels]`) such that `np.take(weight, perm, axis)` keeps at least as much
        magnitude under 2:4 as `weight` (the identity is the starting point and every accepted step
        gains).

    Raises:
        ValueError: if `weight.shape[axis]` is not a multiple of 4, the weight has NaN/Inf, or
            `block_channels` < 8.

    Example:
        >>> w = np.random.default_rng(0).normal(size=(64, 32))
        >>> perm = search_permutation(w, axis=0, kicks=5)
        >>> kept_magnitude(w.T, perm) >= kept_magnitude(w.T)
        True
    """
    w = np.asarray(weight)
    if w.ndim == 0 or not -w.ndim <= axis < w.ndim:
        raise ValueError(f"Axis {axis} is out of range for a weight with shape {w.shape}.")
    channels = w.shape[axis]
    if channels % 4:
        raise ValueError(
            f"Weight with shape {w.shape} has {channels} channels along axis {axis}, not a multiple "
            "of 4: it cannot be grouped for 2:4."
        )
    if not np.all(np.isfinite(w)):
        raise ValueError(f"Weight with shape {w.shape} contains NaN/Inf; cannot search a permutation.")
    if block_channels is not None and block_channels < 8:
        raise ValueError(f"block_channels must be at least 8 (two groups). Received: {block_channels}")
    # Scaled to a largest |w| of 1: the order is the same, sums of huge weights cannot overflow
    # float32 (inf - inf gains never stop the search), and _EPS is relative to the weight's scale.
    magnitudes = np.abs(channel_matrix(w, axis))
    peak = magnitudes.max(initial=0.0)
    at = np.ascontiguousarray((magnitudes / peak if peak > 0 else magnitudes).T, dtype=np.float32)
    rng = np.random.default_rng(seed)
    if channels <= 4:
        return np.arange(channels)
    blocks = _blocks(channels, block_channels, rng)
    per_block = default_kicks(len(blocks[0])) if kicks is None else kicks
    bar = None
    if progress:
        bar = tqdm(total=per_block * len(blocks), desc=f"permutation search ({channels} channels)",
                   unit="kick", leave=False)
    perm = np.arange(channels)
    try:
        for block in blocks:
            search = _Search(at[block], rng)
            search.iterate(per_block, bar=bar)
            perm[block] = block[search.perm]
    finally:
        if bar is not None:
            bar.close()
    return perm


def _blocks(channels: int, block_channels: int | None, rng: np.random.Generator) -> list[np.ndarray]:
    """Channel positions searched together: all of them, or random blocks of whole 4-channel groups.

    Blocks are random so that a block mixes channels from everywhere in the layer; the search
    inside one re-partitions its channels among its own group positions, so blocks never interact.
    """
    if block_channels is None or channels <= block_channels:
        return [np.arange(channels)]
    groups = rng.permutation(channels // 4)
    count = math.ceil(channels / block_channels)  # near-equal blocks, none of a lone group
    return [np.sort(np.concatenate([4 * chunk + offset for offset in range(4)]))
            for chunk in np.array_split(groups, count)]


# ----------------------------------------------------------------------------------------------
# Applying permutations to a Keras model.

# Layers that commute with any channel permutation (elementwise, per-channel, or symmetric over
# channels) and so may sit between a producer and its consumers. Names of public Keras classes.
_PASS_THROUGH = {
    "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Dropout", "SpatialDropout1D",
    "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "GaussianDropout", "AlphaDropout",
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
    "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D", "ZeroPadding1D",
    "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D", "UpSampling1D",
    "UpSampling2D", "UpSampling3D",
}  # fmt: skip
# Elementwise merge layers: commute with a permutation applied to all their inputs alike.
_MERGE = {"Add", "Subtract", "Average", "Maximum", "Minimum", "Multiply"}
# Keras ops (`x * 0.5`, `keras.ops.relu(x)`, `x + y` in a Functional model) that act element by
# element: they commute with a permutation of their tensor inputs when every other argument is the
# same for all channels (a scalar, or an array whose last axis is 1).
_ELEMENTWISE_OPS = {
    # keras.ops (numpy)
    "Abs", "Absolute", "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "DivideNoNan",
    "Maximum", "Minimum", "Power", "Negative", "Square", "Sqrt", "Cbrt", "Exp", "Exp2", "Expm1",
    "Log", "Log1p", "Log2", "Log10", "Sign", "Clip", "Tanh", "Sin", "Cos", "Reciprocal", "Floor",
    "Ceil", "Round", "Trunc", "NanToNum", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
    "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "LogicalXor",
    # keras.ops (nn, math, core)
    "Relu", "Relu6", "Sigmoid", "HardSigmoid", "HardSilu", "Silu", "Gelu", "Elu", "Selu", "Celu",
    "Softplus", "Softsign", "LeakyRelu", "LogSigmoid", "HardTanh", "SoftShrink", "HardShrink",
    "TanhShrink", "Squareplus", "SparsePlus", "SparseSigmoid", "Threshold", "Erf", "Erfc", "Rsqrt",
    "Cast", "StopGradient",
}  # fmt: skip
_CHANNEL_SOFTMAX_OPS = {"Softmax", "LogSoftmax"}  # symmetric over the channels when axis=-1
_PER_CHANNEL = {  # [C] weights; an adapted Normalization computes from them once refreshed
    "BatchNormalization", "LayerNormalization", "RMSNormalization", "Normalization",
}  # fmt: skip
# Per-channel spatial filters (depth_multiplier 1): kernel [..., C, 1] and bias [C], permuted too.
_DEPTHWISE = {"DepthwiseConv1D", "DepthwiseConv2D"}
# Depthwise then pointwise: depthwise_kernel [..., C, m], pointwise_kernel [..., C * m, out].
_SEPARABLE = {"SeparableConv1D", "SeparableConv2D"}
_KERNEL_LAYERS = {"Dense", "Conv1D", "Conv2D", "Conv3D"}  # producers and consumers
_MODEL_INPUT = "<model input>"  # source of a Sequential model's first layer


@dataclasses.dataclass
class PermutationReport:
    """What `permute` did for one channel space: the layers that produce the same channels (several
    when a residual add or product joins branches) and the layers that consume them.

    `producer` is the first of `producers` (None when there is none). `kept_before`/`kept_after`
    are the |w| the consumers' kernels keep under 2:4; `efficacy` is ASP's metric in percent (None
    when skipped).

    `heads` > 0 marks the space inside one attention layer (producer and consumer): the output
    channels of its value projection, read by its output projection, reordered within each of its
    `heads` value heads (`channels` per head; the figures sum over the heads).
    """

    producer: str | None
    consumers: tuple[str, ...]
    channels: int
    permuted: bool
    reason: str = ""
    kept_before: float = 0.0
    kept_after: float = 0.0
    efficacy: float | None = None
    producers: tuple[str, ...] = ()
    heads: int = 0

    @property
    def gain_percent(self) -> float:
        """Relative increase of the magnitude kept by 2:4, in percent."""
        return 100.0 * (self.kept_after / self.kept_before - 1.0) if self.kept_before else 0.0


class _Graph(NamedTuple):
    """A model's top-level graph by operation name: its layers and keras ops (`x[:, :16]`)."""

    ops: dict[str, keras.Operation]
    inputs: dict[str, list[list[str]]]  # per call of an operation, the names of what it reads
    widths: dict[str, list[int | None]]  # channels (last axis) of each input of its first call
    calls: dict[str, dict]  # its first call's serialized arguments (Functional models only)
    consumers: dict[str, list[str]]  # the operations that read each one's output
    outputs: set[str]  # operations whose output is a model output
    hidden: set[str]  # layers also used inside another layer (a nested model): calls not seen here
    probed: dict[str, bool]  # `_probe` results by 'name:carries' / 'name:produces', filled as asked
    unfollowed: dict[str, str]  # custom layers whose call was not followed, and why
    followed: list[str]  # custom layers whose call was followed (their graph inlined)
    input_names: list[str]  # a Functional model's input layers, in order ([] for Sequential)


def _tensor_specs(obj) -> list[dict]:
    """The serialized Keras tensors (`shape`, `keras_history`, ...) in a serialized call's
    arguments, in order."""
    if isinstance(obj, dict):
        if obj.get("class_name") == "__keras_tensor__":
            return [obj["config"]]
        return [t for v in obj.values() for t in _tensor_specs(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensor_specs(v)]
    return []


def _constants(node: dict) -> list:
    """The top-level arguments of a serialized call other than its Keras tensors and lists of
    them (`concatenate([a, b])`)."""

    def tensors(value) -> bool:
        if isinstance(value, (list, tuple)):
            return bool(value) and all(map(tensors, value))
        return isinstance(value, dict) and value.get("class_name") == "__keras_tensor__"

    return [v for v in [*node.get("args", []), *node.get("kwargs", {}).values()] if not tensors(v)]


def _output_names(spec) -> list[str]:
    """Names in a Functional config's `output_layers`: `[name, node, tensor]` triples, nested in
    lists and dicts."""
    if isinstance(spec, dict):
        return [n for v in spec.values() for n in _output_names(v)]
    if len(spec) == 3 and isinstance(spec[0], str):
        return [spec[0]]
    return [n for v in spec for n in _output_names(v)]


def _graph(model: keras.Model, follow: bool = True) -> _Graph:
    """The top-level graph of a Functional (from its public config) or Sequential model (`follow`:
    custom layers' calls are followed, see `_inline_models`).

    Raises:
        TypeError: for models without a layer graph (subclassed models).
    """
    if isinstance(model, keras.Sequential):
        ops = {layer.name: layer for layer in model.layers}
        names = [layer.name for layer in model.layers]
        inputs: dict[str, list[list[str]]] = {}
        for source, name in zip([_MODEL_INPUT, *names], names):
            inputs.setdefault(name, []).append([source])  # a layer used twice: two calls
        widths = {layer.name: [layer.input.shape[-1] if layer.built else None]
                  for layer in model.layers}
        calls = {}
        outputs = set(names[-1:])
        input_names = []
    elif is_functional(model):
        try:
            config = model.get_config()
            if "layers" not in config:  # a subclass with its own config (keras_hub): same graph
                config = keras.Model(model.input, model.output, name=model.name).get_config()
        except Exception as error:  # Keras raises several kinds here
            raise TypeError(
                f"permute() reads the graph of model {model.name!r} from its config, and "
                f"get_config() failed: {type(error).__name__}: {error}") from error
        ops = {op.name: op for op in model.operations}
        tensors = {spec["name"]: [_tensor_specs(node) for node in spec.get("inbound_nodes", [])]
                   for spec in config["layers"]}
        inputs = {name: [[t["keras_history"][0] for t in call] for call in node_specs]
                  for name, node_specs in tensors.items()}
        widths = {name: [t["shape"][-1] if t["shape"] else None for t in node_specs[0]]
                  for name, node_specs in tensors.items() if node_specs}
        calls = {spec["name"]: spec["inbound_nodes"][0] for spec in config["layers"]
                 if spec.get("inbound_nodes")}
        outputs = set(_output_names(config["output_layers"]))
        input_names = _output_names(config["input_layers"])
    else:
        raise TypeError(
            "permute() needs a Functional or Sequential keras.Model (it reads the layer graph). "
            f"Received: {type(model).__name__}"
        )
    ops, inlined, hidden, unfollowed, followed = _inline_models(ops, inputs, widths, calls,
                                                                outputs, follow)
    # A layer inside two inlined models appears under two names: shared, as a layer called twice.
    repeated = {i for i, n in collections.Counter(map(id, ops.values())).items() if n > 1}
    hidden |= {name for name, op in ops.items() if id(op) in repeated}
    consumers: dict[str, list[str]] = {name: [] for name in inputs}
    for name, nodes in inputs.items():
        for node in nodes:
            for source in node:
                consumers.setdefault(source, []).append(name)
    inside = {id(sub) for layer in model.layers if id(layer) not in inlined
              for sub in walk_layers(layer)}
    hidden |= {name for name, op in ops.items() if id(op) in inside}
    return _Graph(ops, inputs, widths, calls, consumers, outputs, hidden, {}, unfollowed,
                  followed, input_names)


def _inline_models(
    ops: dict, inputs: dict, widths: dict, calls: dict, outputs: set, follow: bool
) -> tuple[dict, set[int], set[str], dict[str, str], list[str]]:
    """Replaces by its own graph, its layers named 'outer/inner', so that channel spaces run
    through it: each nested model (Sequential or Functional) that is called once on one tensor (a
    Functional one also on a list of tensors), has one output and shares no layer with the graph
    around it (a keras.applications base model
    inside a transfer-learning model; ConvNeXt's stem and downsampling blocks), and each custom
    layer whose call can be followed (`_traced_graph`: a transformer block written as a Layer),
    if `follow`.
    Updates inputs, widths, calls and outputs in place; returns the new ops (graph order kept),
    the ids of the models and layers inlined, the names of their hidden (shared) layers, by name,
    why the calls of the custom layers left as they are were not followed, and the names of
    those followed."""
    top = {id(op) for op in ops.values()}
    new_ops, inlined, hidden, unfollowed, followed = {}, set(), set(), {}, []
    for name, op in ops.items():
        sub = _inlinable_graph(op, inputs.get(name, []), top, follow)
        sources = inputs[name][0] if sub is not None else []
        if sub is None and follow and _is_custom_layer(op):
            sub, sources, why = _traced_graph(op, inputs.get(name, []), top)
            if why:
                unfollowed[name] = why
        if sub is None:
            new_ops[name] = op
            continue
        # Where the inner graph starts: the outer graph's sources of the model's or layer's inputs.
        starts = dict(zip(sub.input_names, sources)) if sub.input_names else {
            n: sources[0] for n, o in sub.ops.items() if isinstance(o, keras.layers.InputLayer)}
        starts[_MODEL_INPUT] = sources[0]
        inputs.pop(name)
        unfollowed.update({f"{name}/{n}": why for n, why in sub.unfollowed.items()})
        followed += [name] * _is_custom_layer(op) + [f"{name}/{n}" for n in sub.followed]

        def path(n: str, name=name, starts=starts) -> str:
            return starts.get(n, f"{name}/{n}")

        for n, sub_op in sub.ops.items():
            if n not in starts:
                new_ops[path(n)] = sub_op
                inputs[path(n)] = [[path(s) for s in node] for node in sub.inputs.get(n, [])]
                if n in sub.widths:
                    widths[path(n)] = sub.widths[n]
                if n in sub.calls:
                    calls[path(n)] = sub.calls[n]
        hidden |= {path(n) for n in sub.hidden if n not in starts}
        last = path(next(iter(sub.outputs)))
        for nodes in inputs.values():  # its readers now read its output layer
            for node in nodes:
                node[:] = [last if s == name else s for s in node]
        if name in outputs:
            outputs.remove(name)
            outputs.add(last)
        widths.pop(name, None)
        calls.pop(name, None)
        inlined.add(id(op))
    return new_ops, inlined, hidden, unfollowed, followed


def _inlinable_graph(op, calls: list[list[str]], top: set[int], follow: bool) -> _Graph | None:
    """The graph of `op` if `_inline_models` can put it in place of `op` (called once (`calls`: the
    sources of each call) on one tensor or, a Functional model, on a list of its inputs, one output
    that is not its input, no layer shared with the graph around it whose op ids are `top`); else
    None."""
    if not (isinstance(op, keras.Model) and op.built and len(calls) == 1
            and isinstance(op.output, keras.KerasTensor)
            and (len(calls[0]) == 1 and (isinstance(op, keras.Sequential) or len(op.inputs) == 1)
                 or not isinstance(op, keras.Sequential) and isinstance(op.input, (list, tuple))
                 and len(op.inputs) == len(calls[0]))
            and not any(id(layer) in top for layer in walk_layers(op))):
        return None
    try:
        sub = _graph(op, follow)
    except TypeError:  # a subclassed model: no graph to follow
        return None
    (last,) = sub.outputs if len(sub.outputs) == 1 else (None,)
    if last is None or last == _MODEL_INPUT or isinstance(sub.ops.get(last),
                                                           keras.layers.InputLayer):
        return None
    return sub


def _is_custom_layer(op) -> bool:
    """Whether `op` is a user's layer (not Keras' own class, a model or a wrapper): one whose
    `call` permute() can only learn by following it."""
    return (isinstance(op, keras.layers.Layer) and not _keras_kind(op)
            and not isinstance(op, (keras.Model, Sparse24)))


def _traced_graph(
    layer: keras.layers.Layer, calls: list[list[str]], top: set[int]
) -> tuple[_Graph | None, list[str], str]:
    """The graph of a custom layer's `call`, followed by running it on symbolic inputs shaped like
    its call in the model, so that its sublayers (attention, Dense, normalization) and keras ops
    record what they read (Keras' examples' TransformerBlock, keras_hub's TransformerEncoder); the
    outer graph's sources of its tensor inputs, in order; and why not ('' when it is followed, or
    when it holds no sublayers: such a layer is left to the trial run, `_probe`).

    Followed only when the layer is called once, holds no weights of its own and reads no weight
    of its sublayers outside their calls (the trace would hold them as constants: a tied `x @
    self.dense.kernel`), shares no sublayer with the graph around it (whose op ids are `top`), has
    every sublayer built (the caller's model is not to change), takes no Keras mask, returns one
    tensor, runs every sublayer with weights on what comes from its inputs, computes alike at
    other lengths of its unknown dimensions (no Python branch on a shape) and, if it takes
    `training`, in training mode (no branch that only training runs). What the traces add to the
    layers `_restoring_layers` takes out again.
    """
    subs = walk_layers(layer)
    if not layer.built or not subs:
        return None, [], ""
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(calls) != 1 or len(nodes) != 1:
        return None, [], "it is called more than once"
    if own_variables(layer):
        return None, [], "it has weights of its own"
    if any(id(sub) in top for sub in subs):
        return None, [], "a layer inside it is also used around it"
    if unbuilt := [sub.name for sub in subs if not sub.built]:
        return None, [], (f"the layers {unbuilt} inside it are not built (following its call "
                          "would build them)")
    params = inspect.signature(layer.call).parameters
    if "mask" in params:
        return None, [], "its call takes a Keras mask"
    own = {id(sub) for sub in subs}
    traces, error, reads = [], None, _EagerReads()
    with reads:
        # As recorded, then with unknown dimensions set (calls that need them: GPT-2's), twice.
        for unknown in (None, 8, 13):
            try:
                trace = _trace(layer, nodes[0].arguments, unknown, training=False)
                traces.append((unknown, trace, _graph(trace)))
            except Exception as err:  # noqa: BLE001 - Keras and the layer's code raise any kind
                error = error or err
        if not traces:
            return None, [], f"its call could not be followed ({type(error).__name__}: {error})"
        unknown, trace, sub = traces[0]
        if "training" in params:
            try:
                training = _graph(_trace(layer, nodes[0].arguments, unknown, training=True))
            except Exception as err:  # noqa: BLE001
                return None, [], (f"its call in training mode could not be followed "
                                  f"({type(err).__name__}: {err})")
    if not isinstance(trace.output, keras.KerasTensor):
        return None, [], "its call does not return one tensor"
    if len(trace.inputs) != len(calls[0]):
        return None, [], "its tensor inputs could not be matched to the model's"
    if any(_signature(g, own) != _signature(sub, own) for _, _, g in traces[1:]):
        return None, [], "it computes otherwise at other input lengths (a branch on a shape)"
    if "training" in params and _signature(training, own, True) != _signature(sub, own, True):
        return None, [], "it computes otherwise when training"
    weights = {id(v) for sub in subs for v in sub.weights}
    if read := [v.path for i, v in reads.variables.items() if i in weights]:
        return None, [], f"its call reads the weights {read} outside the layers that hold them"
    traced = {id(x) for op in trace.operations for x in [op, *walk_layers(op)]}
    if outside := [sub.name for sub in subs if sub.weights and id(sub) not in traced]:
        # Run on constants (a position table looked up at `arange(length)`): what they add is
        # invisible to the trace.
        return None, [], f"the layers {outside} inside it do not run on its inputs"
    (last,) = sub.outputs
    if isinstance(sub.ops.get(last), keras.layers.InputLayer):
        return None, [], ""
    return sub, calls[0], ""


class _EagerReads(keras.StatelessScope):
    """While active, records the variables read eagerly: by a custom layer's own code during a
    trace (`keras.ops.transpose(self.dense.kernel)`), not by a sublayer's symbolic call, whose
    reads happen in a graph. Values are read as stored; assignments are dropped."""

    def __init__(self):
        super().__init__()
        self.variables: dict[int, keras.Variable] = {}

    def get_current_value(self, variable):
        if tf.executing_eagerly():
            self.variables[id(variable)] = variable
        # No value given: the variable reads its own.


def _signature(graph: _Graph, own: set[int], settings: bool = False) -> list:
    """What a traced graph computes, in terms that do not depend on the trace: per operation in
    graph order, the sublayer (ids in `own`) or the class of anything else, and the positions of
    what it reads; with `settings`, also the other operations' settings and every operation's
    constant arguments other than `training` (a branch that changes an op's axis or constant)."""
    position = {name: i for i, name in enumerate(graph.ops)}

    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value if isinstance(value, (str, int, float, bool, type(None))) else type(value)

    out = []
    for name, op in graph.ops.items():
        entry = [id(op) if id(op) in own else type(op).__name__,
                 [[position.get(s, s) for s in call] for call in graph.inputs.get(name, [])]]
        if settings and not isinstance(op, keras.layers.InputLayer):
            config = {} if id(op) in own else (
                op.get_config() if isinstance(op, keras.layers.Layer) else vars(op))
            call = graph.calls.get(name, {})
            entry += [plain({k: v for k, v in config.items() if k != "name"
                             and not k.startswith("_")}),
                      plain(_constants({"args": call.get("args", []), "kwargs": {
                          k: v for k, v in call.get("kwargs", {}).items() if k != "training"}}))]
        out.append(entry)
    return out


def _trace(layer: keras.layers.Layer, arguments, unknown: int | None, training: bool):
    """A Functional model of `layer.call` run on symbolic inputs like `arguments` (its call's in
    the model; `unknown`: see `symbolic_arguments`), in training mode if `training`."""
    args, kwargs, inputs = symbolic_arguments(arguments, unknown)
    if training:
        kwargs["training"] = True
    return keras.Model(inputs, layer.call(*args, **kwargs))


@contextlib.contextmanager
def _restoring_layers(model: keras.Model):
    """Leaves the attributes of every layer of `model` as they were (lists and dicts: their
    contents): `_traced_graph` runs custom layers' calls, which add Keras nodes (the record of
    symbolic calls) to their sublayers and may set attributes (`self.last_scores = scores`), and
    `_difference` calls the model (losses). Variables are left alone by those calls'
    stateless scopes."""
    layers = [model, *walk_layers(model)]
    before = []
    for layer in layers:  # lists and dicts (nodes, losses) are changed in place: their contents
        attributes = dict(vars(layer))
        contents = {k: list(v) if isinstance(v, list) else dict(v) for k, v in attributes.items()
                    if isinstance(v, (list, dict))  # and plain or Keras' (not TF's wrappers)
                    and type(v).__module__.split(".")[0] in ("builtins", "keras")}
        before.append((attributes, contents))
    try:
        yield
    finally:
        for layer, (attributes, contents) in zip(layers, before):
            state = vars(layer)
            for key in state.keys() - attributes.keys():
                del state[key]
            state.update(attributes)
            for key, content in contents.items():  # base methods: Keras' tracked ones are locked
                if isinstance(content, list):
                    list.__setitem__(attributes[key], slice(None), content)
                else:
                    dict.clear(attributes[key])
                    dict.update(attributes[key], content)


def _keras_kind(op) -> str:
    """The class name of `op` if its class is Keras' own (`Dense`, the keras op `Add`), else '':
    a user's class, even one named like a Keras class or derived from one, may compute anything,
    so the rules here never apply to it (it may still pass the trial run, `_probe`)."""
    cls = type(op)
    return cls.__name__ if cls.__module__.startswith("keras.") else ""


def _describe(name: str, op) -> str:
    """`'name' (Class)`, or `'name' (keras op Class)` for an operation that is not a layer; `name`
    is the graph's ('outer/inner' inside an inlined model)."""
    kind = type(op).__name__
    return f"{name!r} ({kind if isinstance(op, keras.layers.Layer) else 'keras op ' + kind})"


def _shared(graph: _Graph, name: str) -> str:
    """Why `name`'s channels cannot be followed through it ('' when they can): it is called more
    than once, is also used inside another layer, or combines several inputs other than channel by
    channel (an elementwise merge or op), by a concatenation along the channels or with kernels
    (attention layers)."""
    nodes = graph.inputs.get(name, [])
    if len(nodes) > 1:
        return f"is shared (called {len(nodes)} times)"
    if name in graph.hidden:
        return "is shared (also used inside a nested model)"
    if len(nodes) == 1 and len(nodes[0]) != 1 and not (
            _reads(graph.ops[name]) or _writes(graph.ops[name]) or _carrying(graph, name)
            or _segments(graph, name)):
        return "combines several inputs other than channel by channel"
    return ""


class _Axis(NamedTuple):
    """A weight axis whose entries follow a channel space's order."""

    variable: keras.Variable
    axis: int
    grouped: bool = True  # its 2:4 groups run along it: its rows enter the search


# Attention layers (Keras' own): projections read the residual stream, value heads are permuted.
_ATTENTION = {"MultiHeadAttention", "GroupedQueryAttention"}  # keras.layers.GroupQueryAttention


def _projections(layer) -> dict:
    """An attention layer's EinsumDense projections by role: query, key, value, output, and
    GroupQueryAttention's gate when it has one (that class keeps them in private attributes)."""
    if _keras_kind(layer) == "MultiHeadAttention":
        return {"query": layer.query_dense, "key": layer.key_dense, "value": layer.value_dense,
                "output": layer.output_dense}
    parts = {"query": layer._query_dense, "key": layer._key_dense, "value": layer._value_dense,
             "output": layer._output_dense}
    if layer.use_gate:  # sigmoid(gate(query)) multiplies each head's output, channel by channel
        parts["gate"] = layer._gate_dense
    return parts


def _einsum_reads(layer) -> _Axis | None:
    """The kernel axis an EinsumDense contracts with its input's last axis (`abc,cd->abd`: axis
    0), if its 2:4 groups run along it (`registry.einsum_axis`)."""
    parts = einsum_parts(layer.equation)
    if parts is None:
        return None
    inputs, kernel, output = parts
    c = inputs[-1]
    if c == "." or inputs.count(c) != 1 or kernel.count(c) != 1 or c in output:
        return None
    axis = kernel.index(c)
    return _Axis(layer.kernel, axis) if einsum_axis(layer.equation) == axis else None


def _einsum_writes(layer) -> list[_Axis]:
    """The kernel axis (and bias axis) that an EinsumDense's output's last axis comes from alone
    (`abc,cd->abd`: kernel axis 1, bias axis 0); [] when there is none."""
    parts = einsum_parts(layer.equation)
    if parts is None:
        return []
    inputs, kernel, output = parts
    c = output[-1]
    if c == "." or output.count(c) != 1 or kernel.count(c) != 1 or c in inputs:
        return []
    axes = [_Axis(layer.kernel, kernel.index(c))]
    if layer.bias is not None and c in (layer.bias_axes or ""):  # bias [..., C]; else [..., 1]
        axes.append(_Axis(layer.bias, layer.bias.ndim - 1))
    return axes


def _built_channels_last(layer) -> bool:
    """Whether `layer` is built and keeps its channels last (the only layout permute() reorders)."""
    return (getattr(layer, "built", False)
            and getattr(layer, "data_format", "channels_last") == "channels_last")


def _reads(layer) -> dict[str, list[_Axis]]:
    """How `layer` reads each of its inputs' channels, by call argument: the weight axes that
    run along them (the `grouped` ones, whose 2:4 groups run along them, are searched; the others
    are reordered with them); {} if permute() cannot reorder them.

    Dense/ConvND (channels_last, groups=1): kernel axis -2. SeparableConv (depth_multiplier 1): its
    pointwise kernel, and its depthwise filters (not grouped). EinsumDense: the kernel axis
    contracted with the input's last axis. MultiHeadAttention and GroupQueryAttention: that axis of
    their query (and gate), key and value projections.
    """
    kind = _keras_kind(layer) if _built_channels_last(layer) else ""
    if kind in _KERNEL_LAYERS and getattr(layer, "groups", 1) == 1:
        return {"inputs": [_Axis(layer.kernel, layer.kernel.ndim - 2)]}
    if kind in _SEPARABLE and layer.depth_multiplier == 1:
        pointwise, depthwise = layer.pointwise_kernel, layer.depthwise_kernel  # [..., C, out|1]
        return {"inputs": [_Axis(pointwise, pointwise.ndim - 2),
                           _Axis(depthwise, depthwise.ndim - 2, grouped=False)]}
    if kind == "EinsumDense":
        axis = _einsum_reads(layer)
        return {"inputs": [axis]} if axis else {}
    if kind in _ATTENTION:
        parts = _projections(layer)
        axes = {role: _einsum_reads(parts[role]) for role in ("query", "key", "value", "gate")
                if role in parts}
        if not all(axes.values()):
            return {}
        reads = {role: [axes[role]] for role in ("query", "key", "value")}
        reads["query"] += [axes["gate"]] if "gate" in axes else []
        return reads
    return {}


def _writes(layer) -> list[_Axis]:
    """The weight axes that `layer`'s output channels come from, the kernel's first; [] if
    permute() cannot reorder them.

    Dense/ConvND (channels_last, groups=1) and SeparableConv: the (pointwise) kernel's last axis and
    the bias. EinsumDense: the kernel axis (and bias axis) of the output's last axis.
    MultiHeadAttention and GroupQueryAttention: those of their output projection. Embedding: the
    table's last axis.
    """
    kind = _keras_kind(layer) if _built_channels_last(layer) else ""
    if (kind in _KERNEL_LAYERS and getattr(layer, "groups", 1) == 1) or kind in _SEPARABLE:
        kernel = layer.kernel if kind in _KERNEL_LAYERS else layer.pointwise_kernel
        bias = [_Axis(layer.bias, 0)] if layer.bias is not None else []
        return [_Axis(kernel, kernel.ndim - 1), *bias]
    if kind == "EinsumDense":
        return _einsum_writes(layer)
    if kind in _ATTENTION:
        return _einsum_writes(_projections(layer)["output"])
    if kind == "Embedding":
        return [_Axis(layer.embeddings, 1)]
    return []


def _roles(graph: _Graph, name: str) -> list[str]:
    """The call argument (parameter name) each input of `name`'s first call is passed as;
    [] when unknown."""
    op, call = graph.ops[name], graph.calls.get(name)
    sources = (graph.inputs.get(name) or [[]])[0]
    try:
        params = list(inspect.signature(op.call).parameters)
    except (TypeError, ValueError):
        return []
    if not call:  # a Sequential model's layer: its one input
        return params[:1] if len(sources) == 1 else []
    roles = []
    for i, arg in enumerate(call.get("args", [])):
        roles += [params[i] if i < len(params) else ""] * len(_tensor_specs(arg))
    for key, value in call.get("kwargs", {}).items():
        roles += [key] * len(_tensor_specs(value))
    return roles if len(roles) == len(sources) else []


def _argument_reads(graph: _Graph, name: str) -> list[tuple[str, ...]]:
    """For each input of `name`'s first call, the entries of `_reads` that read it: () for an input
    no kernel reads (an attention mask); an attention layer's value is also its key when no key
    is passed."""
    op = graph.ops[name]
    sources = (graph.inputs.get(name) or [[]])[0]
    reads = _reads(op)
    roles = _roles(graph, name) if reads else []
    if not roles:
        return [()] * len(sources)
    if _keras_kind(op) in _ATTENTION and "key" not in roles:
        return [("value", "key") if role == "value" else (role,) if role in reads else ()
                for role in roles]
    return [(role,) if role in reads else () for role in roles]


def _grouped_depthwise(layer) -> bool:
    """Whether `layer` is a ConvND with one group per channel (ConvNeXt's depthwise convolution:
    `Conv2D(C, 7, groups=C)`, kernel [..., 1, C]): per channel, like DepthwiseConv."""
    return (_keras_kind(layer) in _KERNEL_LAYERS - {"Dense"} and layer.built
            and layer.groups > 1 and layer.groups == layer.filters == layer.input.shape[-1])


def _passes(layer) -> bool:
    """Whether an unshared `layer` commutes with a permutation of its input's last axis."""
    kind = _keras_kind(layer)
    if not isinstance(layer, keras.layers.Layer):
        return False
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return False
    if kind in _DEPTHWISE:  # one filter per channel; a multiplier > 1 interleaves outputs
        return layer.depth_multiplier == 1
    if _grouped_depthwise(layer):
        return True
    if _constant_normalization(layer):
        return False  # constants, not weights: only a trial run can tell (`_probe`)
    if kind in (*_PER_CHANNEL, "Softmax"):  # normalizes over an axis: the channel axis only
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return list(axis) in ([-1], [len(layer.input.shape) - 1])
    if kind == "Reshape":  # keeps every channel's index when the last axis is left alone
        return layer.input.shape[-1] is not None and layer.input.shape[-1] == layer.output.shape[-1]
    return kind in _PASS_THROUGH


def _activation_commutes(layer) -> bool:
    """Whether `layer`'s `activation` (a producer's, an Activation layer's, a depthwise conv's)
    acts channel by channel: a Keras built-in other than glu (which halves the channels), or any
    other function (keras_hub's `gelu_approximate`) that passes a trial run: on random inputs of
    the layer's output shape, at two scales, reordering the channels by the transposition (0 1),
    the cycle (0 1 ... C-1) and a random permutation, which generate them all, reorders its output
    alike (GroupSort, which sorts within groups of channels, fails it)."""
    activation = getattr(layer, "activation", None)
    if activation is None:
        return True
    try:
        name = keras.activations.serialize(activation)
    except Exception:  # noqa: BLE001 - not serializable: not a built-in
        name = None
    if isinstance(name, str) and getattr(keras.activations, name, None) is activation:
        return name != "glu"
    rng = np.random.default_rng(0)
    try:
        shape = [3 if d is None else d for d in layer.output.shape]
        perms = _generating_permutations(shape[-1], rng)
        for scale in (1.0, 30.0):
            x = (scale * rng.normal(size=shape)).astype(layer.compute_dtype)
            expected = keras.ops.convert_to_numpy(activation(x)).astype("float64")
            tolerance = 1e-5 * max(1.0, float(np.abs(expected).max(initial=0.0)))
            if expected.shape != x.shape or not np.isfinite(expected).all() or not all(
                    np.allclose(keras.ops.convert_to_numpy(activation(x[..., p])),
                                expected[..., p], rtol=1e-5, atol=tolerance) for p in perms):
                return False
        return True
    except Exception:  # noqa: BLE001 - a function that cannot be tried is not followed
        return False


def _same_for_every_channel(value) -> bool:
    """Whether a constant argument or attribute of a keras op treats all channels alike: a scalar,
    a string or None, or an array whose last axis is 1 (serialized arrays included)."""
    if isinstance(value, dict) and value.get("class_name") == "__numpy__":
        value = np.asarray(value["config"]["value"])
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return True
    return isinstance(value, np.ndarray) and (value.ndim == 0 or value.shape[-1] == 1)


def _elementwise_op(graph: _Graph, name: str) -> bool:
    """Whether keras op `name` computes each channel from the same channel of its tensor inputs
    alone (see `_ELEMENTWISE_OPS`)."""
    op = graph.ops[name]
    kind = _keras_kind(op)
    if isinstance(op, keras.layers.Layer) or kind not in {*_ELEMENTWISE_OPS, *_CHANNEL_SOFTMAX_OPS}:
        return False
    attributes = {k: v for k, v in vars(op).items() if not k.startswith("_") and k != "name"}
    if kind in _CHANNEL_SOFTMAX_OPS:
        axis = attributes.pop("axis", None)
        if axis not in (-1, len(op.output.shape) - 1):
            return False
    constants = _constants(graph.calls.get(name, {}))
    return all(map(_same_for_every_channel, [*attributes.values(), *constants]))


def _carrying(graph: _Graph, name: str) -> list[int]:
    """Which inputs of `name` (positions in its first call) carry its output's channels, one to
    one, when `name` commutes with a permutation applied to them; [] when it does not.

    Pass-through layers: their input. Elementwise merge layers and keras ops: the inputs with the
    output's channel count; the others broadcast one channel over all (`x * gate`, gate
    `[..., 1]`) and are left alone.
    """
    op = graph.ops[name]
    if _passes(op):
        return [0]
    channels, widths = _output_channels(op), graph.widths.get(name, [])
    if channels is None or not widths or any(w not in (channels, 1) for w in widths):
        return []
    merges = isinstance(op, keras.layers.Layer) and _keras_kind(op) in _MERGE
    if merges or _elementwise_op(graph, name):
        return [i for i, w in enumerate(widths) if w == channels]
    if all(w == channels for w in widths) and _probe(graph, name):
        return list(range(len(widths)))
    return []


def _probe(graph: _Graph, name: str, produces: bool = False) -> bool:
    """Whether a layer permute() does not know acts channel by channel, found by running a copy of
    it (ConvNeXt's LayerScale `x * gamma`, InceptionResNetV2's CustomScaleLayer `a + b * s`); with
    `produces`, whether it makes its output channels from its weights alone, in their order (the
    Keras examples' TokenAndPositionEmbedding: token and position tables added).

    Only for layers whose weights all have C entries along their last axis (`[C]` vectors, a
    learned position table `[L, C]`; a producer needs one), or are scalars (ReZero's alpha, left
    as they are), and whose output has C channels (and,
    to act channel by channel, every input): the copy runs on random inputs, then on the same
    inputs with their channels reordered (not for `produces`) and its weights reordered alike along
    their last axis, for the permutations (0 1), (0 1 ... C-1), which generate all of them, and one
    at random; the outputs must differ only by that reordering. Anything that cannot be copied
    (from_config), run or compared counts as not channel by channel. Cached in `graph.probed`.
    """
    key = f"{name}:{'produces' if produces else 'carries'}"
    if key not in graph.probed:
        graph.probed[key] = _commutes_when_run(graph, name, move_inputs=not produces)
    return graph.probed[key]


def _commutes_when_run(graph: _Graph, name: str, move_inputs: bool) -> bool:
    layer, channels = graph.ops[name], _output_channels(graph.ops[name])
    if (channels is None or channels < 2 or not isinstance(layer, keras.layers.Layer)
            or isinstance(layer, (keras.Model, keras.layers.InputLayer)) or not layer.built
            or any(len(w.shape) and w.shape[-1] != channels for w in layer.weights)
            or not (move_inputs or any(len(w.shape) for w in layer.weights))):
        return False
    call = graph.calls.get(name, {})  # a Sequential layer: called on its one input
    kwargs, args = call.get("kwargs", {}), call.get("args", [])
    specs = _tensor_specs(call) if call else [{"shape": layer.input.shape,
                                               "dtype": layer.input.dtype}]
    packed = len(args) == 1 and isinstance(args[0], (list, tuple))  # layer([a, b])
    if not all(map(_same_for_every_channel, kwargs.values())) or (
            call and len(args[0] if packed else args) != len(specs)):  # a constant among them
        return False
    rng = np.random.default_rng(0)
    inputs = [_random_array([2 if d is None else d for d in spec["shape"]],
                            spec.get("dtype") or "float32", rng) for spec in specs]
    weights = [np.asarray(w) for w in layer.get_weights()]

    # A layer that takes `training` is tried in both modes (it might act otherwise in training).
    modes = [kwargs, *([{**kwargs, "training": True}] if "training" in inspect.signature(
        layer.call).parameters else [])]

    def run(copy, perm: np.ndarray, mode: dict) -> np.ndarray:
        moved = [x[..., perm] for x in inputs] if move_inputs else inputs
        if weights:  # scalars (ReZero's alpha) stay as they are
            copy.set_weights([w[..., perm] if w.ndim else w for w in weights])
            _refresh_statistics(copy)
        out = copy(moved, **mode) if packed else copy(*moved, **mode)
        return keras.ops.convert_to_numpy(out).astype("float64")

    try:
        copy = type(layer).from_config(layer.get_config())
        identity = np.arange(channels)
        if weights:  # built by a first call, so that its weights can be set
            copy(inputs, **kwargs) if packed else copy(*inputs, **kwargs)
        if {id(v) for v in copy.weights} & {id(v) for v in layer.weights}:
            return False  # its config hands over the layer's own state: trying would change it
        perms = _generating_permutations(channels, rng)
        for mode in modes:
            expected = run(copy, identity, mode)
            scale = max(1.0, float(np.abs(expected).max()))
            if not np.isfinite(expected).all() or not all(
                    np.allclose(run(copy, perm, mode), expected[..., perm], rtol=1e-5,
                                atol=1e-6 * scale) for perm in perms):
                return False
        return True
    except Exception:  # noqa: BLE001 - a layer that cannot be tried is not used
        return False


def _output_channels(op) -> int | None:
    """The last dimension of `op`'s one output (None: unknown, or several outputs)."""
    output = op.output
    return output.shape[-1] if isinstance(output, keras.KerasTensor) else None


def _segments(graph: _Graph, name: str) -> list[int]:
    """Where each input's channels start in the output of `name`, a channel-axis concatenation
    (a Concatenate layer or `keras.ops.concatenate`), and its width last (`[0, w0, w0 + w1,
    ...]`); empty for anything else."""
    op = graph.ops[name]
    if _keras_kind(op) != "Concatenate":
        return []
    widths = graph.widths.get(name, [])
    if op.axis not in (-1, len(op.output.shape) - 1) or not widths or None in widths:
        return []
    starts = list(itertools.accumulate(widths, initial=0))
    # A constant among the inputs (`ops.concatenate([coords, x])`) has channels too.
    return starts if starts[-1] == _output_channels(op) else []


def _frozen(name: str, layer: keras.Operation) -> str:
    """Why `layer`'s weights cannot be permuted as plain arrays ('' when they can): it or a layer
    inside it (MultiHeadAttention's projections) is quantized or has LoRA enabled."""
    if not isinstance(layer, keras.layers.Layer):  # a keras op: no weights
        return ""
    layers = [layer, *walk_layers(layer)]
    if quantized := [sub for sub in layers if getattr(sub, "quantization_mode", None)]:
        return (f"{_describe(name, layer)} is quantized ({quantized[0].quantization_mode}): "
                "permute the float model, then quantize")
    if any(getattr(sub, "lora_enabled", False) for sub in layers):
        return (f"LoRA is enabled on {_describe(name, layer)} (the weights it uses are w + "
                "lora_a @ lora_b)")
    return ""


class _Space(NamedTuple):
    """The layers that share one channel space (one order of the same `channels`): name -> offset
    of those channels in the layer's channel axis (non-zero past a concatenation), graph order."""

    producers: dict[str, int]  # whose `_writes` axes carry the channels
    through: dict[str, int]  # pass-through, merge and concatenation layers on the way
    consumers: dict[str, int]  # whose `_reads` axes read them
    reads: dict[str, tuple[str, ...]]  # per consumer, the `_reads` entries that read them
    channels: int
    carriers: set[str]  # layers whose whole output is the space (seeds of the same space)
    reason: str  # why the space cannot be permuted ('' when it can)


class _Plan(NamedTuple):
    """A channel space to permute and its consumers' kernels as `[rows, channels]`."""

    space: _Space
    rows: np.ndarray


def _space(graph: _Graph, seed: str) -> _Space:
    """The channel space that starts at `seed`'s output: everything permuted with it.

    Walks forward from every layer that carries the channels, and back from each: through
    pass-through layers, across channel-wise merges to all their inputs (a residual add joins both
    branches' producers and all readers of the sum), and through channel-axis concatenations as a
    slice at an offset (DenseNet: one layer's channels, read by every later layer of its block).
    Stops at anything else; the first such stop is the reason the space is skipped.
    """
    producers, through, consumers, reads, reasons = {}, {}, {}, {}, []
    carriers, channels, whole = {seed: 0}, 0, set()
    queue = [seed]

    def carry(name: str, offset: int) -> None:
        if name not in carriers:
            carriers[name] = offset
            queue.append(name)
        elif carriers[name] != offset:
            reasons.append(f"channels reach {_describe(name, graph.ops[name])} at two offsets")

    for name in queue:  # grows while iterating
        offset, op = carriers[name], graph.ops.get(name)
        if op is None or isinstance(op, keras.layers.InputLayer):
            reasons.append("its input channels come from the model input")
            continue
        if why := _shared(graph, name):
            reasons.append(f"its input channels come from {_describe(name, op)}, which {why}")
            continue
        if not isinstance(op.output, keras.KerasTensor):
            reasons.append(f"its input channels come from {_describe(name, op)}, which has several "
                           "outputs")
            continue
        if not channels and _output_channels(op) is None:
            reasons.append(f"{_describe(name, op)} has an unknown number of channels")
            continue
        channels = channels or int(_output_channels(op))
        if offset == 0 and _output_channels(op) == channels:
            whole.add(name)
        if _writes(op):
            producers[name] = offset
        elif carrying := _carrying(graph, name):
            through[name] = offset
            for i in carrying:
                carry(graph.inputs[name][0][i], offset)
        elif starts := _segments(graph, name):
            through[name] = offset
            inside = [i for i in range(len(starts) - 1)
                      if starts[i] <= offset and offset + channels <= starts[i + 1]]
            if not inside:
                reasons.append(f"channels straddle two inputs of {_describe(name, op)}")
                continue
            carry(graph.inputs[name][0][inside[0]], offset - starts[inside[0]])
        elif _probe(graph, name, produces=True):
            producers[name] = offset
        else:
            reasons.append(f"its input channels come from {_describe(name, op)}, which "
                           f"{_cannot(graph, name)}")
            continue
        if name in graph.outputs:
            reasons.append(f"{name!r} is a model output")
        for user in graph.consumers.get(name, []):
            op = graph.ops[user]
            if why := _shared(graph, user):
                reasons.append(f"channels reach {_describe(user, op)}, which {why}")
            elif _reads(op):
                by_input = _argument_reads(graph, user)
                at = [i for i, source in enumerate(graph.inputs[user][0]) if source == name]
                if not all(by_input[i] for i in at):
                    reasons.append(f"channels reach {_describe(user, op)} as an input that no "
                                   "kernel of it reads")
                if offset % 4:  # its groups of 4 would mix these channels with others
                    reasons.append(f"channels reach {_describe(user, op)} at input channel {offset}, "
                                   "not a multiple of 4")
                if consumers.setdefault(user, offset) != offset:
                    reasons.append(f"channels reach {_describe(user, op)} at two offsets")
                reads[user] = {*reads.get(user, ()), *(r for i in at for r in by_input[i])}
            elif carrying := _carrying(graph, user):
                if name in (graph.inputs[user][0][i] for i in carrying):
                    carry(user, offset)
                else:
                    reasons.append(f"channels reach {_describe(user, op)}, which broadcasts them")
            elif starts := _segments(graph, user):
                at = [i for i, source in enumerate(graph.inputs[user][0]) if source == name]
                if len(at) > 1:
                    reasons.append(f"channels reach {_describe(user, op)} {len(at)} times")
                carry(user, starts[at[0]] + offset)
            else:
                reasons.append(f"channels reach {_describe(user, op)}, which "
                               f"{_cannot(graph, user)}")
    order = {name: i for i, name in enumerate(graph.ops)}
    producers, through, consumers = (dict(sorted(group.items(), key=lambda item: order[item[0]]))
                                     for group in (producers, through, consumers))
    if not reasons and not producers:
        reasons.append("no Dense/Conv layer produces these channels")
    if not reasons:
        reasons += [f"the activation of {_describe(n, graph.ops[n])} is not known to act "
                    "channel by channel (a custom function)"
                    for n in [*producers, *through] if not _activation_commutes(graph.ops[n])]
        reasons += filter(None, (_frozen(n, graph.ops[n]) for n in [*producers, *through,
                                                                     *consumers]))
    reads = {user: tuple(r for r in _reads(graph.ops[user]) if r in roles)  # in _reads' order
             for user, roles in reads.items()}
    return _Space(producers, through, consumers, reads, channels, whole,
                  reasons[0] if reasons else "")


def _constant_normalization(layer) -> bool:
    """A `keras.layers.Normalization` given its mean and variance as constructor constants: they
    are not weights, so a permutation cannot reorder them."""
    return _keras_kind(layer) == "Normalization" and layer.input_mean is not None


def _cannot(graph: _Graph, name: str) -> str:
    """'cannot be permuted', and why not for a custom layer whose call was not followed."""
    why = graph.unfollowed.get(name)
    if not why and _constant_normalization(graph.ops.get(name)):
        why = ("its mean and variance are constants given to its constructor, not weights that "
               "could be reordered: adapt() it instead")
    return f"cannot be permuted ({why})" if why else "cannot be permuted"


def _roots(graph: _Graph, name: str) -> list[str]:
    """Where the channel spaces in `name`'s output start: back through pass-through layers and
    into each input of a concatenation."""
    op = graph.ops.get(name)
    if op is None or isinstance(op, keras.layers.InputLayer) or _shared(graph, name):
        return [name]
    if _carrying(graph, name) == [0] and len(graph.inputs[name][0]) == 1:
        return _roots(graph, graph.inputs[name][0][0])
    if _segments(graph, name):
        return list(dict.fromkeys(r for s in graph.inputs[name][0] for r in _roots(graph, s)))
    return [name]


def _finite(name: str, kernel) -> np.ndarray:
    """`kernel` as an array.

    Raises:
        ValueError: naming layer `name` if it has NaN/Inf (no channel order can be searched).
    """
    values = kernel.numpy()
    if not np.all(np.isfinite(values)):
        raise ValueError(f"permute(): the kernel of layer {name!r} contains NaN/Inf; cannot search "
                         "a channel order for it.")
    return values


def _channel_rows(graph: _Graph, space: _Space) -> np.ndarray:
    """The consumers' kernels that read `space` (their `_reads` kernels), at their offsets, as one
    `[rows, channels]` matrix (ASP's orientation).

    Raises:
        ValueError: naming the first layer whose kernel has NaN/Inf.
    """
    rows = []
    for name, offset in space.consumers.items():
        axes = _reads(graph.ops[name])
        for kernel, axis, _ in (a for role in space.reads[name] for a in axes[role] if a.grouped):
            kernel = _finite(name, kernel)
            rows.append(channel_matrix(kernel, axis)[:, offset:offset + space.channels])
    return np.concatenate(rows)


def _plan(
    graph: _Graph, selected: set[int] | None, max_channels: int | None
) -> tuple[list[_Plan], list[PermutationReport]]:
    """The channel spaces to permute (their kernels read and checked) and reports for the
    skipped ones; one per space that a selected consumer reads."""
    plans, reports, seen = [], [], set()
    for name, op in graph.ops.items():
        by_input = _argument_reads(graph, name)
        if not any(by_input) or (selected is not None and id(op) not in selected):
            continue
        if why := _shared(graph, name):
            reports.append(PermutationReport(None, (name,), 0, False, f"{_describe(name, op)} {why}"))
            continue
        sources = dict.fromkeys(s for s, read in zip(graph.inputs[name][0], by_input) if read)
        for root in (root for source in sources for root in _roots(graph, source)):
            if root in seen:
                continue
            space = _space(graph, root)
            seen.update(space.carriers)
            reason, channels = space.reason, space.channels
            if not reason and channels % 4:
                reason = f"{channels} channels, not a multiple of 4"
            if not reason and max_channels is not None and channels > max_channels:
                reason = f"{channels} channels > max_channels={max_channels}"
            if reason:
                readers = tuple(space.consumers) if name in space.consumers else (name,)
                reports.append(PermutationReport(
                    next(iter(space.producers), None), readers, channels if space.producers else 0,
                    False, reason, producers=tuple(space.producers)))
            else:
                rows = _channel_rows(graph, space)
                plans.append(_Plan(space, rows))
    return plans, reports


class _Attention(NamedTuple):
    """An attention layer (`_ATTENTION`) of a model's graph, or inside one of its layers."""

    name: str  # in reports: its graph name, or 'holder/attention' inside a layer
    holder: str  # graph name of the layer that holds it (itself at the top)
    layer: keras.layers.Layer


class _HeadPlan(NamedTuple):
    """An attention layer whose value heads to permute, and per value head the output
    projection's kernel for the query heads it serves as `[rows, head_dim]`."""

    attention: _Attention
    rows: list[np.ndarray]


def _attention_layers(graph: _Graph) -> tuple[list[_Attention], set[int]]:
    """Every attention layer of the graph, at the top or inside another layer (a transformer
    block layer, a nested model), named by its path ('encoder/block_1/attention'); and the ids of
    those found more than once (held by two layers, or twice by one)."""
    found, count = {}, collections.Counter()

    def visit(layer, path: str, holder: str, above: frozenset) -> None:
        if _keras_kind(layer) in _ATTENTION:
            count[id(layer)] += 1
            found.setdefault(id(layer), _Attention(path, holder, layer))
        elif not isinstance(layer, Sparse24) and id(layer) not in above:  # masks: not entered
            subs = {id(sub): sub for sub in _sublayers(layer)}  # Keras also lists them in _layers
            for sub in subs.values():
                visit(sub, f"{path}/{sub.name}", holder, above | {id(layer)})

    for name, op in graph.ops.items():
        if isinstance(op, keras.layers.Layer):
            visit(op, name, name, frozenset())
    return list(found.values()), {i for i, n in count.items() if n > 1}


def _head_plans(
    graph: _Graph, attention_layers: list[_Attention], repeated: set[int],
    selected: set[int] | None,
) -> tuple[list[_HeadPlan], list[PermutationReport]]:
    """The attention layers whose value heads can be permuted, and reports for the others.

    Head j of the value projection (kernel `[d, Hv, Dv]`, bias `[Hv, Dv]`) writes the channels that
    the output projection (kernel `[Hq, Dv, ...]`, grouped along Dv) reads at the query heads it
    serves (MultiHeadAttention: head j; GroupQueryAttention, which repeats each value head for
    Hq / Hv query heads: heads j * Hq/Hv ... (j + 1) * Hq/Hv - 1, whose gate channels, if any,
    multiply them). Attention weighs all Dv channels of a head alike, so each value head's
    channels can be reordered on their own, whatever the layer's inputs and outputs are (it may
    be called several times). `attention_layers` and `repeated`: `_attention_layers(graph)`."""
    plans, reports = [], []
    for attention in attention_layers:
        name, op = attention.name, attention.layer
        if not op.built or (selected is not None and id(op) not in selected):
            continue
        parts = _projections(op)
        heads, value_dim = parts["value"].kernel.shape[-2:]
        query_heads = parts["output"].kernel.shape[0]
        reason = _frozen(name, op)
        if not reason and (id(op) in repeated or attention.holder in graph.hidden):
            reason = f"{_describe(name, op)} is shared (also used inside another layer)"
        if not reason and value_dim % 4:
            reason = f"value_dim {value_dim}, not a multiple of 4"
        if not reason and (query_heads % heads or parts["output"].kernel.shape[1] != value_dim):
            reason = f"{_describe(name, op)} has projections of unexpected shapes"
        if reason:
            reports.append(PermutationReport(name, (name,), value_dim, False, reason,
                                             producers=(name,), heads=heads))
            continue
        kernel = _finite(name, parts["output"].kernel)
        serves = query_heads // heads
        plans.append(_HeadPlan(attention, [  # value head j: its query heads' rows
            np.concatenate([channel_matrix(head, 0) for head in kernel[j * serves:][:serves]])
            for j in range(heads)]))
    return plans, reports


def _apply_heads(copies: dict, attention: _Attention, perms: list[np.ndarray]) -> None:
    """Reorders each value head's channels in the copy of `attention`: the value projection's
    kernel and bias along Dv, the output projection's kernel (and a gate's kernel and bias) along
    Dv at the query heads it serves."""
    parts = _projections(_copy_of(copies, attention.name, attention.layer))
    value_dim, serves = len(perms[0]), parts["output"].kernel.shape[0] // len(perms)
    value_index = np.concatenate([j * value_dim + perm for j, perm in enumerate(perms)])
    query_index = np.concatenate([q * value_dim + perms[q // serves]
                                  for q in range(serves * len(perms))])
    gate = parts.get("gate")
    for variable, first, index in (
            (parts["value"].kernel, 1, value_index), (parts["value"].bias, 0, value_index),
            (parts["output"].kernel, 0, query_index),
            *([(gate.kernel, 1, query_index), (gate.bias, 0, query_index)] if gate else [])):
        if variable is None:
            continue
        values = variable.numpy()  # heads and Dv at axes `first`, `first + 1`
        flat = values.reshape(*values.shape[:first], -1, *values.shape[first + 2:])
        variable.assign(np.take(flat, index, axis=first).reshape(values.shape))


def permute(
    model: keras.Model,
    *,
    layers: Iterable | None = None,
    kicks: int | None = None,
    seed: int = 0,
    block_channels: int | None = 512,
    max_channels: int | None = None,
    progress: bool = True,
    print_fn: Callable[[str], None] | None = None,
) -> tuple:
    """Returns a copy of `model` with input channels reordered to keep more magnitude under 2:4.

    For each channel space (a set of channels that "producers" write: Dense/ConvND, SeparableConv,
    EinsumDense, MultiHeadAttention and GroupQueryAttention (their output projection) and Embedding
    tables; and that "consumers" read: Dense/ConvND, SeparableConv (depth_multiplier 1), EinsumDense
    and those attention layers (their query, key and value projections, per call argument), through
    activations, dropout, pooling, reshapes that keep the last axis, BatchNormalization,
    LayerNormalization, RMSNormalization, an adapted Normalization (its per-channel mean and
    variance are reordered and made current), depthwise convolutions with depth_multiplier 1
    (DepthwiseConv, or ConvND with groups equal to its channels), elementwise merges such as
    residual adds and squeeze-excite products, which join their inputs' spaces (merge layers or
    keras ops: `x + y`, `x * keras.ops.relu6(x + 3.0) / 6.0`; a one-channel input broadcast over the
    others is left alone), and concatenations along the channels, past which the space is a slice at
    an offset), searches one channel order for all the consumers' kernels together
    (`search_permutation`) and applies it to the consumers' kernel input axis (and depthwise
    filters), every producer's (pointwise) kernel output axis and bias, and every per-channel weight
    in between, each at its offset. A layer with no rule here whose weights all have C entries along
    their last axis (ConvNeXt's LayerScale, a user's `x * gamma`, a learned position table added in)
    is tried: a copy of it is run on random inputs with and without its channels reordered, and it
    is followed if it acts channel by channel, or is a producer if reordering its weights alone
    reorders its output (a token table plus a position table). So a transformer's residual stream
    is one space, from the embedding table to the classifier. Inside every attention layer (also
    those inside custom layers) each value head's channels are reordered on their own, for its
    output projection's 2:4 groups (a report with `heads` > 0). A nested model (Sequential or
    Functional: a keras.applications base model in a transfer-learning model) called once on one
    tensor (a Functional one also on a list), and a custom layer holding sublayers whose call can be followed on symbolic inputs (a
    transformer block written as a Layer), are followed through as their own graph (their layers
    reported as 'outer/inner'; when a custom layer's call is not, the reason is in the reports).
    The copy is checked against the model on random inputs; if following custom layers' calls
    made it differ, they are not followed (with a warning).
    The copy of the model (made as `tf_sparse24.prune` makes its copies) computes the same function
    as `model` (up to float rounding) but its 2:4 masks keep more. Run it on the trained dense
    model, before `tf_sparse24.prune`. The caller's model is not changed.

    Skipped, with a reason in the report: spaces that reach the model input, a model output, a
    shared layer (called twice, or also inside a nested model), a nested model with several outputs
    (or several inputs not passed as a list), a layer with several outputs, a custom activation function (on a producer or an
    Activation layer) that a trial run finds mixing channels, a keras op that is not elementwise (`x[:, :16]`,
    `keras.ops.flip`) or has a per-channel constant (`x + np.arange(16)`), any other layer not found
    to commute with a channel permutation (the rules are for Keras' own classes: a user's class,
    whatever its name or base class, is only tried); quantized or LoRA-enabled layers; channel
    counts that are not a multiple of 4 or above `max_channels`, and slices of a concatenation that
    start at an input channel that is not a multiple of 4; an input that no kernel of its layer
    reads (an attention mask); value heads whose value_dim is not a multiple of 4.

    Args:
        model: a built Functional or Sequential keras.Model.
        layers: only search for these consumers and attention layers (layer names, layer
            objects or layer classes, as in `tf_sparse24.prune`; a selected container selects
            those inside it; a report's 'outer/inner' name selects that layer; None = all).
        kicks: escape rounds per search (see `search_permutation`).
        seed: seed of the searches.
        block_channels: wider groups are searched in random blocks of about this many channels
            (see `search_permutation`): the cost grows linearly with the channels instead of as
            their square. None: one search per group, however wide.
        max_channels: skip groups wider than this (None: no limit).
        progress: show a tqdm progress bar over the searches.
        print_fn: if given, called with a one-line summary per channel space.

    Returns:
        `(permuted_model, reports)`: a new model and one `PermutationReport` per channel
            space.

    Raises:
        TypeError: for a subclassed model or a non-model.
        ValueError: for an unbuilt or already pruned model (Sparse24 layers), an unknown layer
            name, a consumer kernel with NaN/Inf
            (naming the layer) or a weight shared by two layers (copies would untie it).
        RuntimeError: if the copy still computes otherwise than the model (a bug).

    Example:
        >>> model, reports = tf_sparse24.permute(model)
        >>> model = tf_sparse24.prune(model)
    """
    check_model(model, "permute")
    if wrapped := [w.name for w in pruned_layers(model)]:
        raise ValueError(
            f"permute(): model {model.name!r} already has Sparse24 layers {wrapped}: permute the "
            "dense model, then prune it (a new channel order changes which weights 2:4 keeps).")
    search = {"kicks": kicks, "seed": seed, "block_channels": block_channels}
    with _restoring_layers(model):  # also undoes what the checks' calls set on the layers
        copy, reports, followed = _permute(model, layers, search, max_channels, progress, True)
        difference = _difference(model, copy)
        if followed and difference:
            warnings.warn(
                f"permute(): following the calls of the custom layers of model {model.name!r} "
                f"made a copy that computes otherwise ({difference}); permuted again without "
                "following them. Please report this.", stacklevel=2)
            copy, reports, _ = _permute(model, layers, search, max_channels, progress, False)
            difference = _difference(model, copy)
        elif followed and difference is None:
            warnings.warn(
                f"permute(): followed the calls of the custom layers {followed} of "
                f"model {model.name!r}, but could not check the copy against the model on random "
                "inputs (inputs it cannot make up, or outputs that differ from call to call): "
                "compare them on your data.", stacklevel=2)
        if difference:
            raise RuntimeError(
                f"permute(): the permuted copy of model {model.name!r} does not compute what the "
                f"model does ({difference}); nothing was returned. Please report this.")
    if print_fn is not None:
        for r in reports:
            what = (f"kept |w| {r.kept_before:.4g} -> {r.kept_after:.4g} (+{r.gain_percent:.2f}%, "
                    f"efficacy {r.efficacy:.1f}%)" if r.permuted else f"skipped: {r.reason}")
            where = (f"{r.producer} value heads -> its output projection [{r.heads} x "
                     f"{r.channels} ch]" if r.heads else
                     f"{'+'.join(r.producers) or '-'} -> {', '.join(r.consumers)} "
                     f"[{r.channels} ch]")
            print_fn(f"{where}: {what}")
    return copy, reports


def _difference(model: keras.Model, copy: keras.Model) -> str | None:
    """How the outputs of `model` and `copy` differ on random inputs ('' when they agree within
    float rounding, None when they cannot be compared): inputs of the model's shapes and dtypes
    (token ids 0 and 1), the first two lengths it runs at of 5, 11, 16, 4, 32, 8, 64 for unknown
    dimensions, inference mode, in a stateless scope (no variable, seed or loss of the model
    changes). Rounding: 1000 ulps of the lowest compute precision in the model at the output's
    scale, or, for a model that rounding alone moves more (ill-conditioned), 10 times what
    perturbing the copy's weights by one ulp moves it. Not for models with stateful layers, or
    whose outputs differ from call to call."""
    layers = walk_layers(model)
    if any(getattr(layer, "stateful", False) for layer in layers):
        return None
    ulp = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
    eps = max(ulp.get(getattr(layer, "compute_dtype", None), 0.0) for layer in [model, *layers])
    eps = eps or ulp["float32"]
    rng = np.random.default_rng(0)
    compared = 0
    for length in (5, 11, 16, 4, 32, 8, 64):  # the first two the model runs at
        try:
            inputs = _random_inputs(model, length, rng)
            (first, again), (ours,) = _outputs(model, inputs, 2), _outputs(copy, inputs)
        except Exception:  # noqa: BLE001, S112 - inputs it cannot make up (strings), string
            continue  # outputs, or a length it does not take
        if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(first, again)):
            return None  # random in inference: nothing to compare
        compared += 1
        for index, (theirs, mine) in enumerate(zip(first, ours)):
            scale = float(np.nanmax(np.abs(theirs), initial=0.0))
            error = float(np.nanmax(np.abs(mine - theirs), initial=0.0))
            if not np.array_equal(np.isnan(mine), np.isnan(theirs)):
                return "NaN in other places"
            if error <= max(1e-6, min(0.05, 1e3 * eps)) * max(scale, 1e-30):
                continue
            if error <= 10 * _rounding_sensitivity(copy, inputs, index, eps, mine):
                continue
            return f"max |difference| {error:.3g} at output scale {scale:.3g}"
        if compared == 2:
            return ""
    return "" if compared else None


def _random_inputs(model: keras.Model, length: int, rng: np.random.Generator):
    """Inputs for `model`: its shapes (batch 2, other unknown dimensions `length`) and dtypes,
    N(0, 1) floats, 0/1 integers (token ids any vocabulary has) and booleans."""
    def draw(spec):
        return _random_array([2 if i == 0 and d is None else length if d is None else d
                              for i, d in enumerate(spec.shape)], spec.dtype, rng)

    return keras.tree.map_structure(draw, model.input)


def _random_array(shape: list[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """A trial input: N(0, 1) floats, or 0/1 for integers (token ids any vocabulary has) and
    booleans."""
    if "int" in str(dtype) or str(dtype) == "bool":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def _generating_permutations(channels: int, rng: np.random.Generator) -> tuple:
    """The transposition (0 1), the cycle (0 1 ... C-1), which generate every permutation of C
    channels, and one at random: what the trial runs reorder channels by."""
    return (np.r_[1, 0, 2:channels], np.roll(np.arange(channels), 1), rng.permutation(channels))


def _outputs(model: keras.Model, inputs, calls: int = 1) -> list[list[np.ndarray]]:
    """`model`'s outputs on `inputs` in inference mode, `calls` times, as float64 arrays, in one
    stateless scope: the model's variables (seeds, statistics) do not change, but a random layer's
    seed moves on from call to call as it would."""
    with keras.StatelessScope():
        runs = [keras.tree.flatten(model(inputs, training=False)) for _ in range(calls)]
    return [[np.asarray(keras.ops.convert_to_numpy(y), "float64") for y in run] for run in runs]


def _rounding_sensitivity(copy: keras.Model, inputs, index: int, eps: float,
                          output: np.ndarray) -> float:
    """How far output `index` of `copy` (`output` at `inputs`) moves when each of its float
    weights is scaled by 1 +- `eps` (random signs): what rounding alone can do to it. The
    weights are put back after."""
    rng = np.random.default_rng(1)
    weights = copy.get_weights()
    try:
        copy.set_weights([w * (1 + eps * rng.choice([-1.0, 1.0], size=w.shape)).astype(w.dtype)
                          if w.dtype.kind == "f" else w for w in weights])
        _refresh_statistics(copy)
        moved = _outputs(copy, inputs)[0][index]
        return float(np.nanmax(np.abs(moved - output), initial=0.0))
    finally:
        copy.set_weights(weights)
        _refresh_statistics(copy)


def _permute(model, layers, search_options: dict, max_channels, progress, follow: bool) -> tuple:
    """`permute` on a checked model, its custom layers' calls followed or not: `(copy, reports,
    the custom layers followed)`."""
    graph = _graph(model, follow)
    attention, repeated = _attention_layers(graph)
    # Names from a report ('outer/inner': inside an inlined model or a custom layer) are paths
    # that select that layer; a selected container selects what it holds.
    selectors = _check_selectors(model, layers, "layers")
    everything = walk_layers(model)
    reachable = {*map(id, graph.ops.values()), *(id(a.layer) for a in attention)}
    if inner := [s for s in selectors
                 if isinstance(s, str) and not _covered(everything, [s]) & reachable]:
        raise ValueError(
            f"layers: {inner} sit inside a nested model or layer of model {model.name!r} that "
            "permute() does not follow (a layer whose call it cannot follow, or a nested model "
            "that is shared, has several outputs or takes inputs not as a list)."
        )
    check_untied(model, "permute")
    selected = _covered(everything, selectors) if selectors else None
    plans, reports = _plan(graph, selected, max_channels)
    head_plans, head_reports = _head_plans(graph, attention, repeated, selected)
    reports += head_reports
    copy, copies = _copy_model(model)
    bar = tqdm(total=len(plans) + len(head_plans), desc="channel permutations", unit="space",
               leave=False, disable=not (progress and (plans or head_plans)))

    def search(rows: np.ndarray) -> np.ndarray:
        return search_permutation(rows, axis=1, **search_options)

    for plan in plans:
        perm = search(plan.rows)
        _apply(graph, copies, plan.space, perm)
        reports.append(PermutationReport(
            next(iter(plan.space.producers)), tuple(plan.space.consumers), len(perm), True, "",
            kept_magnitude(plan.rows), kept_magnitude(plan.rows, perm),
            permutation_efficacy(plan.rows, perm), tuple(plan.space.producers)))
        bar.update()
    for plan in head_plans:
        perms = [search(rows) for rows in plan.rows]
        _apply_heads(copies, plan.attention, perms)
        name = plan.attention.name
        reports.append(PermutationReport(
            name, (name,), len(perms[0]), True, "",
            sum(map(kept_magnitude, plan.rows)), sum(map(kept_magnitude, plan.rows, perms)),
            _efficacy(plan.rows, perms), (name,), heads=len(perms)))
        bar.update()
    bar.close()
    return copy, reports, graph.followed


def _copy_model(model: keras.Model) -> tuple[keras.Model, dict[int, keras.Operation]]:
    """A copy of `model` made as `prune` makes its copies, and the copy of each of its layers and
    keras ops by the original's id, the layers inside copied custom layers included (matched in
    `walk_layers` order): names cannot find them, since a copy made from a config that leaves
    out the name gets a new one."""
    pairs = []

    def copy_and_record(layer):
        new = copy_layer(layer)
        pairs.append((layer, new))
        return new

    copy = clone_graph(model, copy_and_record, "permute")
    copies = {}
    for old, new in pairs:
        copies[id(old)] = new
        if isinstance(old, keras.layers.Layer) and new is not old:
            for old_sub, new_sub in zip(walk_layers(old), walk_layers(new)):
                copies.setdefault(id(old_sub), new_sub)
    return copy, copies


def _copy_of(copies: dict, name: str, op: keras.Operation) -> keras.Operation:
    """The copy of `op` (graph name `name`).

    Raises:
        RuntimeError: if it has none, or one of another class or with other weight shapes (the
            caller's model is unchanged; permuting only part of the copy would change its function).
    """
    new = copies.get(id(op))
    shapes = [tuple(w.shape) for w in getattr(op, "weights", [])]
    if new is None or type(new) is not type(op) or [
            tuple(w.shape) for w in getattr(new, "weights", [])] != shapes:
        raise RuntimeError(f"permute(): {_describe(name, op)} has no matching copy in the copied "
                           "model; nothing was returned.")
    return new


def _refresh_statistics(layer: keras.layers.Layer) -> None:
    """Makes every adapted `keras.layers.Normalization` in `layer` (itself included) compute from
    its weights again after they were written: it computes from `mean`/`variance` tensors that only
    `finalize_state()` rebuilds from its `mean`/`variance` weights (`adapt()` and loading call it;
    `assign` and `set_weights` do not). Other layers are left alone (a lookup's `finalize_state`
    rebuilds its vocabulary)."""
    for sub in [layer, *walk_layers(layer)]:
        if isinstance(sub, keras.layers.Normalization) and sub.built:
            sub.finalize_state()  # a no-op for constants given to the constructor


def _apply(graph: _Graph, copies: dict, space: _Space, perm: np.ndarray) -> None:
    """Permutes, in the copies, at each layer's offset, the producers' output channels, the
    per-channel weights in between and the consumers' input channels (a layer can be both:
    `x + conv(x)`)."""

    def take(variable, axis: int, offset: int) -> None:
        values = variable.numpy()
        index = np.arange(values.shape[axis])
        index[offset:offset + len(perm)] = offset + perm
        variable.assign(np.take(values, index, axis=axis))

    def copy_of(name: str) -> keras.Operation:
        return _copy_of(copies, name, graph.ops[name])

    for name, offset in space.producers.items():
        layer = copy_of(name)
        for variable, axis, _ in _writes(layer) or [  # or a producer found by `_probe`
                _Axis(w, w.ndim - 1) for w in layer.weights]:
            take(variable, axis, offset)
        _refresh_statistics(layer)
    for name, offset in space.through.items():
        # BatchNormalization/LayerNormalization: [C]; probed layers: [..., C]; depthwise: kernel
        # [..., C, 1], bias [C]; grouped depthwise ConvND: kernel [..., 1, C], bias [C]; keras ops
        # have no weights.
        op = graph.ops[name]  # a weightless one needs no copy (a layer made in a traced call)
        layer = copy_of(name) if isinstance(op, keras.layers.Layer) and op.weights else None
        for variable in layer.weights if layer is not None else []:
            if variable.ndim == 0:  # a probed layer's scalar (ReZero's alpha)
                continue
            depthwise = _keras_kind(layer) in _DEPTHWISE and variable.ndim > 1
            take(variable, variable.ndim - 2 if depthwise else variable.ndim - 1, offset)
        if layer is not None:
            _refresh_statistics(layer)
    for name, offset in space.consumers.items():
        axes = _reads(copy_of(name))
        for role in space.reads[name]:
            for variable, axis, _ in axes[role]:
                take(variable, axis, offset)
