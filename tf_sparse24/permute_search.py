"""Channel-order search on one weight matrix, so that 2:4 keeps more magnitude (Pool & Yu,
NeurIPS 2021).

2:4 keeps the 2 largest of every 4 consecutive input channels, so which channels share a group
matters: reordering a layer's input channels lets large weights avoid competing with each other.

`search_permutation(weight, axis)`: numpy search for a channel order (group scores in C++). An
exact local search re-partitions two or three 4-channel stripes at a time (apex ASP's "optimize
stripe groups" neighbourhood) until no gain is left, then escapes local optima by shuffling a few
stripes of the best order and searching again ("kicks"), keeping only improvements. Wide layers are
searched in random blocks of channels, so the cost stays linear in their width.

Metric (apex ASP's `permutation_tests`): efficacy = (lost_plain - lost_permuted) /
(lost_plain - lost_rows50), where "lost" is the magnitude 2:4 discards and lost_rows50 is what
keeping the top 50% of each row discards. ASP's matrix is `[filters, channels]` with groups of 4
along channels; a Keras kernel is `[channels, filters]`, so ASP's rows are our output channels (and,
for convolutions, every spatial tap x output channel). `permutation_efficacy` uses ASP's
orientation.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm

_EPS = 1e-6  # gains below this (in summed |w| / max |w|) are noise: stop searching


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
    return combined_efficacy([matrix], [permutation])


def combined_efficacy(matrices: list[np.ndarray], permutations: list[np.ndarray]) -> float:
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
        >>> from tf_sparse24.permute_search import kept_magnitude  # not a top-level name
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


def default_kicks(channels: int) -> int:
    """Escape budget: 40 kicks (~4 s CPU for 64 channels), fewer for wide layers."""
    return 40 if channels <= 96 else max(8, 40 * 96 // channels)


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
