"""Model-level pruning: `prune`, `strip`, `report`, `pruned_layers`.

`prune()` never alters the caller's model: it returns a new model whose prunable layers are wrapped
in `Sparse24` with magnitude masks computed from the trained weights.

- Sequential and Functional models (nested models and shared layers included) are cloned with
  `keras.models.clone_model`; each layer's weights are copied, and eligible layers are wrapped.
- Subclassed models cannot be rewired from outside (their `call` names the layers), so they opt in
  by wrapping their prunable layers in `Sparse24` in `__init__` (masks start as ones: the model
  trains dense). `prune()` then returns a copy made with `get_config()` / `from_config()` (Keras
  captures simple constructor arguments automatically) whose wrappers hold magnitude masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import warnings
from collections.abc import Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

from tf_sparse24.masks import (
    DEFAULT_METHOD,
    _mask_method,
    compute_mask,
    is_nm_sparse,
    parse_pattern,
)
from tf_sparse24.registry import (
    eligible_weights,
    own_variables,
    quantized_layers,
    relative_variables,
    scan_layer,
)
from tf_sparse24.wrapper import Sparse24, _sublayers, claim_eligible_weights, walk_layers

__all__ = [
    "LayerReport", "eligible_weights", "prune", "pruned_layers", "report", "strip", "walk_layers",
]


def pruned_layers(model: keras.layers.Layer) -> list[Sparse24]:
    """All `Sparse24` wrappers in `model`, nested models and custom layers included."""
    return [layer for layer in walk_layers(model) if isinstance(layer, Sparse24)]


def not_nm_weights(wrappers: list[Sparse24]) -> list[str]:
    """`layer/weight` of every pruned weight whose effective value is not N:M (masks still ones)."""
    return [
        f"{layer.name}/{pw.name}"
        for layer in wrappers
        for pw in layer.pruned_weights
        if not is_nm_sparse(layer.effective_weight(pw), pw.pattern, pw.axis)
    ]


def _check_model(model, what: str) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"{what}() expects a keras.Model. Received: {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"{what}() needs a built model (call it on data or build it first). Received: "
            f"unbuilt model {model.name!r}"
        )


def _copied_layers(model: keras.Model) -> list:
    """The layers `clone_model(..., recursive=True)` copies one by one (nested Sequential and
    Functional models are entered), each once."""
    out = {}
    for layer in model.layers:
        if isinstance(layer, keras.Sequential) or _is_functional(layer):
            out.update((id(sub), sub) for sub in _copied_layers(layer))
        else:
            out[id(layer)] = layer
    return list(out.values())


def _check_untied(model: keras.Model, what: str) -> None:
    """Refuses weights shared by two of the layers that get copied (a custom layer reading another
    layer's kernel): each copy would get its own variable, and fine-tuning would train them
    apart."""
    owner = {}
    for layer in _copied_layers(model):
        for variable in getattr(layer, "weights", ()):
            first = owner.setdefault(id(variable), layer)
            if first is not layer:
                raise ValueError(
                    f"{what}(): weight {variable.path!r} is shared by layers {first.name!r} and "
                    f"{layer.name!r} of model {model.name!r}. {what}() copies each layer, which "
                    "would untie it (the copies would train apart). Compute both uses in one "
                    "layer, or wrap the layer in tf_sparse24.Sparse24 in a subclassed model."
                )


def _matches(layer, selectors) -> bool:
    return any(
        s is layer or s == layer.name or (isinstance(s, type) and isinstance(layer, s))
        for s in selectors
    )


def _covered(layers: list, selectors) -> set[int]:
    """Ids of the `layers` that `selectors` select and of every layer inside them: a selected
    container (a block layer, a nested model) covers the layers it holds."""
    return {id(sub) for layer in layers if _matches(layer, selectors)
            for sub in (layer, *walk_layers(layer))}


def _selector_list(selectors) -> list:
    """`layers=`/`skip=` as a list: one name, class or layer object, or a sequence of them."""
    if isinstance(selectors, (str, type, keras.layers.Layer)):  # one selector, not a sequence
        return [selectors]
    return list(selectors or [])


def _at_path(model: keras.layers.Layer, path: str) -> keras.layers.Layer | None:
    """The layer at `path` ('block/ffn/dense': names of layers inside layers, as reports write
    them; a Sparse24 wrapper is passed through by its layer's name), or None."""
    layer = model
    for name in path.split("/"):
        found = None
        for sub in _sublayers(layer):
            inner = sub.layer if isinstance(sub, Sparse24) else sub
            if name in (sub.name, inner.name):
                found = inner if name == inner.name else sub
                break
        if found is None:
            return None
        layer = found
    return layer


def _check_selectors(model, selectors, arg: str) -> list:
    """`selectors` as a list, each a layer name, a path of names ('block/ffn/dense', see
    `_at_path`) or an object of `model`, or a layer class.

    Raises:
        TypeError: for anything else.
        ValueError: `layers=` that selects nothing (an empty list: None selects everything); or
            naming the names, and the layer objects, that are not in `model` (a layer of
            the caller's model passed with its copy would select nothing).
    """
    if selectors is None:
        return []
    try:
        chosen = _selector_list(selectors)  # once: an iterator (a generator) is used up by it
    except TypeError:
        raise TypeError(f"{arg}: expected a layer name, object or class, or a sequence of them. "
                        f"Received: {arg}={selectors!r}") from None
    if arg == "layers" and not chosen:
        raise ValueError(
            f"layers: {selectors!r} selects no layer of model {model.name!r}. Pass layers=None "
            "(the default) for every eligible layer, or name the layers to select.")
    layers = walk_layers(model) + [
        layer for w in pruned_layers(model) for layer in [w.layer, *walk_layers(w.layer)]]
    names = {layer.name for layer in layers}
    selectors = [_at_path(model, s) or s if isinstance(s, str) and "/" in s and s not in names
                 else s for s in chosen]
    if wrong := [s for s in selectors if not isinstance(s, (str, type, keras.layers.Layer))]:
        raise TypeError(f"{arg}: expected layer names, layer objects or layer classes, got "
                        f"{wrong!r}.")
    if unknown := [s for s in selectors if isinstance(s, str) and s not in names]:
        raise ValueError(f"{arg}: no layer named {unknown} in model {model.name!r}.")
    if outside := [s.name for s in selectors if isinstance(s, keras.layers.Layer)
                   and id(s) not in {id(layer) for layer in layers}]:
        raise ValueError(
            f"{arg}: the layer objects {outside} are not in model {model.name!r} (layers of "
            "another model, such as the one it was copied from? Pass names or classes).")
    return selectors


def _plan(model, pattern: str, layers, skip, method: str) -> dict[int, dict]:
    """`{id(layer): {id(variable): (axis, mask)}}` for every layer to prune (`layers`, `skip`:
    checked selectors); validates everything first. A weight is planned once, by the outermost
    layer that names it."""
    m = parse_pattern(pattern)[1]
    everything = walk_layers(model)
    selected, skipped = _covered(everything, layers), _covered(everything, skip)
    # ...and a skipped layer's weights stay dense also where its owner's table names them
    # (skip=[EinsumDense] keeps MultiHeadAttention's projections dense).
    taken = {id(v) for layer in everything if id(layer) in skipped for v in layer.weights}
    plan = {}
    candidates = [
        layer for layer in everything
        if not ((layers and id(layer) not in selected) or id(layer) in skipped)
    ]  # fmt: skip
    for layer, eligible, _ in claim_eligible_weights(candidates, m, taken):
        if eligible:
            plan[id(layer)] = {
                id(var): (axis, compute_mask(var, pattern, axis, method,
                                             name=f"{layer.name}/{path}"))
                for path, var, axis in eligible
            }
    return plan


def _copy_state(source: keras.layers.Layer, target: keras.layers.Layer) -> None:
    """Copies the state of every layer under `source` into its same-structured copy `target`.

    First as a `.keras` file would, layer by layer: `save_own_variables` / `load_own_variables` (an
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
    for a, b in zip(sources, targets):
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


def _copy_layer(layer, called_as: keras.layers.Layer | None = None, to_wrap: bool = False):
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


def _copy_in_scope(layer, called_as: keras.layers.Layer | None, to_wrap: bool):
    """_copy_layer's copy, under the RematScope it chose."""
    try:
        new = layer.__class__.from_config(layer.get_config())
    except Exception as err:
        raise TypeError(
            f"Cannot copy layer {layer.name!r} ({type(layer).__name__}) from its config: {err}\n"
            "The model is copied layer by layer with get_config()/from_config(): give custom "
            "layers a get_config() returning their constructor arguments, and register the "
            "custom classes they hold with @keras.saving.register_keras_serializable()."
        ) from err
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
        if shared := {id(v) for v in new.weights} & {id(v) for v in layer.weights}:
            names = [v.path for v in layer.weights if id(v) in shared]
            raise TypeError(
                f"Cannot copy layer {layer.name!r} ({type(layer).__name__}): the copy made from "
                f"its get_config() holds the layer's own variables {names}, so training the copy "
                "would change the original. Its get_config() returns layer objects instead of "
                "their configs: serialize them (keras.saving.serialize_keras_object) and rebuild "
                "them in from_config().")
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


def prune(
    model: keras.Model,
    pattern: str | None = None,
    *,
    layers: Iterable | None = None,
    skip: Iterable | None = None,
    method: str | None = None,
    wrapper: Callable[..., Sparse24] = Sparse24,
) -> keras.Model:
    """Returns a copy of a trained `model` with N:M magnitude masks on every prunable layer.

    The caller's model is not changed. Compile the returned model before fine-tuning it.

    Args:
        model: a built keras.Model (Sequential, Functional, or subclassed with `Sparse24` layers).
        pattern: "N:M", keep N of every M; None: "2:4" (the model's own `Sparse24` layers keep
            the pattern they were made with; a different one for those selected is an error).
        layers: only prune these (layer names, layer objects or layer classes); None (default):
            every eligible layer. An empty selection is an error, not "everything".
        skip: never prune these (same forms).
        method: mask method, a key of `tf_sparse24.masks.MASK_METHODS`; None: "magnitude" (the
            model's own `Sparse24` layers keep theirs; a different one for those selected whose
            masks are computed is an error). The wrappers keep it for later recomputation
            (`Sparse24Callback(update_every=...)`, SRSTE's every step).
        wrapper: the wrapper class (Sequential/Functional models), `Sparse24` or a subclass such as
            `tf_sparse24.SRSTE`, or a callable `(layer, pattern, weights) -> Sparse24` (e.g.
            `functools.partial(SRSTE, decay=1e-4)`). Subclassed models keep their own wrappers.

    Returns:
        A new keras.Model.

    Raises:
        TypeError / ValueError, before anything is changed: not a model, unbuilt model, bad pattern
        or method, unknown layer names, NaN/Inf weights (naming the layer and weight), a weight
        shared by two layers (tied: copies would untie it).

    Example:
        >>> pruned = tf_sparse24.prune(model)
        >>> pruned.compile("adam", "sparse_categorical_crossentropy")
    """
    _check_model(model, "prune")
    if not callable(wrapper) or (isinstance(wrapper, type) and not issubclass(wrapper, Sparse24)):
        raise TypeError(f"prune(): wrapper must be a Sparse24 subclass or a callable returning one. Received: wrapper={wrapper!r}")
    if pattern is not None:
        parse_pattern(pattern)
    if method is not None:
        _mask_method(method)
    layers = _check_selectors(model, layers, "layers")
    skip = _check_selectors(model, skip, "skip")
    if not (isinstance(model, keras.Sequential) or _is_functional(model)):
        pruned = _prune_subclassed(model, pattern, layers, skip, method)
        _warn_if_nothing_pruned(model, pruned, pattern)
        return pruned
    _check_untied(model, "prune")
    # Wrappers the model already has (a user's, also inside a subclassed block) whose masks are
    # still ones get theirs too; computed masks are kept.
    existing = _unset_masks(model, pattern, layers, skip, method)
    pattern = "2:4" if pattern is None else pattern
    method = DEFAULT_METHOD if method is None else method
    plan = _plan(model, pattern, layers, skip, method)
    _check_not_nesting(model, plan)
    reached = set()

    def clone(layer):
        wraps = any(id(sub) in plan for sub in [layer, *walk_layers(layer)])
        new = _copy_layer(layer, to_wrap=wraps)
        _assign_masks(layer, new, existing)
        spec = _planned_weights(layer, new, plan, reached)
        if not spec:
            return new
        wrapped = wrapper(new, pattern, {p: a for p, (a, _) in spec.items()})
        if not isinstance(wrapped, Sparse24):
            raise TypeError(f"prune(): wrapper returned {type(wrapped).__name__}, not a Sparse24.")
        wrapped.method = _wrapper_method(wrapped, method)
        wrapped.build()
        for pw in wrapped.pruned_weights:
            pw.mask.assign(spec[pw.name][1])
        wrapped.masks_source = "prune()"
        return wrapped

    pruned = clone_graph(model, clone, "prune")
    if missed := [layer.name for layer in walk_layers(model) if id(layer) in plan.keys() - reached]:
        raise ValueError(
            f"prune(): cannot reach layers {missed} of model {model.name!r}: they sit inside a "
            "subclassed model, which cannot be rewired from outside. Wrap them in "
            "tf_sparse24.Sparse24 in that model's __init__, or skip them (skip=[...])."
        )
    _warn_if_nothing_pruned(model, pruned, pattern)
    return pruned


def _warn_if_nothing_pruned(model: keras.Model, pruned: keras.Model, pattern: str | None) -> None:
    """Warns when no wrapper of the copy `pruned` has N:M effective weights: it would train dense
    (nothing selected can be pruned, or every wrapper of the model's own was skipped)."""
    if any(not not_nm_weights([wrapper]) for wrapper in pruned_layers(pruned)):
        return
    what = f" {pattern!r}" if pattern else ""
    warnings.warn(
        f"prune(): no layer of model {model.name!r} was pruned: none of those selected has a "
        f"weight it can prune{what} (tf_sparse24.report(model) says why for each layer).",
        stacklevel=3)


def _check_not_nesting(model: keras.Model, plan: dict[int, dict]) -> None:
    """Refuses to wrap a layer of the graph that already holds a Sparse24 of its own (a user's,
    inside a custom block): the wrapper inside a wrapper would be out of reach of strip(),
    report() and the callback's checks."""
    for layer in _copied_layers(model):
        if isinstance(layer, (keras.Model, Sparse24)):
            continue  # models are rebuilt layer by layer; a wrapper is kept as it is
        inner = walk_layers(layer)
        held = [sub.name for sub in inner if isinstance(sub, Sparse24)]
        planned = [sub.name for sub in [layer, *inner] if id(sub) in plan]
        if held and planned:
            raise ValueError(
                f"prune(): layer {layer.name!r} holds Sparse24 layers of its own {held}, and "
                f"also the prunable layers {planned}: pruning them would wrap {layer.name!r} "
                "around your wrappers. Wrap those layers in Sparse24 in the block too, or skip "
                f"them (skip=[...], e.g. the paths '{layer.name}/<name>').")


def _planned_weights(layer, copy, plan: dict[int, dict], reached: set[int]) -> dict[str, tuple]:
    """`{path relative to copy: (axis, mask)}` for the planned weights of `layer` and of the layers
    inside it (Bidirectional, TimeDistributed, custom blocks).

    `clone_model` hands over only the layers of the model's graph, so a nested layer is pruned by
    wrapping its outermost container. The copy's weights are matched by position (its sublayers
    may have fresh names). The ids of the planned layers found are added to `reached`.
    """
    if not isinstance(layer, keras.layers.Layer):  # a stateless op node (GetItem)
        return {}
    inner = [] if isinstance(layer, keras.Model) else walk_layers(layer)
    position = {id(v): i for i, v in enumerate(layer.weights)}
    copy_paths = {id(v): p for p, v in relative_variables(copy).items()}
    spec = {}
    for sub in [layer, *inner]:
        if id(sub) in plan:
            reached.add(id(sub))
            for variable, planned in plan[id(sub)].items():
                spec[copy_paths[id(copy.weights[position[variable]])]] = planned
    return spec


def _prune_subclassed(model, pattern: str | None, layers, skip, method: str | None) -> keras.Model:
    """Copies a subclassed model and sets magnitude masks in its (selected) Sparse24 layers.

    The wrappers keep their own pattern (their `call` is the model's code, not rebuilt here), and
    computed masks are kept, as in a Functional model: only masks still all ones are computed.
    Masks are matched by position, since a copy made from the config gets fresh layer names.
    """
    if not pruned_layers(model):
        raise ValueError(
            f"prune(): subclassed model {model.name!r} ({type(model).__name__}) has no Sparse24 "
            "layers. Wrap its prunable layers with tf_sparse24.Sparse24 in __init__ (see "
            "docs/USAGE.md), or build it as a Sequential/Functional model."
        )
    masks = _unset_masks(model, pattern, layers, skip, method)
    copy = _copy_model(model)
    _assign_masks(model, copy, masks)
    return copy


def _unset_masks(model, pattern: str | None, layers, skip, method: str | None):
    """`{id(wrapper): (method, masks)}`: masks for the model's own `Sparse24` layers that the
    selectors pick (by the wrapper, the layer it wraps, a layer inside that, or a layer that
    holds the wrapper: a block) and whose masks are still all ones (never computed; computed
    ones are kept), all computed before any is assigned."""
    everything = walk_layers(model)
    in_selected = {"layers": _covered(everything, layers), "skip": _covered(everything, skip)}

    def picked(wrapper, selectors, which: str) -> bool:
        inside = [wrapper, wrapper.layer, *walk_layers(wrapper.layer)]
        return any(_matches(s, selectors) for s in inside) or id(wrapper) in in_selected[which]

    selected = [
        w for w in pruned_layers(model)
        if (not layers or picked(w, layers, "layers")) and not picked(w, skip, "skip")
    ]  # fmt: skip
    # Checked on every selected wrapper, also those whose masks are kept as computed: their
    # pattern is what the copy gets, so another one asked for here would be silently ignored.
    if pattern is not None and (other := [w.name for w in selected if w.pattern != pattern]):
        how = (
            "To change it, prune tf_sparse24.strip(model) instead (a plain copy, weights as now)"
            if isinstance(model, keras.Sequential) or _is_functional(model)  # graph rebuilt
            else "Set the pattern where the model makes them (Sparse24(layer, pattern))"
        )
        raise ValueError(
            f"prune(): pattern={pattern!r}, but the Sparse24 layers {other} of model "
            f"{model.name!r} were made with another pattern, which they keep. {how}, or omit "
            "it here."
        )
    unset = [all(np.all(pw.mask.numpy()) for pw in w.pruned_weights) for w in selected]
    chosen = [w for w, ones in zip(selected, unset) if ones]
    kept = [w for w, ones in zip(selected, unset) if not ones]
    if method is not None and (other := [w.name for w in kept if w.method != method]):
        raise ValueError(
            f"prune(): method={method!r}, but the Sparse24 layers {other} of model "
            f"{model.name!r} hold masks computed by another method, which they keep. Recompute "
            "them (layer.update_masks(method)) first, or omit the method here."
        )
    methods = {  # all checked before any mask is computed
        id(w): w.method if method is None else _wrapper_method(w, method) for w in chosen
    }
    return {
        id(w): (methods[id(w)], [
            compute_mask(pw.variable, pw.pattern, pw.axis, methods[id(w)], name=pw.variable.path)
            for pw in w.pruned_weights
        ])
        for w in chosen
    }


def _wrapper_method(wrapper: Sparse24, method: str) -> str:
    """The mask method for a wrapper prune() masks: `method`, unless the wrapper was made with
    another one than the default, which must then be the one asked for (never dropped silently:
    an SRSTE layer recomputes its masks with it at every step)."""
    if wrapper.method not in (DEFAULT_METHOD, method):
        raise ValueError(
            f"prune(): method={method!r}, but the Sparse24 layer {wrapper.name!r} was made with "
            f"method={wrapper.method!r}. Pass method={wrapper.method!r} to prune(), or make the "
            "layer with the method wanted."
        )
    return method


def _assign_masks(source, copy, masks: dict[int, tuple[str, list]]) -> None:
    """Sets `masks` (keyed by the id of a wrapper in `source`: the method and the masks) on the
    wrappers at the same positions in its copy (a copy made from config has fresh layer
    names)."""
    if not masks or not isinstance(source, keras.layers.Layer):
        return
    own = [source] if isinstance(source, Sparse24) else []
    copies = [copy] if isinstance(copy, Sparse24) else []
    for old, new in zip(own + pruned_layers(source), copies + pruned_layers(copy)):
        if id(old) in masks:
            new.method, values = masks[id(old)]
            for pw, mask in zip(new.pruned_weights, values):
                pw.mask.assign(mask)
            new.masks_source = "prune()"


def _is_functional(model) -> bool:
    """Functional (including nested) models, whose graph `clone_model` can rebuild."""
    return hasattr(model, "_run_through_graph") and not isinstance(model, keras.Sequential)


def _copy_model(model: keras.Model) -> keras.Model:
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
    """_copy_model's copy, under the RematScope the model was made under."""
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


def strip(model: keras.Model) -> keras.Model:
    """Returns a plain Keras model (no wrappers) holding the exact N:M effective weights.

    Warns (UserWarning) when an effective weight is not N:M (masks still ones).

    Raises:
        TypeError: for a subclassed model, or wrappers inside a layer of the graph (their owner's
            `call` names them; export it instead).
        ValueError: a weight shared by two layers (as in `prune`).
    """
    _check_model(model, "strip")
    if not (isinstance(model, keras.Sequential) or _is_functional(model)):
        raise TypeError(
            f"strip() supports Sequential and Functional models. Received subclassed model "
            f"{model.name!r} ({type(model).__name__}); export it with tf_sparse24.export instead."
        )
    _check_untied(model, "strip")
    wrappers, nodes = pruned_layers(model), {id(layer) for layer in _copied_layers(model)}
    if nested := [w.name for w in wrappers if id(w) not in nodes]:
        raise TypeError(
            f"strip(): the Sparse24 layers {nested} of model {model.name!r} sit inside a layer "
            "strip() copies whole (a subclassed model or custom layer, whose code calls them): "
            "it cannot take them out. Export the model instead (tf_sparse24.export), or build "
            "that block as a Functional model."
        )
    if dense := not_nm_weights(wrappers):
        warnings.warn(
            f"strip(): the effective weights {dense} of model {model.name!r} are not N:M (masks "
            "never computed, or reset for a dense warm-up and restored so, e.g. by "
            "EarlyStopping(restore_best_weights=True)); the stripped model keeps them as they are.",
            stacklevel=2,
        )

    def clone(layer):
        if not isinstance(layer, Sparse24):
            return _copy_layer(layer)
        new = _copy_layer(layer.layer, called_as=layer)
        effective = {id(pw.variable): layer.effective_weight(pw) for pw in layer.pruned_weights}
        new.set_weights(
            [np.asarray(effective.get(id(v), v)) for v in layer.layer.weights]
        )
        return new

    return clone_graph(model, clone, "strip")


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


@dataclasses.dataclass
class LayerReport:
    """One row of `report()`."""

    layer: str
    kind: str
    status: str  # "pruned", "not pruned" (eligible, but not selected or not wrapped), "skipped"
    reason: str
    params: int  # elements of the pruned (or prunable-kind) weights
    nonzeros: int
    valid: bool | None  # effective weights are N:M (None when not pruned)

    @property
    def density(self) -> float:
        return self.nonzeros / self.params if self.params else 1.0


def report(model: keras.Model, print_fn: Callable[[str], None] | None = print) -> list[LayerReport]:
    """Per-layer sparsity table: pruned, not pruned (eligible but left dense), or skipped (and
    why), with parameters, density and N:M validity.

    Layers without weights and layers of kinds that are never pruned (e.g. BatchNormalization)
    are left out. Pass `print_fn=None` to only return the rows.
    """
    _check_model(model, "report")
    rows, claimed = [], set()  # a weight is reported once (MultiHeadAttention, not its sublayers)
    # Plain layers are judged against the model's group size ("4:8" skips a layer on 12 inputs).
    sizes = {parse_pattern(layer.pattern)[1] for layer in pruned_layers(model)}
    m = sizes.pop() if len(sizes) == 1 else 4
    for layer in walk_layers(model):
        if isinstance(layer, keras.Model):
            continue
        if isinstance(layer, Sparse24):
            effective = [(pw, layer.effective_weight(pw)) for pw in layer.pruned_weights]
            claimed |= {id(pw.variable) for pw in layer.pruned_weights}
            own_m = parse_pattern(layer.pattern)[1]
            left = _skip_reasons(layer.layer, own_m)
            rows.append(
                LayerReport(
                    layer=layer.name,
                    kind=type(layer.layer).__name__,
                    status="pruned",
                    reason=f"{layer.pattern}: " + ", ".join(pw.name for pw, _ in effective)
                    + "".join(f"; {r}" for r in left),
                    params=sum(int(np.prod(pw.variable.shape)) for pw, _ in effective),
                    nonzeros=sum(int(np.count_nonzero(w)) for _, w in effective),
                    valid=all(is_nm_sparse(w, pw.pattern, pw.axis) for pw, w in effective),
                )
            )
            inside = [layer.layer, *walk_layers(layer.layer)]  # what the wrapper left dense
            rows += [row for sub in inside if (row := _unpruned_row(sub, claimed, own_m))]
        elif row := _unpruned_row(layer, claimed, m):
            rows.append(row)
    if print_fn is not None:
        print_fn(format_report(rows))
    return rows


def _skip_reasons(layer: keras.layers.Layer, m: int) -> list[str]:
    """Why weights under a wrapped `layer` were left out (an LSTM's kernel on 3 inputs, an RNN's
    unknown cell), each reason once: from the outermost layers the registry has anything to say
    about, not again from their sublayers."""
    reasons, covered = [], set()
    for sub in [layer, *walk_layers(layer)]:
        if id(sub) in covered:
            continue
        eligible, why = scan_layer(sub, m)
        if eligible or why:
            covered |= {id(s) for s in walk_layers(sub)}
            reasons += [r for r in why if r not in reasons]
    return reasons


def _unpruned_row(layer, claimed: set[int], m: int) -> LayerReport | None:
    """`report()`'s row for a plain layer: its eligible weights left dense, else the reasons it is
    skipped, else None. Weights already reported (`claimed`) are left out; a row claims all of the
    layer's weights, so MultiHeadAttention's sublayers do not repeat its row."""
    if isinstance(layer, keras.Model) or not layer.weights:
        return None
    if all(id(v) in claimed for v in layer.weights):
        return None
    eligible, reasons = scan_layer(layer, m)
    dense = [(path, var) for path, var, _ in eligible if id(var) not in claimed]
    kind = type(layer).__name__
    if dense:
        detail = "eligible, left dense: " + ", ".join(path for path, _ in dense)
        row = LayerReport(layer.name, kind, "not pruned", "; ".join([detail, *reasons]),
                          sum(int(np.prod(v.shape)) for _, v in dense),
                          sum(int(np.count_nonzero(v)) for _, v in dense), None)
    elif reasons and not eligible:
        params = sum(
            int(np.prod(v.shape)) for v in layer.weights if v.ndim >= 2 and id(v) not in claimed
        )
        row = LayerReport(layer.name, kind, "skipped", "; ".join(reasons), params, params, None)
    elif not type(layer).__module__.startswith("keras.") and (unknown := [
            v for v in own_variables(layer) if v.ndim >= 2 and id(v) not in claimed]):
        # A user's layer with a kernel of its own (`x @ self.w`): which axis it reduces over is
        # unknown, so it is left dense, and said so.
        params = sum(int(np.prod(v.shape)) for v in unknown)
        paths = ", ".join(v.path.split("/")[-1] for v in unknown)
        row = LayerReport(
            layer.name, kind, "skipped",
            f"no rule for this layer's own weights ({paths}): to prune them, wrap it as "
            "tf_sparse24.Sparse24(layer, weights={path: reduction axis})", params, params, None)
    else:
        return None
    claimed |= {id(v) for v in layer.weights}
    return row


def format_report(rows: list[LayerReport]) -> str:
    """Renders `report()` rows as an aligned text table with a total line."""
    header = ("layer", "type", "status", "params", "density", "N:M ok", "detail")
    lines = [
        (r.layer, r.kind, r.status, f"{r.params:,}", f"{r.density:.3f}",
         "-" if r.valid is None else ("yes" if r.valid else "NO"), r.reason)
        for r in rows
    ]
    pruned = [r for r in rows if r.status == "pruned"]
    total_params = sum(r.params for r in pruned)
    total_nnz = sum(r.nonzeros for r in pruned)
    lines.append(
        ("total pruned", "", f"{len(pruned)} layers", f"{total_params:,}",
         f"{total_nnz / total_params:.3f}" if total_params else "-",
         "yes" if all(r.valid for r in pruned) else "NO", "")
    )
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *map(fmt, lines[:-1]), rule, fmt(lines[-1])])
