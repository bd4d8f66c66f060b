"""Channel permutations of a Keras model that raise the magnitude its 2:4 masks keep (Pool & Yu,
NeurIPS 2021).

2:4 keeps the 2 largest of every 4 consecutive input channels, so which channels share a group
matters: reordering a layer's input channels (and, to keep the network's function unchanged, the
output channels of the layer that produces them) lets large weights avoid competing with each other.

`permute(model)` applies searches (`permute_search.search_permutation`) to a Keras
Functional/Sequential model, permuting each eligible layer's input channels together with the
output channels of the layers that produce them (kernel columns, bias, BatchNormalization or
Normalization statistics in between; across residual adds all branches and all readers of the sum;
through concatenations as a slice), checks the copy against the model on random inputs, and
reports per-space gains and skip reasons. The model's graph is read by `model_graph`, its channel
spaces found by `channel_spaces`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import keras
import numpy as np
from tqdm.auto import tqdm

from tf_sparse24.channel_spaces import (
    DEPTHWISE,
    Attention,
    Space,
    WeightAxis,
    argument_reads,
    attention_projections,
    channel_space,
    find_attention_layers,
    frozen_reason,
    random_array,
    read_axes,
    refresh_statistics,
    roots,
    shared_reason,
    unpermuted_cause,
    write_axes,
)
from tf_sparse24.model_copy import check_untied, clone_graph, copy_layer
from tf_sparse24.model_graph import Graph, describe, keras_kind, read_graph, restoring_layers
from tf_sparse24.permute_search import (
    channel_matrix,
    combined_efficacy,
    kept_magnitude,
    permutation_efficacy,
    search_permutation,
)
from tf_sparse24.prune import _check_selectors, _covered, check_model, pruned_layers
from tf_sparse24.wrapper import walk_layers


@dataclasses.dataclass
class PermutationReport:
    """What `permute` did for one channel space: the layers that produce the same channels (several
    when a residual add or product joins branches) and the layers that consume them.

    `producer` is the first of `producers` (None when there is none). `kept_before`/`kept_after`
    are the |w| the consumers' kernels keep under 2:4 (those 2:4 prunes: not a kernel whose input
    channels are not a multiple of 4); `efficacy` is ASP's metric in percent (None
    when skipped).

    `heads` > 0 marks the space inside one attention layer (producer and consumer): the output
    channels of its value projection, read by its output projection, reordered within each of its
    `heads` value heads (`channels` per head; the figures sum over the heads).

    A report may also be about one layer alone (`consumers` its name, no producers, 0 channels): a
    shared layer, or one whose channels permute() leaves alone (a grouped convolution), as `reason`
    says.
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
    tables; and that "consumers" read: Dense/ConvND, SeparableConv (depth_multiplier 1),
    EinsumDense, GRU, LSTM and SimpleRNN (their cell's kernel `[in, gates * units]` along `in`),
    a Bidirectional whose forward and backward layers are both GRU, LSTM or SimpleRNN (both
    cells' kernels, searched together) and those attention layers (their query, key and value
    projections, per call argument), through
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
    start at an input channel that is not a multiple of 4; channels that no kernel 2:4 prunes reads
    (a concatenation of 16 + 3 channels read by one layer); an input that no kernel of its layer
    reads (an attention mask); value heads whose value_dim is not a multiple of 4. In a report of
    its own (and named in the reason of a space that stops there): each layer with kernels whose
    channels permute() leaves alone: a grouped (other than one group per channel), transposed or
    channels_first convolution, a DepthwiseConv with depth_multiplier > 1, the input of a
    SeparableConv with depth_multiplier > 1, a recurrent layer other than GRU, LSTM and SimpleRNN,
    alone or as both layers of a Bidirectional (`RNN(cell)`, ConvLSTM, a Bidirectional of either);
    the output of any recurrent layer; each nested model or layer that holds layers with kernels
    and that permute() does not look inside (a custom layer or nested model called twice, a
    TimeDistributed), with why.

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
    with restoring_layers(model):  # also undoes what the checks' calls set on the layers
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
                     f"{'+'.join(r.producers) or '-'} -> {', '.join(r.consumers)}"
                     + (f" [{r.channels} ch]" if r.channels else ""))  # 0: a layer alone
            print_fn(f"{where}: {what}")
    return copy, reports


def _permute(model, layers, search_options: dict, max_channels, progress, follow: bool) -> tuple:
    """`permute` on a checked model, its custom layers' calls followed or not: `(copy, reports,
    the custom layers followed)`."""
    graph = read_graph(model, follow)
    attention, repeated = find_attention_layers(graph)
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
            combined_efficacy(plan.rows, perms), (name,), heads=len(perms)))
        bar.update()
    bar.close()
    return copy, reports, graph.followed


class _Plan(NamedTuple):
    """A channel space to permute and its consumers' kernels as `[rows, channels]`."""

    space: Space
    rows: np.ndarray


def _plan(
    graph: Graph, selected: set[int] | None, max_channels: int | None
) -> tuple[list[_Plan], list[PermutationReport]]:
    """The channel spaces to permute (their kernels read and checked) and reports for the
    skipped ones; one per space that a selected consumer reads, and one per selected layer with
    kernels whose channels permute() leaves alone (`unpermuted_cause`: a grouped convolution) or
    holding such layers that it does not look inside (a custom layer called twice)."""
    plans, reports, seen = [], [], set()
    for name, op in graph.ops.items():
        if selected is not None and id(op) not in selected:
            continue
        by_input = argument_reads(graph, name)
        if not any(by_input):
            if cause := unpermuted_cause(op):
                reports.append(PermutationReport(None, (name,), 0, False,
                                                 f"{describe(name, op)} is not permuted: {cause}"))
            elif inner := [sub.name for sub in walk_layers(op) if read_axes(sub)]:
                why = (graph.unfollowed.get(name) or shared_reason(graph, name).removeprefix("is ")
                       or "permute() does not look inside it")
                reports.append(PermutationReport(None, (name,), 0, False, (
                    f"{describe(name, op)} is not followed ({why}): the input channels of the "
                    f"layers {inner} inside it keep their order")))
            continue
        if why := shared_reason(graph, name):
            reports.append(PermutationReport(None, (name,), 0, False,
                                             f"{describe(name, op)} {why}"))
            continue
        sources = dict.fromkeys(s for s, read in zip(graph.inputs[name][0], by_input) if read)
        for root in (root for source in sources for root in roots(graph, source)):
            if root in seen:
                continue
            space = channel_space(graph, root)
            seen.update(space.carriers)
            reason, channels = space.reason, space.channels
            if not reason and channels % 4:
                reason = f"{channels} channels, not a multiple of 4"
            if not reason and max_channels is not None and channels > max_channels:
                reason = f"{channels} channels > max_channels={max_channels}"
            rows = None if reason else _channel_rows(graph, space)
            if rows is None and not reason:
                reason = ("2:4 prunes none of the kernels that read these channels (their layers "
                          f"{list(space.consumers)} read a number of input channels that is not "
                          "a multiple of 4)")
            if reason:
                readers = tuple(space.consumers) if name in space.consumers else (name,)
                reports.append(PermutationReport(
                    next(iter(space.producers), None), readers, channels if space.producers else 0,
                    False, reason, producers=tuple(space.producers)))
            else:
                plans.append(_Plan(space, rows))
    return plans, reports


def _channel_rows(graph: Graph, space: Space) -> np.ndarray | None:
    """The consumers' kernels that read `space` (their `read_axes` kernels), at their offsets, as
    one `[rows, channels]` matrix (ASP's orientation); None if there are none. A kernel whose
    input channels (the whole axis: past a concatenation, more than the space) are not a multiple
    of 4 is left out: 2:4 does not prune it (`prune` skips it), so it gains nothing, though its
    channels are reordered with the others.

    Raises:
        ValueError: naming the first layer whose kernel has NaN/Inf.
    """
    rows = []
    for name, offset in space.consumers.items():
        axes = read_axes(graph.ops[name])
        for kernel, axis, _ in (a for role in space.reads[name] for a in axes[role] if a.grouped):
            if kernel.shape[axis] % 4:
                continue
            kernel = _finite(name, kernel)
            rows.append(channel_matrix(kernel, axis)[:, offset:offset + space.channels])
    return np.concatenate(rows) if rows else None


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


class _HeadPlan(NamedTuple):
    """An attention layer whose value heads to permute, and per value head the output
    projection's kernel for the query heads it serves as `[rows, head_dim]`."""

    attention: Attention
    rows: list[np.ndarray]


def _head_plans(
    graph: Graph, attention_layers: list[Attention], repeated: set[int],
    selected: set[int] | None,
) -> tuple[list[_HeadPlan], list[PermutationReport]]:
    """The attention layers whose value heads can be permuted, and reports for the others.

    Head j of the value projection (kernel `[d, Hv, Dv]`, bias `[Hv, Dv]`) writes the channels that
    the output projection (kernel `[Hq, Dv, ...]`, grouped along Dv) reads at the query heads it
    serves (MultiHeadAttention: head j; GroupQueryAttention, which repeats each value head for
    Hq / Hv query heads: heads j * Hq/Hv ... (j + 1) * Hq/Hv - 1, whose gate channels, if any,
    multiply them). Attention weighs all Dv channels of a head alike, so each value head's
    channels can be reordered on their own, whatever the layer's inputs and outputs are (it may
    be called several times). `attention_layers` and `repeated`: `find_attention_layers(graph)`."""
    plans, reports = [], []
    for attention in attention_layers:
        name, op = attention.name, attention.layer
        if not op.built or (selected is not None and id(op) not in selected):
            continue
        parts = attention_projections(op)
        heads, value_dim = parts["value"].kernel.shape[-2:]
        query_heads = parts["output"].kernel.shape[0]
        reason = frozen_reason(name, op)
        if not reason and (id(op) in repeated or attention.holder in graph.hidden):
            reason = f"{describe(name, op)} is shared (also used inside another layer)"
        if not reason and value_dim % 4:
            reason = f"value_dim {value_dim}, not a multiple of 4"
        if not reason and (query_heads % heads or parts["output"].kernel.shape[1] != value_dim):
            reason = f"{describe(name, op)} has projections of unexpected shapes"
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
        raise RuntimeError(f"permute(): {describe(name, op)} has no matching copy in the copied "
                           "model; nothing was returned.")
    return new


def _apply(graph: Graph, copies: dict, space: Space, perm: np.ndarray) -> None:
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
        for variable, axis, _ in write_axes(layer) or [  # or a producer found by a trial run
                WeightAxis(w, w.ndim - 1) for w in layer.weights if w.ndim]:  # scalars stay
            take(variable, axis, offset)
        refresh_statistics(layer)
    for name, offset in space.through.items():
        # BatchNormalization/LayerNormalization: [C]; probed layers: [..., C]; depthwise: kernel
        # [..., C, 1], bias [C]; grouped depthwise ConvND: kernel [..., 1, C], bias [C]; keras ops
        # have no weights.
        op = graph.ops[name]  # a weightless one needs no copy (a layer made in a traced call)
        layer = copy_of(name) if isinstance(op, keras.layers.Layer) and op.weights else None
        for variable in layer.weights if layer is not None else []:
            if variable.ndim == 0:  # a probed layer's scalar (ReZero's alpha)
                continue
            depthwise = keras_kind(layer) in DEPTHWISE and variable.ndim > 1
            take(variable, variable.ndim - 2 if depthwise else variable.ndim - 1, offset)
        if layer is not None:
            refresh_statistics(layer)
    for name, offset in space.consumers.items():
        axes = read_axes(copy_of(name))
        for role in space.reads[name]:
            for variable, axis, _ in axes[role]:
                take(variable, axis, offset)


def _apply_heads(copies: dict, attention: Attention, perms: list[np.ndarray]) -> None:
    """Reorders each value head's channels in the copy of `attention`: the value projection's
    kernel and bias along Dv, the output projection's kernel (and a gate's kernel and bias) along
    Dv at the query heads it serves."""
    parts = attention_projections(_copy_of(copies, attention.name, attention.layer))
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
        return random_array([2 if i == 0 and d is None else length if d is None else d
                              for i, d in enumerate(spec.shape)], spec.dtype, rng)

    # A Sequential model has no `input` (Keras 3 never calls it itself): its one input is in
    # `inputs`.
    spec = model.inputs[0] if isinstance(model, keras.Sequential) else model.input
    return keras.tree.map_structure(draw, spec)


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
        refresh_statistics(copy)
        moved = _outputs(copy, inputs)[0][index]
        return float(np.nanmax(np.abs(moved - output), initial=0.0))
    finally:
        copy.set_weights(weights)
        refresh_statistics(copy)
