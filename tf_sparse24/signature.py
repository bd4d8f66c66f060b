"""The serving signature's names and how it calls the model.

Inputs: `input_specs` gives the signature's named `tf.TensorSpec`s (a user's `input_signature`,
checked against TensorFlow's rules for argument names, or the model's symbolic inputs with names
made stable and unique); `model_arguments` packs the flat signature inputs into the arguments the
model is called with (a dict, one per parameter of a subclassed `call(self, a, b)`, or
`model.input`'s structure). Outputs: `signature_output_names` gives the signature's output keys
(dict keys, else the output layers' names, a `Sparse24` wrapper's taken from the layer it wraps).
`export` and `verify` both use these, so a served export and its check agree on every name.
"""

from __future__ import annotations

import inspect
import keyword
import re

import keras
import tensorflow as tf

from tf_sparse24.wrapper import Sparse24

# A signature's input names become the arguments of a Python call: TensorFlow refuses two that
# differ only in case ("x", "X") and Python keywords ("in", "class"), and binds "self" to the
# function itself.
INPUT_NAME_RULES = {"ignore_case": True, "reserved": ("self", *keyword.kwlist)}
SIGNATURE_NAME_RULE = ("signature input names start with a letter ([A-Za-z][A-Za-z0-9_]*: "
                       "TensorFlow renames '_x' to 'arg__x' and then refuses it) and are not "
                       "Python keywords or 'self'")


def is_signature_name(name: str) -> bool:
    """Whether TensorFlow takes `name` as a serving signature's input (see SIGNATURE_NAME_RULE)."""
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name)) and (
        name not in INPUT_NAME_RULES["reserved"])


def _check_signature_names(names: list[str]) -> None:
    valid = all(is_signature_name(str(n)) for n in names)
    if not valid or unique_names(names, **INPUT_NAME_RULES) != names:
        raise ValueError(
            f"input_signature: {SIGNATURE_NAME_RULE}, unique also ignoring case (TensorFlow "
            f"makes them the serving function's arguments). Received: {names}"
        )


def _check_castable(model: keras.Model, specs: list[tf.TensorSpec]) -> list[tf.TensorSpec]:
    """Refuses a spec whose dtype the model's input cannot be cast from (a string for a number):
    the trace would pass, and every served call fail."""
    try:
        structure = model.input
    except (AttributeError, ValueError):  # no symbolic inputs: nothing to compare with
        return specs
    inputs = keras.tree.flatten(structure)
    # Bound by name where the specs are named so: a dict's keys, else the inputs' own names (a
    # dict input_signature for a model taking a list: Keras binds it by those names).
    named = structure if isinstance(structure, dict) else {t.name: t for t in inputs}
    if {s.name for s in specs} == set(named) and len(named) == len(specs):
        pairs = [(s, named[s.name]) for s in specs]
    else:
        pairs = list(zip(specs, inputs)) if len(inputs) == len(specs) else []
    for spec, t in pairs:
        if (spec.dtype == tf.string) != (tf.as_dtype(t.dtype) == tf.string):
            raise ValueError(
                f"input_signature: input {spec.name!r} is {spec.dtype.name}, but model "
                f"{model.name!r} takes {tf.as_dtype(t.dtype).name} there ({t.name!r}): one "
                "cannot be cast to the other."
            )
    return specs


def input_specs(model: keras.Model, input_signature) -> list[tf.TensorSpec]:
    """The serving signature's named inputs, in the model's order: `input_signature` (a list of
    named specs, one named spec, or `{name: spec}`), else the model's symbolic inputs (names
    sanitised, unique)."""
    if isinstance(input_signature, dict):
        if not all(isinstance(s, tf.TensorSpec) for s in input_signature.values()):
            raise ValueError(
                f"a dict input_signature maps names to tf.TensorSpec. Received: {input_signature}"
            )
        _check_signature_names(list(input_signature))
        return _check_castable(
            model, [tf.TensorSpec(s.shape, s.dtype, name=k) for k, s in input_signature.items()]
        )
    if isinstance(input_signature, tf.TensorSpec):
        input_signature = [input_signature]  # one input, as Keras' model.export takes it
    if input_signature is not None:
        specs = list(input_signature)
        if not all(isinstance(s, tf.TensorSpec) and s.name for s in specs):
            raise ValueError(
                f"input_signature must be a list of named tf.TensorSpec. Received: {specs}"
            )
        names = [s.name for s in specs]
        _check_signature_names(names)
        own = model_input_names(model)
        if (positional := positional_inputs(model)) and len(positional) != len(specs):
            raise ValueError(
                f"model {model.name!r} takes {len(positional)} positional inputs {positional}; "
                f"input_signature has {len(specs)}: {names}"
            )
        if own is not None and sorted(own) == sorted(names):  # the model's names: bound by name
            by_name = {s.name: s for s in specs}
            return _check_castable(model, [by_name[name] for name in own])
        structure = model.input if _has_graph(model) else None
        if isinstance(structure, dict) and list(structure) != sorted(structure):
            # Labels are bound by position, and a dict written in another order than sorted has
            # none a reader can tell (Keras refuses to call such a model with a list, too).
            raise ValueError(
                f"model {model.name!r} takes a dict of inputs with keys {list(structure)}: name "
                "the input_signature's specs by those keys (bound by name) or pass a dict "
                f"input_signature. Received: {names}"
            )
        return _check_castable(model, specs)
    try:
        inputs = keras.tree.flatten(model.input)
    except (AttributeError, ValueError) as e:
        raise ValueError(
            f"model {model.name!r} has no symbolic inputs (a subclassed or unbuilt model): pass "
            "input_signature=[tf.TensorSpec(shape, dtype, name=...), ...]"
        ) from e
    defaults = ["inputs"] if len(inputs) == 1 else [f"input_{i}" for i in range(len(inputs))]
    if isinstance(model.input, dict) and len(model.input) == len(inputs):
        # A dict's keys are the names the model is called with: an input without a chosen name of
        # its own is served under its key.
        defaults = [_identifier(str(key), default)
                    for key, default in zip(_flat_keys(model.input), defaults)]
    own = [_identifier(t.name, d) for t, d in zip(inputs, defaults)]
    # "_x" -> "x": TensorFlow renames a leading underscore, then finds the new name clashes. An
    # input named "x" itself keeps "x" (stripped names are made unique last).
    order = sorted(range(len(own)), key=lambda i: own[i].startswith("_"))
    unique = unique_names([own[i].lstrip("_") or defaults[i] for i in order], **INPUT_NAME_RULES)
    names = [name for _, name in sorted(zip(order, unique))]
    return [tf.TensorSpec([None, *t.shape[1:]], t.dtype, name=n) for t, n in zip(inputs, names)]


def model_input_names(model: keras.Model) -> list[str] | None:
    """The names of the model's inputs in the order it takes them (a dict's keys in the order
    `model_arguments` packs them, see `_flat_keys`; a `call(self, a, b)`'s parameters), or None
    for a model without symbolic inputs."""
    try:
        structure = model.input
    except (AttributeError, ValueError):
        return positional_inputs(model)
    if isinstance(structure, dict):
        return _flat_keys(structure)
    return [t.name for t in keras.tree.flatten(structure)]


def _flat_keys(structure: dict) -> list:
    """A dict's keys in the order `keras.tree.flatten` puts its values: sorted for a dict, as
    inserted for an OrderedDict."""
    return list(dict.fromkeys(path[0] for path, _ in keras.tree.flatten_with_path(structure)))


def positional_inputs(model: keras.Model) -> list[str] | None:
    """The parameter names of a subclassed model's `call` when it takes its inputs as several
    positional arguments (`call(self, image, text)`): the signature passes one input to each.
    None for a model called with one input structure."""
    if _has_graph(model):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [
        p.name for p in inspect.signature(model.call).parameters.values()
        if p.kind in kinds and p.default is inspect.Parameter.empty
        and p.name not in ("training", "mask")  # Keras' own call arguments, not inputs
    ]  # fmt: skip
    return names if len(names) > 1 else None


def model_arguments(
    model: keras.Model, inputs: list[tf.Tensor], keys: list[str] | None = None
) -> tuple:
    """The positional arguments to call the model with, from flat signature inputs: a dict by
    `keys` (a dict input_signature), one per parameter of a `call(self, a, b)`, else
    `model.input`'s structure, else the tensor or the list."""
    if keys is not None:
        given = dict(zip(keys, inputs))
        structure = getattr(model, "input", None) if _has_graph(model) else None
        if isinstance(structure, dict) and set(structure) == set(given):
            # Keras binds a dict's values in flattened order: a plain dict's (sorted) is not an
            # OrderedDict's (as inserted), so pass the model a dict of its own kind.
            flat = [given[k] for k in _flat_keys(structure)]
            return (keras.tree.pack_sequence_as(structure, flat),)
        return (given,)
    if positional_inputs(model):
        return tuple(inputs)
    try:
        return (keras.tree.pack_sequence_as(model.input, inputs),)
    except (AttributeError, ValueError):
        return (inputs[0] if len(inputs) == 1 else inputs,)


def functional_view(model: keras.Model) -> keras.Model:
    """A Sequential model as a Functional one over the same layers (named outputs, cloneable),
    called as the Sequential model is: with one tensor, returning one."""
    if isinstance(model, keras.Sequential) and _has_graph(model):
        inputs, outputs = model.inputs, model.outputs
        return keras.Model(inputs[0] if len(inputs) == 1 else inputs,
                           outputs[0] if len(outputs) == 1 else outputs, name=model.name)
    return model


def _has_graph(model: keras.Model) -> bool:
    """Whether `model` has symbolic inputs and outputs (Functional, or a built Sequential): not
    `model_copy.is_functional`, which leaves Sequential models out."""
    try:
        return bool(model.inputs) and bool(model.outputs)
    except (AttributeError, ValueError):
        return False


def flat_outputs(outputs) -> tuple[list, list[str] | None]:
    """The model's outputs as a flat list, and a key for each when they come in a dict: the
    dict's keys in `keras.tree.flatten` order (sorted; an OrderedDict's as inserted), so the list
    packs back into the structure; `<key>_<i>` for the leaves of a list, tuple or dict under one."""
    if not isinstance(outputs, dict):
        return keras.tree.flatten(outputs), None
    flat, keys = [], []
    for key in _flat_keys(outputs):
        leaves = keras.tree.flatten(outputs[key])
        flat += leaves
        leaf = not keras.tree.is_nested(outputs[key])
        keys += [str(key)] if leaf else [f"{key}_{i}" for i in range(len(leaves))]
    return flat, keys


def signature_output_names(model: keras.Model, outputs) -> list[str]:
    """Signature keys of the model's flattened outputs: dict keys, else the output layer names.

    A `Sparse24` wrapper's output is named after the wrapped layer, so pruning, stripping and
    exporting keep the names of the original model.
    """
    flat, keys = flat_outputs(outputs)
    if keys is not None:
        return unique_names([_identifier(k, f"output_{i}") for i, k in enumerate(keys)])
    names = list(getattr(model, "output_names", None) or [])
    # operations: also the ops a Functional model ends in (keras.ops.softmax: "softmax_1").
    layers = {op.name: op for op in getattr(model, "operations", None) or model.layers}
    names = [_chosen_name(layers.get(n), n) for n in names]
    if len(names) != len(flat):
        names = [f"output_{i}" for i in range(len(flat))]
    return unique_names([_identifier(n, f"output_{i}") for i, n in enumerate(names)])


def unique_names(names: list[str], *, ignore_case: bool = False, reserved=()) -> list[str]:
    """`names` with a later repeat made unique by a `_<k>` suffix: two keys that map to the same
    identifier ("a-b" and "a_b") must not share a signature key, or one tensor would be lost.
    `ignore_case`: "x" and "X" count as the same; a `reserved` name (exactly as written: "self",
    not "Self") is always suffixed."""
    fold = str.lower if ignore_case else str
    taken, out = {fold(n) for n in names}, []
    seen: set[str] = set()
    for name in names:
        new, k = name, 1
        while new in reserved or fold(new) in seen or (new != name and fold(new) in taken):
            new, k = f"{name}_{k}", k + 1
        seen.add(fold(new))
        out.append(new)
    return out


def _identifier(name: str | None, default: str) -> str:
    """A stable signature key: [A-Za-z0-9_] (TF Serving, saved_model_cli); Keras' automatic
    `keras_tensor_<n>` / `input_layer_<n>` names depend on creation order, so they fall back to
    `default`. Name your `keras.Input`s to choose the keys."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", name or "")
    if not name or name[0].isdigit() or re.fullmatch(r"(keras_tensor|input_layer)(_\d+)?", name):
        return default
    return name


def _chosen_name(layer, name: str) -> str:
    """The name of an output layer or op (the wrapped layer's, for a `Sparse24`), or "" for a name
    Keras made up (`dense_3`: the snake-cased class name and a counter that depends on creation
    order; a layer named so on purpose is taken for one)."""
    if isinstance(layer, Sparse24):
        layer, name = layer.layer, layer.layer.name
    if layer is not None and re.fullmatch(
        re.escape(_auto_name_prefix(type(layer).__name__)) + r"(_\d+)?", name
    ):
        return ""
    return name


def _auto_name_prefix(class_name: str) -> str:
    """The name Keras gives a layer of this class by default, before its counter: the class name
    in snake case ("EinsumDense" -> "einsum_dense", "Conv2D" -> "conv2d", "PReLU" -> "p_re_lu")."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", re.sub(r"\W+", "", class_name))
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()
