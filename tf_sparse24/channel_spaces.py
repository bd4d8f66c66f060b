"""Which layers of a model graph share one channel space, and which weight axes follow its order.

A channel space is a set of channels that producers write (Dense/ConvND, SeparableConv,
EinsumDense, attention output projections, Embedding tables) and consumers read (their kernels'
input axes; also GRU, LSTM and SimpleRNN, alone or in a Bidirectional), through layers that
commute with a reordering of the channels: activations, normalizations, depthwise convolutions,
elementwise merges (a residual add joins its branches) and concatenations (past which the space
is a slice at an offset).
`channel_space` walks the graph from a layer's output and says why a space cannot be permuted;
`read_axes` and `write_axes` name the weight axes along a layer's input and output channels;
`unpermuted_cause` says why a layer with kernels is left alone. Layers no rule covers are tried
on random inputs (`_probe`).
"""

from __future__ import annotations

import collections
import inspect
import itertools
from typing import NamedTuple

import keras
import numpy as np

from tf_sparse24.model_graph import Graph, call_constants, describe, keras_kind, tensor_specs
from tf_sparse24.registry import einsum_axis, einsum_parts
from tf_sparse24.wrapper import Sparse24, sublayers, walk_layers

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
DEPTHWISE = {"DepthwiseConv1D", "DepthwiseConv2D"}


# Depthwise then pointwise: depthwise_kernel [..., C, m], pointwise_kernel [..., C * m, out].
_SEPARABLE = {"SeparableConv1D", "SeparableConv2D"}


_KERNEL_LAYERS = {"Dense", "Conv1D", "Conv2D", "Conv3D"}  # producers and consumers
# Recurrent layers whose cell kernel `[in, gates * units]` reads the input's channels along axis 0,
# as a Dense kernel does: consumers, also as both layers of a Bidirectional (`_bidirectional`).
# Their output, a recurrent state, is not reordered.
_RECURRENT = {"GRU", "LSTM", "SimpleRNN"}
# Layers with kernels that permute() leaves alone, for the reasons `unpermuted_cause` gives.
_TRANSPOSED = {"Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"}
_OTHER_RECURRENT = {"RNN", "Bidirectional", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D"}


# Attention layers (Keras' own): projections read the residual stream, value heads are permuted.
_ATTENTION = {"MultiHeadAttention", "GroupedQueryAttention"}  # keras.layers.GroupQueryAttention


class Space(NamedTuple):
    """The layers that share one channel space (one order of the same `channels`): name -> offset
    of those channels in the layer's channel axis (non-zero past a concatenation), graph order."""

    producers: dict[str, int]  # whose `write_axes` axes carry the channels
    through: dict[str, int]  # pass-through, merge and concatenation layers on the way
    consumers: dict[str, int]  # whose `read_axes` axes read them
    reads: dict[str, tuple[str, ...]]  # per consumer, the `read_axes` entries that read them
    channels: int
    carriers: set[str]  # layers whose whole output is the space (seeds of the same space)
    reason: str  # why the space cannot be permuted ('' when it can)


def channel_space(graph: Graph, seed: str) -> Space:
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
            reasons.append(f"channels reach {describe(name, graph.ops[name])} at two offsets")

    for name in queue:  # grows while iterating
        offset, op = carriers[name], graph.ops.get(name)
        if op is None or isinstance(op, keras.layers.InputLayer):
            reasons.append("its input channels come from the model input")
            continue
        if why := shared_reason(graph, name):
            reasons.append(f"its input channels come from {describe(name, op)}, which {why}")
            continue
        if not isinstance(op.output, keras.KerasTensor):
            reasons.append(f"its input channels come from {describe(name, op)}, which has several "
                           "outputs")
            continue
        if not channels and _output_channels(op) is None:
            reasons.append(f"{describe(name, op)} has an unknown number of channels")
            continue
        channels = channels or int(_output_channels(op))
        if offset == 0 and _output_channels(op) == channels:
            whole.add(name)
        if write_axes(op):
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
                reasons.append(f"channels straddle two inputs of {describe(name, op)}")
                continue
            carry(graph.inputs[name][0][inside[0]], offset - starts[inside[0]])
        elif _probe(graph, name, produces=True):
            producers[name] = offset
        else:
            reasons.append(f"its input channels come from {describe(name, op)}, which "
                           f"{_cannot(graph, name)}")
            continue
        if name in graph.outputs:
            reasons.append(f"{name!r} is a model output")
        for user in graph.consumers.get(name, []):
            op = graph.ops[user]
            if why := shared_reason(graph, user):
                reasons.append(f"channels reach {describe(user, op)}, which {why}")
            elif read_axes(op):
                by_input = argument_reads(graph, user)
                at = [i for i, source in enumerate(graph.inputs[user][0]) if source == name]
                if not all(by_input[i] for i in at):
                    reasons.append(f"channels reach {describe(user, op)} as an input that no "
                                   "kernel of it reads")
                if offset % 4:  # its groups of 4 would mix these channels with others
                    reasons.append(f"channels reach {describe(user, op)} at input channel {offset}, "
                                   "not a multiple of 4")
                if consumers.setdefault(user, offset) != offset:
                    reasons.append(f"channels reach {describe(user, op)} at two offsets")
                reads[user] = {*reads.get(user, ()), *(r for i in at for r in by_input[i])}
            elif carrying := _carrying(graph, user):
                if name in (graph.inputs[user][0][i] for i in carrying):
                    carry(user, offset)
                else:
                    reasons.append(f"channels reach {describe(user, op)}, which broadcasts them")
            elif starts := _segments(graph, user):
                at = [i for i, source in enumerate(graph.inputs[user][0]) if source == name]
                if len(at) > 1:
                    reasons.append(f"channels reach {describe(user, op)} {len(at)} times")
                carry(user, starts[at[0]] + offset)
            else:
                reasons.append(f"channels reach {describe(user, op)}, which "
                               f"{_cannot(graph, user)}")
    order = {name: i for i, name in enumerate(graph.ops)}
    producers, through, consumers = (dict(sorted(group.items(), key=lambda item: order[item[0]]))
                                     for group in (producers, through, consumers))
    if not reasons and not producers:
        reasons.append("no Dense/Conv layer produces these channels")
    if not reasons:
        reasons += [f"the activation of {describe(n, graph.ops[n])} is not known to act "
                    "channel by channel (a custom function)"
                    for n in [*producers, *through] if not _activation_commutes(graph.ops[n])]
        reasons += filter(None, (frozen_reason(n, graph.ops[n]) for n in [*producers, *through,
                                                                     *consumers]))
    reads = {user: tuple(r for r in read_axes(graph.ops[user]) if r in roles)  # in read_axes' order
             for user, roles in reads.items()}
    return Space(producers, through, consumers, reads, channels, whole,
                  reasons[0] if reasons else "")


def roots(graph: Graph, name: str) -> list[str]:
    """Where the channel spaces in `name`'s output start: back through pass-through layers and
    into each input of a concatenation."""
    op = graph.ops.get(name)
    if op is None or isinstance(op, keras.layers.InputLayer) or shared_reason(graph, name):
        return [name]
    if _carrying(graph, name) == [0] and len(graph.inputs[name][0]) == 1:
        return roots(graph, graph.inputs[name][0][0])
    if _segments(graph, name):
        return list(dict.fromkeys(r for s in graph.inputs[name][0] for r in roots(graph, s)))
    return [name]


def _cannot(graph: Graph, name: str) -> str:
    """'cannot be permuted', and why not for a custom layer whose call was not followed, a
    constant Normalization or a layer `unpermuted_cause` knows."""
    why = graph.unfollowed.get(name)
    if not why and _constant_normalization(graph.ops.get(name)):
        why = ("its mean and variance are constants given to its constructor, not weights that "
               "could be reordered: adapt() it instead")
    why = why or unpermuted_cause(graph.ops.get(name))
    return f"cannot be permuted ({why})" if why else "cannot be permuted"


def unpermuted_cause(layer) -> str:
    """Why permute() does not reorder the channels of `layer`, a Keras layer with kernels, in a few
    words for the reports ('' for any other layer): a grouped, transposed, channels-first or
    depth-multiplying convolution (SeparableConv: its input), or a recurrent layer (GRU, LSTM and
    SimpleRNN, alone or in a Bidirectional: their output)."""
    kind = keras_kind(layer)
    convolutions = {*_KERNEL_LAYERS, *_TRANSPOSED, *_SEPARABLE, *DEPTHWISE} - {"Dense"}
    if kind in convolutions and getattr(layer, "data_format", None) == "channels_first":
        return "data_format='channels_first'"
    if kind in _KERNEL_LAYERS and getattr(layer, "groups", 1) > 1 and not _grouped_depthwise(layer):
        return f"grouped convolution, groups={layer.groups}"
    if kind in _TRANSPOSED:
        return "transposed convolution"
    if kind in DEPTHWISE and layer.depth_multiplier > 1:
        return f"depth_multiplier={layer.depth_multiplier} interleaves its output channels"
    if kind in _SEPARABLE and layer.depth_multiplier > 1:  # its pointwise kernel: a producer
        return f"depth_multiplier={layer.depth_multiplier}: only its output channels are reordered"
    if kind in _RECURRENT or _bidirectional(layer):
        return "recurrent layer: only its input channels are reordered"
    if kind in _OTHER_RECURRENT:
        return ("recurrent layer (of these, only GRU, LSTM and SimpleRNN, alone or as both layers "
                "of a Bidirectional, read reordered channels)")
    return ""


def _bidirectional(layer) -> bool:
    """Whether `layer` is a Keras Bidirectional whose forward and backward layers (the backward
    one may be given apart: `backward_layer=`) are both GRU, LSTM or SimpleRNN: each reads the
    input's channels along its cell kernel's axis 0."""
    return keras_kind(layer) == "Bidirectional" and all(
        keras_kind(rnn) in _RECURRENT for rnn in (layer.forward_layer, layer.backward_layer))


def _constant_normalization(layer) -> bool:
    """A `keras.layers.Normalization` given its mean and variance as constructor constants: they
    are not weights, so a permutation cannot reorder them."""
    return keras_kind(layer) == "Normalization" and layer.input_mean is not None


def frozen_reason(name: str, layer: keras.Operation) -> str:
    """Why `layer`'s weights cannot be permuted as plain arrays ('' when they can): it or a layer
    inside it (MultiHeadAttention's projections) is quantized or has LoRA enabled."""
    if not isinstance(layer, keras.layers.Layer):  # a keras op: no weights
        return ""
    layers = [layer, *walk_layers(layer)]
    if quantized := [sub for sub in layers if getattr(sub, "quantization_mode", None)]:
        return (f"{describe(name, layer)} is quantized ({quantized[0].quantization_mode}): "
                "permute the float model, then quantize")
    if any(getattr(sub, "lora_enabled", False) for sub in layers):
        return (f"LoRA is enabled on {describe(name, layer)} (the weights it uses are w + "
                "lora_a @ lora_b)")
    return ""


def shared_reason(graph: Graph, name: str) -> str:
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
            read_axes(graph.ops[name]) or write_axes(graph.ops[name]) or _carrying(graph, name)
            or _segments(graph, name)):
        return "combines several inputs other than channel by channel"
    return ""


class WeightAxis(NamedTuple):
    """A weight axis whose entries follow a channel space's order."""

    variable: keras.Variable
    axis: int
    grouped: bool = True  # its 2:4 groups run along it: its rows enter the search


def read_axes(layer) -> dict[str, list[WeightAxis]]:
    """How `layer` reads each of its inputs' channels, by call argument: the weight axes that
    run along them (the `grouped` ones, whose 2:4 groups run along them, are searched; the others
    are reordered with them); {} if permute() cannot reorder them.

    Dense/ConvND (channels_last, groups=1): kernel axis -2. SeparableConv (depth_multiplier 1): its
    pointwise kernel, and its depthwise filters (not grouped). EinsumDense: the kernel axis
    contracted with the input's last axis. GRU, LSTM, SimpleRNN: their cell's kernel axis 0 (of
    `[in, gates * units]`); a Bidirectional of them: that of its forward and backward layers.
    MultiHeadAttention and GroupQueryAttention: that axis of their query
    (and gate), key and value projections.
    """
    kind = keras_kind(layer) if _built_channels_last(layer) else ""
    if kind in _KERNEL_LAYERS and getattr(layer, "groups", 1) == 1:
        return {"inputs": [WeightAxis(layer.kernel, layer.kernel.ndim - 2)]}
    if kind in _SEPARABLE and layer.depth_multiplier == 1:
        pointwise, depthwise = layer.pointwise_kernel, layer.depthwise_kernel  # [..., C, out|1]
        return {"inputs": [WeightAxis(pointwise, pointwise.ndim - 2),
                           WeightAxis(depthwise, depthwise.ndim - 2, grouped=False)]}
    if kind == "EinsumDense":
        axis = _einsum_reads(layer)
        return {"inputs": [axis]} if axis else {}
    if kind in _RECURRENT:
        return {"sequences": [WeightAxis(layer.cell.kernel, 0)]}
    if kind and _bidirectional(layer):
        return {"sequences": [WeightAxis(rnn.cell.kernel, 0)
                              for rnn in (layer.forward_layer, layer.backward_layer)]}
    if kind in _ATTENTION:
        parts = attention_projections(layer)
        axes = {role: _einsum_reads(parts[role]) for role in ("query", "key", "value", "gate")
                if role in parts}
        if not all(axes.values()):
            return {}
        reads = {role: [axes[role]] for role in ("query", "key", "value")}
        reads["query"] += [axes["gate"]] if "gate" in axes else []
        return reads
    return {}


def write_axes(layer) -> list[WeightAxis]:
    """The weight axes that `layer`'s output channels come from, the kernel's first; [] if
    permute() cannot reorder them.

    Dense/ConvND (channels_last, groups=1) and SeparableConv: the (pointwise) kernel's last axis and
    the bias. EinsumDense: the kernel axis (and bias axis) of the output's last axis.
    MultiHeadAttention and GroupQueryAttention: those of their output projection. Embedding: the
    table's last axis.
    """
    kind = keras_kind(layer) if _built_channels_last(layer) else ""
    if (kind in _KERNEL_LAYERS and getattr(layer, "groups", 1) == 1) or kind in _SEPARABLE:
        kernel = layer.kernel if kind in _KERNEL_LAYERS else layer.pointwise_kernel
        bias = [WeightAxis(layer.bias, 0)] if layer.bias is not None else []
        return [WeightAxis(kernel, kernel.ndim - 1), *bias]
    if kind == "EinsumDense":
        return _einsum_writes(layer)
    if kind in _ATTENTION:
        return _einsum_writes(attention_projections(layer)["output"])
    if kind == "Embedding":
        return [WeightAxis(layer.embeddings, 1)]
    return []


def attention_projections(layer) -> dict:
    """An attention layer's EinsumDense projections by role: query, key, value, output, and
    GroupQueryAttention's gate when it has one (that class keeps them in private attributes)."""
    if keras_kind(layer) == "MultiHeadAttention":
        return {"query": layer.query_dense, "key": layer.key_dense, "value": layer.value_dense,
                "output": layer.output_dense}
    parts = {"query": layer._query_dense, "key": layer._key_dense, "value": layer._value_dense,
             "output": layer._output_dense}
    if layer.use_gate:  # sigmoid(gate(query)) multiplies each head's output, channel by channel
        parts["gate"] = layer._gate_dense
    return parts


def _einsum_reads(layer) -> WeightAxis | None:
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
    return WeightAxis(layer.kernel, axis) if einsum_axis(layer.equation) == axis else None


def _einsum_writes(layer) -> list[WeightAxis]:
    """The kernel axis (and bias axis) that an EinsumDense's output's last axis comes from alone
    (`abc,cd->abd`: kernel axis 1, bias axis 0); [] when there is none."""
    parts = einsum_parts(layer.equation)
    if parts is None:
        return []
    inputs, kernel, output = parts
    c = output[-1]
    if c == "." or output.count(c) != 1 or kernel.count(c) != 1 or c in inputs:
        return []
    axes = [WeightAxis(layer.kernel, kernel.index(c))]
    if layer.bias is not None and c in (layer.bias_axes or ""):  # bias [..., C]; else [..., 1]
        axes.append(WeightAxis(layer.bias, layer.bias.ndim - 1))
    return axes


def _built_channels_last(layer) -> bool:
    """Whether `layer` is built and keeps its channels last (the only layout permute() reorders)."""
    return (getattr(layer, "built", False)
            and getattr(layer, "data_format", "channels_last") == "channels_last")


def _roles(graph: Graph, name: str) -> list[str]:
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
        roles += [params[i] if i < len(params) else ""] * len(tensor_specs(arg))
    for key, value in call.get("kwargs", {}).items():
        roles += [key] * len(tensor_specs(value))
    return roles if len(roles) == len(sources) else []


def argument_reads(graph: Graph, name: str) -> list[tuple[str, ...]]:
    """For each input of `name`'s first call, the entries of `read_axes` that read it: () for an
    input no kernel reads (an attention mask); an attention layer's value is also its key when no key
    is passed."""
    op = graph.ops[name]
    sources = (graph.inputs.get(name) or [[]])[0]
    reads = read_axes(op)
    roles = _roles(graph, name) if reads else []
    if not roles:
        return [()] * len(sources)
    if keras_kind(op) in _ATTENTION and "key" not in roles:
        return [("value", "key") if role == "value" else (role,) if role in reads else ()
                for role in roles]
    return [(role,) if role in reads else () for role in roles]


def _grouped_depthwise(layer) -> bool:
    """Whether `layer` is a ConvND with one group per channel (ConvNeXt's depthwise convolution:
    `Conv2D(C, 7, groups=C)`, kernel [..., 1, C]): per channel, like DepthwiseConv."""
    return (keras_kind(layer) in _KERNEL_LAYERS - {"Dense"} and layer.built
            and layer.groups > 1 and layer.groups == layer.filters == layer.input.shape[-1])


def _passes(layer) -> bool:
    """Whether an unshared `layer` commutes with a permutation of its input's last axis."""
    kind = keras_kind(layer)
    if not isinstance(layer, keras.layers.Layer):
        return False
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return False
    if kind in DEPTHWISE:  # one filter per channel; a multiplier > 1 interleaves outputs
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


def _elementwise_op(graph: Graph, name: str) -> bool:
    """Whether keras op `name` computes each channel from the same channel of its tensor inputs
    alone (see `_ELEMENTWISE_OPS`)."""
    op = graph.ops[name]
    kind = keras_kind(op)
    if isinstance(op, keras.layers.Layer) or kind not in {*_ELEMENTWISE_OPS, *_CHANNEL_SOFTMAX_OPS}:
        return False
    attributes = {k: v for k, v in vars(op).items() if not k.startswith("_") and k != "name"}
    if kind in _CHANNEL_SOFTMAX_OPS:
        axis = attributes.pop("axis", None)
        if axis not in (-1, len(op.output.shape) - 1):
            return False
    constants = call_constants(graph.calls.get(name, {}))
    return all(map(_same_for_every_channel, [*attributes.values(), *constants]))


def _carrying(graph: Graph, name: str) -> list[int]:
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
    merges = isinstance(op, keras.layers.Layer) and keras_kind(op) in _MERGE
    if merges or _elementwise_op(graph, name):
        return [i for i, w in enumerate(widths) if w == channels]
    if all(w == channels for w in widths) and _probe(graph, name):
        return list(range(len(widths)))
    return []


def _probe(graph: Graph, name: str, produces: bool = False) -> bool:
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


def _commutes_when_run(graph: Graph, name: str, move_inputs: bool) -> bool:
    layer, channels = graph.ops[name], _output_channels(graph.ops[name])
    if (channels is None or channels < 2 or not isinstance(layer, keras.layers.Layer)
            or isinstance(layer, (keras.Model, keras.layers.InputLayer)) or not layer.built
            or any(len(w.shape) and w.shape[-1] != channels for w in layer.weights)
            or not (move_inputs or any(len(w.shape) for w in layer.weights))):
        return False
    call = graph.calls.get(name, {})  # a Sequential layer: called on its one input
    kwargs, args = call.get("kwargs", {}), call.get("args", [])
    specs = tensor_specs(call) if call else [{"shape": layer.input.shape,
                                               "dtype": layer.input.dtype}]
    packed = len(args) == 1 and isinstance(args[0], (list, tuple))  # layer([a, b])
    if not all(map(_same_for_every_channel, kwargs.values())) or (
            call and len(args[0] if packed else args) != len(specs)):  # a constant among them
        return False
    rng = np.random.default_rng(0)
    inputs = [random_array([2 if d is None else d for d in spec["shape"]],
                            spec.get("dtype") or "float32", rng) for spec in specs]
    weights = [np.asarray(w) for w in layer.get_weights()]

    # A layer that takes `training` is tried in both modes (it might act otherwise in training).
    modes = [kwargs, *([{**kwargs, "training": True}] if "training" in inspect.signature(
        layer.call).parameters else [])]

    def run(copy, perm: np.ndarray, mode: dict) -> np.ndarray:
        moved = [x[..., perm] for x in inputs] if move_inputs else inputs
        if weights:  # scalars (ReZero's alpha) stay as they are
            copy.set_weights([w[..., perm] if w.ndim else w for w in weights])
            refresh_statistics(copy)
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


def _segments(graph: Graph, name: str) -> list[int]:
    """Where each input's channels start in the output of `name`, a channel-axis concatenation
    (a Concatenate layer or `keras.ops.concatenate`), and its width last (`[0, w0, w0 + w1,
    ...]`); empty for anything else."""
    op = graph.ops[name]
    if keras_kind(op) != "Concatenate":
        return []
    widths = graph.widths.get(name, [])
    if op.axis not in (-1, len(op.output.shape) - 1) or not widths or None in widths:
        return []
    starts = list(itertools.accumulate(widths, initial=0))
    # A constant among the inputs (`ops.concatenate([coords, x])`) has channels too.
    return starts if starts[-1] == _output_channels(op) else []


class Attention(NamedTuple):
    """An attention layer (`_ATTENTION`) of a model's graph, or inside one of its layers."""

    name: str  # in reports: its graph name, or 'holder/attention' inside a layer
    holder: str  # graph name of the layer that holds it (itself at the top)
    layer: keras.layers.Layer


def find_attention_layers(graph: Graph) -> tuple[list[Attention], set[int]]:
    """Every attention layer of the graph, at the top or inside another layer (a transformer
    block layer, a nested model), named by its path ('encoder/block_1/attention'); and the ids of
    those found more than once (held by two layers, or twice by one)."""
    found, count = {}, collections.Counter()

    def visit(layer, path: str, holder: str, above: frozenset) -> None:
        if keras_kind(layer) in _ATTENTION:
            count[id(layer)] += 1
            found.setdefault(id(layer), Attention(path, holder, layer))
        elif not isinstance(layer, Sparse24) and id(layer) not in above:  # masks: not entered
            subs = {id(sub): sub for sub in sublayers(layer)}  # Keras also lists them in _layers
            for sub in subs.values():
                visit(sub, f"{path}/{sub.name}", holder, above | {id(layer)})

    for name, op in graph.ops.items():
        if isinstance(op, keras.layers.Layer):
            visit(op, name, name, frozenset())
    return list(found.values()), {i for i, n in count.items() if n > 1}


def random_array(shape: list[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """A trial input: N(0, 1) floats, or 0/1 for integers (token ids any vocabulary has) and
    booleans."""
    if "int" in str(dtype) or str(dtype) == "bool":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def _generating_permutations(channels: int, rng: np.random.Generator) -> tuple:
    """The transposition (0 1), the cycle (0 1 ... C-1), which generate every permutation of C
    channels, and one at random: what the trial runs reorder channels by."""
    return (np.r_[1, 0, 2:channels], np.roll(np.arange(channels), 1), rng.permutation(channels))


def refresh_statistics(layer: keras.layers.Layer) -> None:
    """Makes every adapted `keras.layers.Normalization` in `layer` (itself included) compute from
    its weights again after they were written: it computes from `mean`/`variance` tensors that only
    `finalize_state()` rebuilds from its `mean`/`variance` weights (`adapt()` and loading call it;
    `assign` and `set_weights` do not). Other layers are left alone (a lookup's `finalize_state`
    rebuilds its vocabulary)."""
    for sub in [layer, *walk_layers(layer)]:
        if isinstance(sub, keras.layers.Normalization) and sub.built:
            sub.finalize_state()  # a no-op for constants given to the constructor
