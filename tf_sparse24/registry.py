"""Which weights of which Keras layers are prunable, and along which axis (DESIGN.md contract 1).

The registry is data: `PRUNABLE_WEIGHTS` maps a layer class to `{relative variable path: grouping
axis}`. A path matches a variable whose path relative to the layer ends with it; EinsumDense
(axis from its equation) and ReversibleEmbedding (its untied projection) are matched in code. An
RNN layer (LSTM, GRU, SimpleRNN, ConvLSTM1D/2D/3D, `RNN(cell)`, `RNN([cells])`) prunes the
registered weights of its cells, and Bidirectional / TimeDistributed those of the layers they
hold. Layers outside the registry can opt in with the `PrunableLayer` protocol: a
`get_prunable_weights()` method returning variables (grouped along axis `ndim - 2`, the input
axis of Keras' kernel layout) or `(variable, axis)` pairs.
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

import keras

from tf_sparse24.masks import parse_pattern

L = keras.layers

PRUNABLE_WEIGHTS: dict[type, dict[str, int]] = {
    L.Dense: {"kernel": 0},
    L.Conv1D: {"kernel": -2},
    L.Conv2D: {"kernel": -2},
    L.Conv3D: {"kernel": -2},
    # Transposed convs sum over their input channels, the last kernel axis: `[..., out, in]`.
    L.Conv1DTranspose: {"kernel": -1},
    L.Conv2DTranspose: {"kernel": -1},
    L.Conv3DTranspose: {"kernel": -1},
    L.SeparableConv1D: {"pointwise_kernel": -2},
    L.SeparableConv2D: {"pointwise_kernel": -2},
    L.MultiHeadAttention: {
        "query/kernel": 0,
        "key/kernel": 0,
        "value/kernel": 0,
        "attention_output/kernel": 1,
    },
    # RNN cells (an RNN layer is pruned through its cells): kernel `[in, g*u]`, recurrent_kernel
    # `[u, g*u]`. ConvLSTM layers (their cell class is not public): `[..., in, 4*f]` and
    # `[..., f, 4*f]`.
    L.SimpleRNNCell: {"kernel": 0, "recurrent_kernel": 0},
    L.GRUCell: {"kernel": 0, "recurrent_kernel": 0},
    L.LSTMCell: {"kernel": 0, "recurrent_kernel": 0},
    L.ConvLSTM1D: {"kernel": -2, "recurrent_kernel": -2},
    L.ConvLSTM2D: {"kernel": -2, "recurrent_kernel": -2},
    L.ConvLSTM3D: {"kernel": -2, "recurrent_kernel": -2},
}

# Layers skipped on purpose, with the reason shown by `report()`.
SKIP_REASONS: dict[type, str] = {
    L.DepthwiseConv1D: "depthwise kernel: no reduction over input channels to group",
    L.DepthwiseConv2D: "depthwise kernel: no reduction over input channels to group",
    L.Embedding: "embedding lookup is not a matmul",
}


TIED_EMBEDDINGS = (
    "tied embeddings: the table is also the reverse projection (a lookup, not a matmul); "
    "tie_weights=False gives a separate, prunable projection"
)


@runtime_checkable
class PrunableLayer(Protocol):
    """A user layer that names its prunable weights."""

    def get_prunable_weights(self) -> list:  # variables or (variable, axis) pairs
        ...


def relative_variables(layer: keras.layers.Layer) -> dict[str, keras.Variable]:
    """Maps each variable of `layer` to its path relative to the layer ("query/kernel").

    The path is made of the names of the sublayers down to the variable's owner, not taken from
    `variable.path`: that holds whatever name scope the variable was created in, which differs
    between a layer and its copy built from config (a cell built outside its RNN's scope). State
    outside sublayers (RNG seeds) keeps its own path.
    """
    tree = {}

    def visit(sub, prefix):
        for var in own_variables(sub):
            tree.setdefault(id(var), prefix + var.name)
        for child in sub._flatten_layers(include_self=False, recursive=False):
            visit(child, f"{prefix}{child.name}/")

    visit(layer, "")
    return {tree.get(id(var), var.path): var for var in layer.variables}


def own_variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The variables `layer` itself created (not its sublayers'), in creation order."""
    return layer._trainable_variables + layer._non_trainable_variables


def scope_relative_variables(layer: keras.layers.Layer) -> dict[str, keras.Variable]:
    """Variables by their path after the layer's name in `variable.path` (the last time it occurs):
    the paths of wrapper configs saved before `relative_variables` (they differ from it where a
    sublayer has the layer's own name)."""
    out = {}
    for var in layer.variables:
        parts = var.path.split("/")
        owners = [i for i, part in enumerate(parts[:-1]) if part == layer.name]
        out["/".join(parts[owners[-1] + 1 :]) if owners else var.path] = var
    return out


def lora_layers(layer: keras.layers.Layer, variables) -> list[str]:
    """Names of the layers under `layer` (itself included) with LoRA enabled on one of
    `variables`: the kernel such a layer uses is `kernel + lora_a @ lora_b`, dense whatever the
    mask on `kernel`."""
    ids = {id(v) for v in variables}
    return [
        sub.name
        for sub in layer._flatten_layers(include_self=True)
        if getattr(sub, "lora_enabled", False) and id(getattr(sub, "_kernel", None)) in ids
    ]


def quantized_layers(layer: keras.layers.Layer) -> list[str]:
    """Names of the layers under `layer` (itself included) that Keras quantized
    (`layer.quantize("int8")`, ...): the kernel they use is rebuilt from the raw weight, outside any
    mask."""
    return [
        sub.name
        for sub in layer._flatten_layers(include_self=True)
        if getattr(sub, "quantization_mode", None)
    ]


def einsum_parts(equation: str) -> tuple[str, str, str] | None:
    """An EinsumDense equation's input, kernel and output subscripts (`"abc,cd->abd"` ->
    `("abc", "cd", "abd")`; the input and output may hold `...`); None if it does not parse."""
    match = re.match(r"^([\w.]+),(\w+)->([\w.]+)$", equation.replace(" ", ""))
    return None if match is None else match.groups()


def einsum_axis(equation: str) -> int | str:
    """Grouping axis of an EinsumDense kernel, or the reason it is not prunable.

    The last contracted kernel axis (in the input, not in the output), wherever it sits: Gemma's
    `btd,ndh->btnh` groups along d (axis 1), `abc,dc->abd` along c. Groups of consecutive
    elements along it all sum into the same output, as contract 1 asks; the format's [K, N] view
    (`format.to_2d`) keeps them whole for any axis.
    """
    parts = einsum_parts(equation)
    if parts is None:
        return f"cannot parse einsum equation {equation!r}"
    inputs, kernel, output = parts
    contracted = [i for i, c in enumerate(kernel) if c in inputs and c not in output]
    if not contracted:
        return f"einsum equation {equation!r} contracts no kernel axis"
    return contracted[-1]


def eligible_weights(
    layer: keras.layers.Layer, pattern: str = "2:4"
) -> list[tuple[str, keras.Variable, int]]:
    """The `(relative path, variable, axis)` triples of a built, unwrapped layer to prune.

    Example:
        >>> eligible_weights(dense)  # a built Dense(8) on 16 inputs
        [('kernel', <Variable path=dense/kernel, shape=(16, 8), ...>, 0)]
    """
    return scan_layer(layer, parse_pattern(pattern)[1])[0]


def scan_layer(
    layer: keras.layers.Layer, m: int = 4
) -> tuple[list[tuple[str, keras.Variable, int]], list[str]]:
    """Like `eligible_weights`, plus the reasons for every weight or layer kind skipped.

    Args:
        layer: a built Keras layer.
        m: group size M; weights whose axis size is not a multiple of M are skipped.

    Returns:
        `(eligible, reasons)`; `reasons` is empty when the layer is simply not a prunable kind.
    """
    if quantized := quantized_layers(layer):
        return [], [f"quantized {quantized}: prune the float model, then quantize strip(pruned)"]
    candidates, reasons = _candidates(layer)
    eligible = []
    for path, var, axis in candidates:
        if lora := lora_layers(layer, [var]):
            reasons.append(
                f"{path}: LoRA is enabled on {lora[0]!r} (kernel + lora_a @ lora_b is dense)"
            )
            continue
        if var.ndim < 2:
            reasons.append(f"{path} has rank {var.ndim}: nothing to group")
            continue
        axis %= var.ndim
        if var.shape[axis] % m:
            reasons.append(
                f"{path} {tuple(var.shape)}: axis {axis} size {var.shape[axis]} is not a multiple "
                f"of {m}"
            )
        else:
            eligible.append((path, var, axis))
    return eligible, reasons


def _candidates(
    layer: keras.layers.Layer,
) -> tuple[list[tuple[str, keras.Variable, int]], list[str]]:
    """The `(relative path, variable, axis)` triples the registry names for `layer`, before the
    shape checks, and the reasons a kind of layer (or an RNN's cell) is skipped."""
    variables = relative_variables(layer)
    if isinstance(layer, PrunableLayer):
        named = {id(v): p for p, v in variables.items()}
        candidates = []
        for item in layer.get_prunable_weights():
            var, axis = item if isinstance(item, tuple) else (item, item.ndim - 2)
            if id(var) not in named:
                raise ValueError(
                    f"Layer {layer.name!r}: get_prunable_weights() returned {var.path}, which is not "
                    "one of its own variables."
                )
            if var.ndim >= 2 and not -var.ndim <= axis < var.ndim:
                raise ValueError(
                    f"Layer {layer.name!r}: get_prunable_weights() returned {var.path} "
                    f"{tuple(var.shape)} with axis {axis}: expected an axis in "
                    f"[{-var.ndim}, {var.ndim - 1}]."
                )
            candidates.append((named[id(var)], var, axis))
        return candidates, []
    if isinstance(layer, L.EinsumDense):
        axis = einsum_axis(layer.equation)
        if isinstance(axis, str):
            return [], [axis]
        # `_kernel`: with LoRA enabled `kernel` is the computed `_kernel + lora_a @ lora_b`.
        return [(p, v, axis) for p, v in variables.items() if v is layer._kernel], []
    if isinstance(layer, L.ReversibleEmbedding):  # `x @ reverse_embeddings` [dim, vocab]: a matmul
        if layer.tie_weights:
            return [], [TIED_EMBEDDINGS]
        return [
            (p, v, 0) for p, v in variables.items() if v is layer.reverse_embeddings
        ], [f"embeddings: {SKIP_REASONS[L.Embedding]}"]
    table = next((t for cls, t in PRUNABLE_WEIGHTS.items() if type(layer) is cls), None)
    if table is None:
        table = next((t for cls, t in PRUNABLE_WEIGHTS.items() if isinstance(layer, cls)), None)
    if table is not None:
        return [
            (p, v, axis)
            for suffix, axis in table.items()
            for p, v in variables.items()
            if p == suffix or p.endswith("/" + suffix)
        ], []
    if isinstance(layer, (L.RNN, L.Bidirectional, L.TimeDistributed)):
        if isinstance(layer, L.RNN):
            inner = layer.cell.cells if isinstance(layer.cell, L.StackedRNNCells) else [layer.cell]
        elif isinstance(layer, L.Bidirectional):
            inner = [layer.forward_layer, layer.backward_layer]
        else:
            inner = [layer.layer]
        path = {id(v): p for p, v in variables.items()}
        candidates, reasons = [], []
        for sub in inner:  # an RNN's cells, a Bidirectional's two RNNs, TimeDistributed's layer
            found, why = _candidates(sub)
            candidates += [(path[id(v)], v, axis) for _, v, axis in found]
            inside = sub._flatten_layers(include_self=False)  # a custom cell's own Dense, ...
            if not (found or why or any(_candidates(s)[0] for s in inside)):
                why = [f"{sub.name!r} ({type(sub).__name__}) is not a prunable kind"]
            reasons += why
        return candidates, reasons
    reason = next((r for cls, r in SKIP_REASONS.items() if isinstance(layer, cls)), None)
    return [], [reason] if reason else []
