"""A Functional or Sequential model's graph of layers and keras ops by name, as `permute` walks it.

Read from the model's public config (a Sequential model: from its layer list). A nested model
called once, and a custom layer whose `call` can be followed on symbolic inputs (a transformer
block written as a Layer), are inlined as their own graph, their layers named 'outer/inner'.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import NamedTuple

import keras
import tensorflow as tf

from tf_sparse24.model_copy import is_functional, symbolic_arguments
from tf_sparse24.registry import own_variables
from tf_sparse24.wrapper import Sparse24, walk_layers

_MODEL_INPUT = "<model input>"  # source of a Sequential model's first layer


class Graph(NamedTuple):
    """A model's top-level graph by operation name: its layers and keras ops (`x[:, :16]`)."""

    ops: dict[str, keras.Operation]
    inputs: dict[str, list[list[str]]]  # per call of an operation, the names of what it reads
    widths: dict[str, list[int | None]]  # channels (last axis) of each input of its first call
    calls: dict[str, dict]  # its first call's serialized arguments (Functional models only)
    consumers: dict[str, list[str]]  # the operations that read each one's output
    outputs: set[str]  # operations whose output is a model output
    hidden: set[str]  # layers also used inside another layer (a nested model): calls not seen here
    probed: dict[str, bool]  # `channel_spaces._probe` results by 'name:carries' / 'name:produces'
    unfollowed: dict[str, str]  # custom layers whose call was not followed, and why
    followed: list[str]  # custom layers whose call was followed (their graph inlined)
    input_names: list[str]  # a Functional model's input layers, in order ([] for Sequential)


def read_graph(model: keras.Model, follow: bool = True) -> Graph:
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
        tensors = {spec["name"]: [tensor_specs(node) for node in spec.get("inbound_nodes", [])]
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
    return Graph(ops, inputs, widths, calls, consumers, outputs, hidden, {}, unfollowed,
                  followed, input_names)


def tensor_specs(obj) -> list[dict]:
    """The serialized Keras tensors (`shape`, `keras_history`, ...) in a serialized call's
    arguments, in order."""
    if isinstance(obj, dict):
        if obj.get("class_name") == "__keras_tensor__":
            return [obj["config"]]
        return [t for v in obj.values() for t in tensor_specs(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_specs(v)]
    return []


def call_constants(node: dict) -> list:
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


def _inlinable_graph(op, calls: list[list[str]], top: set[int], follow: bool) -> Graph | None:
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
        sub = read_graph(op, follow)
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
    return (isinstance(op, keras.layers.Layer) and not keras_kind(op)
            and not isinstance(op, (keras.Model, Sparse24)))


def _traced_graph(
    layer: keras.layers.Layer, calls: list[list[str]], top: set[int]
) -> tuple[Graph | None, list[str], str]:
    """The graph of a custom layer's `call`, followed by running it on symbolic inputs shaped like
    its call in the model, so that its sublayers (attention, Dense, normalization) and keras ops
    record what they read (Keras' examples' TransformerBlock, keras_hub's TransformerEncoder); the
    outer graph's sources of its tensor inputs, in order; and why not ('' when it is followed, or
    when it holds no sublayers: such a layer is left to the trial run, `channel_spaces._probe`).

    Followed only when the layer is called once, holds no weights of its own and reads no weight
    of its sublayers outside their calls (the trace would hold them as constants: a tied `x @
    self.dense.kernel`), shares no sublayer with the graph around it (whose op ids are `top`), has
    every sublayer built (the caller's model is not to change), takes no Keras mask, returns one
    tensor, runs every sublayer with weights on what comes from its inputs, computes alike at
    other lengths of its unknown dimensions (no Python branch on a shape) and, if it takes
    `training`, in training mode (no branch that only training runs). What the traces add to the
    layers `restoring_layers` takes out again.
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
                traces.append((unknown, trace, read_graph(trace)))
            except Exception as err:  # noqa: BLE001 - Keras and the layer's code raise any kind
                error = error or err
        if not traces:
            return None, [], f"its call could not be followed ({type(error).__name__}: {error})"
        unknown, trace, sub = traces[0]
        if "training" in params:
            try:
                training = read_graph(_trace(layer, nodes[0].arguments, unknown, training=True))
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


def _signature(graph: Graph, own: set[int], settings: bool = False) -> list:
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
                      plain(call_constants({"args": call.get("args", []), "kwargs": {
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
def restoring_layers(model: keras.Model):
    """Leaves the attributes of every layer of `model` as they were (lists and dicts: their
    contents): `_traced_graph` runs custom layers' calls, which add Keras nodes (the record of
    symbolic calls) to their sublayers and may set attributes (`self.last_scores = scores`), and
    `permute._difference` calls the model (losses). Variables are left alone by those calls'
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


def keras_kind(op) -> str:
    """The class name of `op` if its class is Keras' own (`Dense`, the keras op `Add`), else '':
    a user's class, even one named like a Keras class or derived from one, may compute anything,
    so the rules of `channel_spaces` never apply to it (it may still pass their trial run,
    `_probe`)."""
    cls = type(op)
    return cls.__name__ if cls.__module__.startswith("keras.") else ""


def describe(name: str, op) -> str:
    """`'name' (Class)`, or `'name' (keras op Class)` for an operation that is not a layer; `name`
    is the graph's ('outer/inner' inside an inlined model)."""
    kind = type(op).__name__
    return f"{name!r} ({kind if isinstance(op, keras.layers.Layer) else 'keras op ' + kind})"
