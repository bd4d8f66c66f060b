"""Copying a Keras model or layer with its state: what `prune`, `strip` and `permute` build on.

They never alter the caller's model: Sequential and Functional models are rebuilt layer by layer
with `keras.models.clone_model` (`clone_graph`), each layer a fresh instance from its config that
gets the original's weights, assets and RNN states (`copy_layer`); a subclassed model is copied
whole from its config (`copy_model`). Copies are made under the `tf.distribute` strategy and the
`keras.RematScope` the original was made under.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from tf_sparse24.registry import own_variables, quantized_layers
from tf_sparse24.wrapper import Sparse24, walk_layers


def copied_layers(model: keras.Model) -> list:
    """The layers `clone_model(..., recursive=True)` copies one by one (nested Sequential and
    Functional models are entered), each once."""
    out = {}
    for layer in model.layers:
        if isinstance(layer, keras.Sequential) or is_functional(layer):
            out.update((id(sub), sub) for sub in copied_layers(layer))
        else:
            out[id(layer)] = layer
    return list(out.values())


def check_untied(model: keras.Model, what: str) -> None:
    """Refuses weights shared by two of the layers that get copied (a custom layer reading another
    layer's kernel): each copy would get its own variable, and fine-tuning would train them
    apart."""
    owner = {}
    for layer in copied_layers(model):
        for variable in getattr(layer, "weights", ()):
            first = owner.setdefault(id(variable), layer)
            if first is not layer:
                raise ValueError(
                    f"{what}(): weight {variable.path!r} is shared by layers {first.name!r} and "
                    f"{layer.name!r} of model {model.name!r}. {what}() copies each layer, which "
                    "would untie it (the copies would train apart). Compute both uses in one "
                    "layer, or wrap the layer in tf_sparse24.Sparse24 in a subclassed model."
                )


def _copy_state(source: keras.layers.Layer, target: keras.layers.Layer) -> None:
    """Copies the state of every layer under `source` into its same-structured copy `target`.

    Each layer's `trainable` flag, which a block's config leaves out for the layers it holds. Then
    as a `.keras` file would, layer by layer: `save_own_variables` / `load_own_variables` (an
    adapted Normalization recomputes its mean and variance) and `save_assets` / `load_assets`
    (lookup vocabularies). Then the variables as they are: Keras saves a LoRA layer's kernel
    merged with its adapters and zeroes the adapters on loading.
    """
    sources, targets = list(source._flatten_layers()), list(target._flatten_layers())
    if [type(a) for a in sources] != [type(b) for b in targets]:
        if not source.weights and not any(hasattr(a, "save_assets") for a in sources):
            return  # nothing to copy (sublayers its build() makes: the copy is unbuilt)
        raise TypeError(
            f"Cannot copy layer {source.name!r} ({type(source).__name__}): the copy made from its "
            f"get_config() and build config has other sublayers ({len(targets)} layers, not "
            f"{len(sources)})."
        )
    for a, b in zip(sources, targets):  # each layer before the layers inside it
        # A frozen sublayer (block.dense.trainable = False, a frozen BatchNormalization in a
        # block) is frozen in the copy too: its owner's config does not record it.
        b.trainable = a.trainable
        _copy_lora(a, b)
        store = {}
        a.save_own_variables(store)
        if store or b.weights:
            b.load_own_variables(store)
        if hasattr(a, "save_assets"):
            with tempfile.TemporaryDirectory() as assets:
                a.save_assets(assets)
                b.load_assets(assets)
        if getattr(a, "stateful", False) and getattr(a, "states", None) is not None:
            # Kept out of variables and files by Keras; a stateful RNN's copy goes on from here.
            for mine, theirs in zip(keras.tree.flatten(b.states), keras.tree.flatten(a.states)):
                mine.assign(theirs)
        _copy_own_variables(a, b)
        if isinstance(a, Sparse24):  # the copy's masks come from where the original's came from
            b.masks_source = a.masks_source


def _copy_lora(source: keras.layers.Layer, target: keras.layers.Layer) -> None:
    """Enables LoRA on the built copy `target` of a layer that has it (same rank and alpha) where
    the copy lacks it: a sublayer whose owner's config does not record it (MultiHeadAttention's
    and GroupQueryAttention's projections, a block's Dense). Its adapters are then copied as they
    are, not merged into the kernel."""
    if getattr(source, "lora_enabled", False) and target.built and not target.lora_enabled:
        target.enable_lora(source.lora_rank, lora_alpha=source.lora_alpha)


def _copy_own_variables(source: keras.layers.Layer, target: keras.layers.Layer) -> None:
    """Assigns each of `source`'s own variables to `target`'s variable of the same name (a float8
    Dense made from its config creates its scale variables first), by position where names do not
    tell them apart."""
    theirs, mine = own_variables(source), own_variables(target)
    by_name = {v.name: v for v in mine}
    if len(by_name) == len(mine) == len({v.name for v in theirs}) == len(theirs) and all(
        v.name in by_name for v in theirs
    ):
        mine = [by_name[v.name] for v in theirs]
    if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
        raise TypeError(
            f"Cannot copy layer {source.name!r} ({type(source).__name__}): its copy has other "
            f"variables ({[v.name for v in mine]}, not {[v.name for v in theirs]})."
        )
    for variable, value in zip(mine, theirs):
        variable.assign(value)


def symbolic_arguments(
    arguments, unknown: int | None = None
) -> tuple[list, dict, list[keras.KerasTensor]]:
    """A call's arguments (a Keras node's) with each Keras tensor replaced by a new model input of
    its shape and dtype (`unknown`: the size given to unknown dimensions, the batch's included),
    and those inputs in argument order (positional, then keyword).

    Raises:
        TypeError: for a container other than a list, tuple or dict (a namedtuple).
    """
    inputs = []

    def symbolic(value):
        if isinstance(value, keras.KerasTensor):
            shape = value.shape if unknown is None else tuple(
                unknown if d is None else d for d in value.shape)
            inputs.append(keras.Input(batch_shape=shape, dtype=value.dtype,
                                      sparse=value.sparse, ragged=value.ragged))
            return inputs[-1]
        if type(value) in (list, tuple):
            return type(value)(map(symbolic, value))
        if type(value) is dict:
            return {k: symbolic(v) for k, v in value.items()}
        if keras.tree.is_nested(value):
            raise TypeError(f"an argument of type {type(value).__name__}")
        return value

    args = [symbolic(a) for a in arguments.args]
    return args, {k: symbolic(v) for k, v in arguments.kwargs.items()}, inputs


def _build_by_first_call(called: keras.layers.Layer, new: keras.layers.Layer, weights: int,
                         training: bool = False) -> int:
    """Builds the sublayers of `new` that its build() leaves to the first call, as Keras' own
    examples' TransformerBlock does (it has no build(): its attention and Dense layers make their
    weights when first called), by tracing `new` on symbolic inputs shaped like the first call
    `called` got in its model, and its later calls (a shared layer) until `new` has `weights`
    weights or has no unbuilt sublayer left (`training`: in training mode, for layers only
    training runs). A layer never called in a graph is left as it is. Returns how many calls it
    took."""
    calls = 0
    for node in getattr(called, "_inbound_nodes", []):  # a shared layer: until all are built
        if len(new.weights) >= weights or all(sub.built for sub in walk_layers(new)):
            break
        calls += 1
        args, kwargs, _ = symbolic_arguments(node.arguments)
        # The layer's own __call__ (a Sparse24 wrapper builds its masks there), then the node it
        # recorded for these detached inputs is dropped: the copy's only calls are its model's.
        known = len(new._inbound_nodes)
        new(*args, **({**kwargs, "training": True} if training else kwargs))
        del new._inbound_nodes[known:]
    return calls


def _remat_scope_of(layer) -> contextlib.AbstractContextManager:
    """The `keras.RematScope` `layer` was made under (none: a no-op), to make its copy and the
    copy's sublayers under: Keras reads the scope when a layer is made, so a copy made outside it
    would silently stop recomputing its activations and hold them all (more memory)."""
    mode = getattr(layer, "_remat_mode", None)
    if mode is None:
        return contextlib.nullcontext()
    return keras.RematScope(mode=mode.mode, output_size_threshold=mode.output_size_threshold,
                            layer_names=mode.layer_names)


def copy_layer(layer, called_as: keras.layers.Layer | None = None, to_wrap: bool = False):
    """A fresh instance of `layer` with the same config, build and state, made under the
    RematScope `layer` was made under. `called_as`: the layer whose calls in the model are this
    one's (a wrapper's, for the layer it wraps). `to_wrap`: the copy gets a `Sparse24` wrapper,
    which a `.keras` file or config makes again from the layer's config and its first call only:
    a layer that needs more to be built is refused.

    Functional graphs also hold stateless operations (`h[:, 0]` becomes a `GetItem` node): those
    are copied from their config alone. A `Lambda` layer is shared, not copied: it holds no state,
    and its function does not survive a config round trip.
    """
    if isinstance(layer, keras.layers.Lambda) and not layer.weights:
        return layer
    with _remat_scope_of(layer):
        return _copy_in_scope(layer, called_as, to_wrap)


def _copy_autocast(layer: keras.layers.Layer, new: keras.layers.Layer) -> None:
    """`autocast=False` (a layer multiplying its float32 weights under mixed precision) on the
    built copy and its sublayers: Keras' get_config() leaves the flag out, so a copy autocasts."""
    new.autocast = layer.autocast
    old_layers = list(layer._flatten_layers(include_self=False))
    new_layers = list(new._flatten_layers(include_self=False))
    if [type(a) for a in old_layers] == [type(b) for b in new_layers]:
        for a, b in zip(old_layers, new_layers):
            b.autocast = a.autocast


def _refuse_shared(layer: keras.layers.Layer, variables: list) -> None:
    """Raises when the copy of `layer` holds `variables` of the original (none: returns)."""
    if variables:
        raise TypeError(
            f"Cannot copy layer {layer.name!r} ({type(layer).__name__}): the copy made from "
            f"its get_config() holds the layer's own variables {[v.path for v in variables]}, so "
            "training the copy would change the original. Its get_config() returns layer objects "
            "instead of their configs: serialize them (keras.saving.serialize_keras_object) and "
            "rebuild them in from_config().")


def _copy_in_scope(layer, called_as: keras.layers.Layer | None, to_wrap: bool):
    """copy_layer's copy, under the RematScope it chose."""
    try:
        new = layer.__class__.from_config(layer.get_config())
    except Exception as err:
        raise TypeError(
            f"Cannot copy layer {layer.name!r} ({type(layer).__name__}) from its config: {err}\n"
            "The model is copied layer by layer with get_config()/from_config(): give custom "
            "layers a get_config() returning their constructor arguments, and register the "
            "custom classes they hold with @keras.saving.register_keras_serializable()."
        ) from err
    if isinstance(layer, keras.layers.Layer):  # checked before the copy is built: its build()
        copied = {id(sub) for sub in walk_layers(new)}  # would build the original's sublayers
        _refuse_shared(layer, [v for sub in walk_layers(layer) if id(sub) in copied
                               for v in sub.weights])
    if isinstance(layer, keras.layers.Layer) and layer.built:
        if layer.weights and not new.built:  # some layers build in __init__ (keras_hub decoders)
            with warnings.catch_warnings():  # a layer without build(): the first call builds it
                warnings.filterwarnings("ignore", "`build\\(\\)` was called on layer")
                new.build_from_config(layer.get_build_config())
        calls = 0
        for training in (False, True):  # then the layers only training runs
            if len(new.weights) < len(layer.weights) and (
                    not training or "training" in new.call_signature_parameters):
                calls += _build_by_first_call(called_as or layer, new, len(layer.weights),
                                              training)
        if to_wrap and calls > 1:
            raise TypeError(
                f"Cannot prune layer {layer.name!r} ({type(layer).__name__}): its first call "
                "in the model does not make all its weights (its build() does not build every "
                "sublayer, and a later or training call uses more of them), so the pruned model "
                "could be saved but not loaded. Give it a build() that builds all its sublayers."
            )
        shared = {id(v) for v in new.weights}
        _refuse_shared(layer, [v for v in layer.weights if id(v) in shared])
        try:
            _copy_state(layer, new)
        except ValueError as err:  # Keras' own variable-count check
            quantized = [name for name in quantized_layers(layer) if name != layer.name]
            why = (f"the layers {quantized} inside it are quantized, which its config does not "
                   "record: prune or permute the float model, then quantize" if quantized else
                   f"the copy made from its get_config() does not take its variables ({err})")
            raise TypeError(
                f"Cannot copy layer {layer.name!r} ({type(layer).__name__}): {why}.") from err
    if isinstance(layer, keras.layers.Layer):
        _copy_autocast(layer, new)
    return new


def is_functional(model) -> bool:
    """Functional (including nested) models, whose graph `clone_model` can rebuild."""
    return hasattr(model, "_run_through_graph") and not isinstance(model, keras.Sequential)


def copy_model(model: keras.Model) -> keras.Model:
    """A copy of a subclassed `model` made with get_config()/from_config(), built and holding
    the model's state, under the strategy and RematScope `model` was made under."""
    with _strategy_scope_of(model), _remat_scope_of(model):
        return _copy_model_in_scope(model)


def _strategy_scope_of(model) -> contextlib.AbstractContextManager:
    """The scope of the `tf.distribute` strategy `model` was made under, when no strategy's scope
    is open: Keras ties a model to the strategy in scope when it is made, so a copy made outside
    it (`prune(model)` after `with strategy.scope(): model = ...`) would get single-device
    variables and silently train on one device. Inside a strategy's scope, that one is used."""
    own = getattr(model, "distribute_strategy", None)
    if own is None or tf.distribute.has_strategy() or own is tf.distribute.get_strategy():
        return contextlib.nullcontext()
    return own.scope()


def _copy_model_in_scope(model: keras.Model) -> keras.Model:
    """copy_model's copy, under the RematScope the model was made under."""
    in_place = "`for layer in tf_sparse24.pruned_layers(model): layer.update_masks()`"
    try:
        copy = model.__class__.from_config(model.get_config())
    except Exception as err:
        raise TypeError(
            f"Cannot copy subclassed model {model.name!r} ({type(model).__name__}) with "
            f"get_config()/from_config(): {err}. Implement get_config(), or prune in place with "
            f"{in_place}."
        ) from err
    with warnings.catch_warnings():  # Keras only warns when it cannot build a layer from there
        warnings.simplefilter("ignore")
        copy.build_from_config(model.get_build_config())
    # Layers whose state their build config cannot recreate (an adapted lookup, a stateful RNN).
    if unbuilt := [l.name for l in copy._flatten_layers(include_self=False) if not l.built]:
        raise TypeError(
            f"Cannot copy subclassed model {model.name!r} ({type(model).__name__}): its layers "
            f"{unbuilt} are not built after from_config() and build_from_config() (Keras rebuilds "
            "a subclassed model from the shapes its build() took: give it a build() that builds "
            f"its layers, e.g. for a call(self, a, b)), or prune it in place with {in_place}."
        )
    _copy_state(model, copy)
    copy.built = True  # build_from_config builds the layers, not always the model's own flag
    return copy


def clone_graph(model: keras.Model, clone: Callable, caller: str) -> keras.Model:
    """`keras.models.clone_model(model, clone_function=clone, recursive=True)` under the
    RematScope and the `tf.distribute` strategy `model` was made under (its nested models are made
    in them too), warning when the copy loses the model's own class.

    Keras makes a Functional subclass again only if its constructor takes `(inputs, outputs)`;
    others (keras_hub backbones and task models) come back as plain Functional models, without
    their methods (`generate()`, `preprocessor`), silently.
    """
    with _strategy_scope_of(model), _remat_scope_of(model):
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    if type(copy) is not type(model):
        cls = type(model).__name__
        warnings.warn(
            f"{caller}(): the copy of model {model.name!r} is a plain Keras {type(copy).__name__} "
            f"model, not a {cls}: Keras' clone_model cannot call {cls}'s constructor with inputs "
            f"and outputs. It has the same layers, graph and weights, but none of {cls}'s own "
            "methods or attributes (e.g. a task model's generate() or preprocessor), and its "
            f".keras file loads as a {type(copy).__name__} model. To get them back after "
            f"fine-tuning, make a new {cls} with the same configuration and call "
            "`new.set_weights(tf_sparse24.strip(pruned).get_weights())`.",
            stacklevel=3,
        )
    return copy
