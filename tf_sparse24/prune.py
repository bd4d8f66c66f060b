"""Model-level pruning: `prune`, `strip`, `pruned_layers`.

`prune()` never alters the caller's model: it returns a new model whose prunable layers are wrapped
in `Sparse24` with magnitude masks computed from the trained weights.

- Sequential and Functional models (nested models and shared layers included) are cloned with
  `keras.models.clone_model`; each layer's weights are copied, and eligible layers are wrapped.
- Subclassed models cannot be rewired from outside (their `call` names the layers), so they opt in
  by wrapping their prunable layers in `Sparse24` in `__init__` (masks start as ones: the model
  trains dense). `prune()` then returns a copy made with `get_config()` / `from_config()` (Keras
  captures simple constructor arguments automatically) whose wrappers hold magnitude masks.

The copying itself is `model_copy.py`'s; `report()` is in `report.py`.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable

import keras
import numpy as np

from tf_sparse24.masks import (
    DEFAULT_METHOD,
    _mask_method,
    compute_mask,
    is_nm_sparse,
    parse_pattern,
)
from tf_sparse24.model_copy import (
    check_untied,
    clone_graph,
    copied_layers,
    copy_layer,
    copy_model,
    is_functional,
)
from tf_sparse24.registry import relative_variables
from tf_sparse24.wrapper import Sparse24, claim_eligible_weights, sublayers, walk_layers

__all__ = ["prune", "pruned_layers", "strip"]


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


def check_model(model, what: str) -> None:
    """Raises unless `model` is a built keras.Model (`what`: the calling function, for the
    message)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"{what}() expects a keras.Model. Received: {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"{what}() needs a built model (call it on data or build it first). Received: "
            f"unbuilt model {model.name!r}"
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
        for sub in sublayers(layer):
            inner = sub.layer if isinstance(sub, Sparse24) else sub
            if name in (sub.name, inner.name):
                found = inner if name == inner.name else sub
                break
        if found is None:
            return None
        layer = found
    return layer


def _close_names(unknown: list[str], layers: list, shown: int = 40) -> str:
    """The names of `layers` (the first `shown`, in model order) and those close to each of
    `unknown`, for the error about names a model does not have."""
    names = list(dict.fromkeys(layer.name for layer in layers))
    close = {n: difflib.get_close_matches(n.rsplit("/", 1)[-1], names, 3) for n in unknown}
    hint = "; ".join(f"{n!r}: did you mean {c}?" for n, c in close.items() if c)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (f" {hint}" if hint else "") + f" Its layers: {names[:shown]}{more}."


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
    predicate = (f" For a predicate, pass the layers it picks: {arg}=filter(predicate, "
                 "model.layers) (or a list of their names).")
    try:
        chosen = _selector_list(selectors)  # once: an iterator (a generator) is used up by it
    except TypeError:
        raise TypeError(f"{arg}: expected a layer name, object or class, or a sequence of them. "
                        f"Received: {arg}={selectors!r}.{predicate if callable(selectors) else ''}"
                        ) from None
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
                        f"{wrong!r}.{predicate if any(map(callable, wrong)) else ''}")
    if unknown := [s for s in selectors if isinstance(s, str) and s not in names]:
        raise ValueError(f"{arg}: no layer named {unknown} in model {model.name!r}."
                         f"{_close_names(unknown, layers)}")
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
    check_model(model, "prune")
    if not callable(wrapper) or (isinstance(wrapper, type) and not issubclass(wrapper, Sparse24)):
        raise TypeError(f"prune(): wrapper must be a Sparse24 subclass or a callable returning one. Received: wrapper={wrapper!r}")
    if pattern is not None:
        parse_pattern(pattern)
    if method is not None:
        _mask_method(method)
    layers = _check_selectors(model, layers, "layers")
    skip = _check_selectors(model, skip, "skip")
    if not (isinstance(model, keras.Sequential) or is_functional(model)):
        pruned = _prune_subclassed(model, pattern, layers, skip, method)
        _warn_if_nothing_pruned(model, pruned, pattern)
        return pruned
    check_untied(model, "prune")
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
        new = copy_layer(layer, to_wrap=wraps)
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
    for layer in copied_layers(model):
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
    copy = copy_model(model)
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
            if isinstance(model, keras.Sequential) or is_functional(model)  # graph rebuilt
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


def strip(model: keras.Model) -> keras.Model:
    """Returns a plain Keras model (no wrappers) holding the exact N:M effective weights.

    Warns (UserWarning) when an effective weight is not N:M (masks still ones).

    Raises:
        TypeError: for a subclassed model, or wrappers inside a layer of the graph (their owner's
            `call` names them; export it instead).
        ValueError: a weight shared by two layers (as in `prune`); a wrapped layer that Keras
            quantized or gave LoRA after pruning (its kernel is no longer `variable * mask`, so
            the copy would hold a dense kernel), naming it.
    """
    check_model(model, "strip")
    if not (isinstance(model, keras.Sequential) or is_functional(model)):
        raise TypeError(
            f"strip() supports Sequential and Functional models. Received subclassed model "
            f"{model.name!r} ({type(model).__name__}); export it with tf_sparse24.export instead."
        )
    check_untied(model, "strip")
    wrappers, nodes = pruned_layers(model), {id(layer) for layer in copied_layers(model)}
    if nested := [w.name for w in wrappers if id(w) not in nodes]:
        raise TypeError(
            f"strip(): the Sparse24 layers {nested} of model {model.name!r} sit inside a layer "
            "strip() copies whole (a subclassed model or custom layer, whose code calls them): "
            "it cannot take them out. Export the model instead (tf_sparse24.export), or build "
            "that block as a Functional model."
        )
    for wrapper in wrappers:  # the layer no longer reads variable * mask
        try:
            wrapper.check_masks_apply()
        except ValueError as err:
            raise ValueError(f"strip(): {err} (Keras changed the layer in place: strip the "
                             "pruned model as saved before.)") from None
    if dense := not_nm_weights(wrappers):
        warnings.warn(
            f"strip(): the effective weights {dense} of model {model.name!r} are not N:M (masks "
            "never computed, or reset for a dense warm-up and restored so, e.g. by "
            "EarlyStopping(restore_best_weights=True)); the stripped model keeps them as they are.",
            stacklevel=2,
        )

    def clone(layer):
        if not isinstance(layer, Sparse24):
            return copy_layer(layer)
        new = copy_layer(layer.layer, called_as=layer)
        effective = {id(pw.variable): layer.effective_weight(pw) for pw in layer.pruned_weights}
        new.set_weights(
            [np.asarray(effective.get(id(v), v)) for v in layer.layer.weights]
        )
        return new

    return clone_graph(model, clone, "strip")
