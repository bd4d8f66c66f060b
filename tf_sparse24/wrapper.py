"""The `Sparse24` Keras wrapper: runs any layer with N:M-masked weights.

The wrapped layer runs inside a `keras.StatelessScope` that maps each pruned variable to
`variable * mask`. The forward therefore sees the exactly-N:M effective weight, gradients at pruned
positions are zero (d(v * m)/dv = m), and the optimizer keeps updating the real variables. No
per-layer code is needed: nested sublayers (MultiHeadAttention projections, RNN cells) read their
variables through the same scope.

The stored variable keeps its (frozen, zero-gradient) values at pruned positions so that a later
mask recomputation can bring them back; everything that leaves the model (`strip`, export,
`report`) uses `effective_weight`, which is exactly N:M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_sparse24.masked_call import (
    MaskedConstraint,
    MaskedRegularizer,
    RecordingScope,
    calls_not_rematerialized,
    is_data,
    rematerializes_call,
    stored_value,
    symbolic_stand_in,
    without_autocast,
)
from tf_sparse24.masks import (
    DEFAULT_METHOD,
    _mask_method,
    compute_mask,
    parse_pattern,
    pattern_mismatch,
)
from tf_sparse24.registry import (
    lora_layers,
    quantized_layers,
    relative_variables,
    scan_layer,
    scope_relative_variables,
)


@dataclasses.dataclass
class PrunedWeight:
    """One pruned variable of a wrapped layer."""

    name: str  # path relative to the wrapped layer, e.g. "kernel", "query/kernel"
    variable: keras.Variable
    mask: keras.Variable
    axis: int
    pattern: str


class _PatternState(tf.train.experimental.PythonState):
    """A wrapper's pattern in `tf.train.Checkpoint`s, checked when one is restored.

    Keras' files load masks through `load_own_variables`, which checks them; a checkpoint assigns
    the mask variables directly, so a 2:4 checkpoint restored into a 1:4 model would run with 2:4
    masks under the 1:4 name. TensorFlow restores Python state before the variables of the same
    restore, so the refusal comes before any of them changes. (A model restored before it is built
    refuses at the call that builds it.)
    """

    def __init__(self, wrapper: "Sparse24"):
        self.wrapper = wrapper

    def serialize(self) -> str:
        return self.wrapper.pattern

    def deserialize(self, string_value) -> None:
        saved = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
        if saved != self.wrapper.pattern:
            raise ValueError(
                f"Sparse24 {self.wrapper.name!r}: the checkpoint being restored was written from "
                f"a model pruned {saved}, but this layer is {self.wrapper.pattern}. Restore it "
                f"into a model pruned with pattern={saved!r}. Its variables were left as they "
                "were."
            )

    def __repr__(self) -> str:  # TensorFlow's unmatched-object assertions list objects this way
        return (
            f"<pattern {self.wrapper.pattern} of Sparse24 {self.wrapper.name!r} (checkpoints "
            "written before 2026-12-03 lack it: restore those with .expect_partial())>"
        )


def sublayers(layer) -> list:
    """Direct sublayers: a model's `layers`, or Layer-valued attributes of a custom layer."""
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    found = []
    for value in vars(layer).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in items if isinstance(v, keras.layers.Layer)]
    return found


def walk_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every layer under `model` (depth first, each once; wrappers are not entered): nested models
    and the Layer-valued attributes of custom layers included."""
    seen, out = set(), []

    def visit(layer):
        for sub in sublayers(layer):
            if id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
                if not isinstance(sub, Sparse24):
                    visit(sub)

    visit(model)
    return out


def claim_eligible_weights(layers: list, m: int, taken: set[int]):
    """`(layer, eligible, reasons)` for each of `layers` that holds weights (models and wrappers
    left out), as `scan_layer` gives them, less the weights a layer before it claimed: in
    `walk_layers` order a layer comes before its sublayers, so MultiHeadAttention's table claims
    its projections and its EinsumDenses find them taken. `taken` (variable ids) grows."""
    for layer in layers:
        if isinstance(layer, (keras.Model, Sparse24)) or not layer.weights:
            continue
        eligible, reasons = scan_layer(layer, m)
        eligible = [(p, v, a) for p, v, a in eligible if id(v) not in taken]
        taken |= {id(v) for _, v, _ in eligible}
        yield layer, eligible, reasons


def _block_weights(layer: keras.layers.Layer, m: int, variables: dict[str, keras.Variable]):
    """`scan_layer` for the layers inside `layer` (a user's block: its Layer-valued attributes),
    claimed as `prune()` plans them, with paths relative to `layer`; weights of wrappers already
    inside it are left to them."""
    path_of = {id(v): p for p, v in variables.items()}
    inside = walk_layers(layer)
    taken = {id(v) for sub in inside if isinstance(sub, Sparse24) for v in sub.layer.weights}
    eligible, reasons = [], []
    for sub, found, why in claim_eligible_weights(inside, m, taken):
        eligible += [(path_of[id(v)], v, a) for _, v, a in found]
        reasons += [f"{sub.name}: {reason}" for reason in why]
    return eligible, reasons


@keras.saving.register_keras_serializable(package="tf_sparse24")
class Sparse24(keras.layers.Wrapper):
    """Runs `layer` with N:M-masked weights; masks are non-trainable weights of the wrapper.

    Masks start as ones (dense); `prune()` or `Sparse24Callback` compute them by magnitude, or
    call `update_masks()`.

    Args:
        layer: the Keras layer to wrap.
        pattern: "N:M", keep N of every M.
        weights: `{relative variable path: grouping axis}` to prune; None uses the registry
            (`tf_sparse24.registry`) or the layer's `get_prunable_weights()`.
        weight_positions: set by `get_config`: the positions of those weights in
            `layer.variables`. A path holds sublayer names, and automatic ones ("dense_5") differ
            when the layer is made again from its config; positions do not.
        layer_variables: set by `get_config`: how many variables `layer` had. A layer made again
            from its config whose sublayers make their weights when first called (a block without
            a `build()`) has fewer until then, and the masks wait for that call.
        method: the mask method (a key of `tf_sparse24.masks.MASK_METHODS`) its masks are
            computed with when recomputed (`update_masks()`, `Sparse24Callback(update_every=...)`)
            or per step (`SRSTE`); `prune(method=...)` sets it. Saved in the config.

    Example:
        >>> layer = Sparse24(keras.layers.Dense(8))
        >>> y = layer(np.ones((2, 16), "float32"))
        >>> layer.update_masks()
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        pattern: str = "2:4",
        weights: dict[str, int] | None = None,
        weight_positions: list[int] | None = None,
        layer_variables: int | None = None,
        method: str = DEFAULT_METHOD,
        **kwargs,
    ):
        parse_pattern(pattern)
        _mask_method(method)
        kwargs.setdefault("name", f"sparse24_{layer.name}")
        # The layer's own policy, not the global one: a float32 head under mixed precision must
        # not get its inputs cast to 16 bits by the wrapper first.
        kwargs.setdefault("dtype", layer.dtype_policy)
        # ...nor to a layer that multiplies its float32 weights (Dense(autocast=False)).
        kwargs.setdefault("autocast", layer.autocast)
        # A frozen layer's wrapper says so (model.layers, summaries); setting `trainable` on the
        # wrapper sets it on the layer, as Keras does for any layer holding others.
        kwargs.setdefault("trainable", layer.trainable)
        super().__init__(layer, **kwargs)
        self.pattern = pattern
        self.method = method
        self._pattern_state = _PatternState(self)  # tracked: checked when a checkpoint restores
        self.supports_masking = (
            layer.supports_masking
        )  # Keras masks pass through like the layer's
        self._mirror_call_signature(layer)
        self._spec = dict(weights) if weights is not None else None
        self._positions = list(weight_positions) if weight_positions is not None else None
        self._layer_variables = layer_variables
        self.pruned_weights: list[PrunedWeight] = []
        # Where the masks came from, as far as this process saw: "ones" (made so), "prune()",
        # "update_masks()" or "loaded" (a file). Not saved, and not updated by assignments to the
        # mask variables themselves. Sparse24Callback's dense warm-up resets prune()'s masks
        # silently, any others with a warning.
        self.masks_source = "ones"
        # Made under a keras.RematScope: this call reads the masked weights' variables, but the
        # inner call they are passed to does not, and must not be recomputed
        # (calls_not_rematerialized); neither is this one. Said once, at the first call (None
        # once said).
        remat = rematerializes_call(self._remat_mode, self.name)
        self._remat_dropped: list[str] | None = [self.name] if remat else []
        self._remat_mode = None

    def _mirror_call_signature(self, layer: keras.layers.Layer) -> None:
        """Makes Keras bind this wrapper's call arguments by the wrapped layer's `call` signature.

        `call(*args, **kwargs)` would be bound as two nested arguments, and Keras refuses one
        that mixes tensors and Python values: `mha(x, x, attention_mask=m, use_causal_mask=True)`
        or keras_hub's `decoder(x, cache=c, cache_update_index=0)` failed wrapped. Bound by the
        layer's own names, each argument stands alone, and `training`/`mask` are passed on where
        the layer takes them, as for the layer itself. Set in `__init__`: a layer that changes
        these attributes later is not followed.
        """
        # Arguments a wrapper class's own `call` names (SRSTE's `training`) are resolved for it too.
        own = [name for name, p in inspect.signature(self.call).parameters.items()
               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self._call_signature = layer._call_signature
        self.call_signature_parameters = list(dict.fromkeys(layer.call_signature_parameters + own))
        self._call_has_training_arg = "training" in self.call_signature_parameters
        self._call_has_mask_arg = layer._call_has_mask_arg
        self._call_has_context_arg = {
            arg: arg in self.call_signature_parameters for arg in self._call_context_args
        }
        # The layer's own __call__ policy: Python values as positional arguments (`block(x, 2)`),
        # inputs left in their dtype. The layer's __call__ applies both again when the wrapper
        # calls it.
        self._allow_non_tensor_positional_args = layer._allow_non_tensor_positional_args
        self._convert_input_args = layer._convert_input_args

    def build(self, input_shape=None):
        super().build(input_shape)
        variables = relative_variables(self.layer)
        self._spec = self._resolved_spec(variables)
        for path, axis in self._spec.items():  # all checked before any mask is made
            if path not in variables:
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} has no variable {path!r}. "
                    f"Available: {sorted(variables)}"
                )
            var = variables[path]
            if not -var.ndim <= axis < var.ndim:  # `axis % ndim` would pick another axis
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r}: weight {path!r} {tuple(var.shape)} has "
                    f"no axis {axis}" + (": a scalar has nothing to group." if var.ndim == 0 else
                                         f" (axes {-var.ndim}..{var.ndim - 1}).")
                )
        for path, axis in self._spec.items():
            var = variables[path]
            mask = self.add_weight(
                name=path.replace("/", "_") + "_mask",
                shape=var.shape,
                dtype=var.dtype,
                initializer="ones",
                trainable=False,
                autocast=False,
            )
            # An attribute, so tf.train.Checkpoint tracks it too, named by position: a name from
            # the path would hold automatic sublayer names, which differ when the model is made
            # again ("lstm_cell_7"), and restore would silently miss the masks.
            setattr(self, f"mask_{len(self.pruned_weights)}", mask)
            self.pruned_weights.append(
                PrunedWeight(path, var, mask, axis % var.ndim, self.pattern)
            )
            # The layer's own regularizer and constraint, on this wrapper's effective weight (a
            # layer wrapped again gets them back from the earlier wrapper's masked ones).
            if isinstance(var.regularizer, MaskedRegularizer):
                var.regularizer = var.regularizer.regularizer
            if isinstance(var.constraint, MaskedConstraint):
                var.constraint = var.constraint.constraint
            if var.regularizer is not None:
                var.regularizer = MaskedRegularizer(var.regularizer, mask)
            if var.constraint is not None:
                var.constraint = MaskedConstraint(var.constraint, mask)
        self.check_masks_apply()
        position = {id(v): i for i, v in enumerate(self.layer.variables)}
        self._positions = [position[id(pw.variable)] for pw in self.pruned_weights]
        self._layer_variables = len(position)
        self.built = True

    def _lookup_dependency(self, name, cached_dependencies=None):
        """Also finds a mask under the path-derived name that checkpoints written before the
        masks were tracked by position use; refuses a checkpoint that holds the wrapped layer
        itself at this place (written before prune()), which would restore nothing here.

        TensorFlow looks up every child of a checkpoint's object before it assigns any variable
        of the restore (passing `cached_dependencies`; assignments to attributes pass none), so
        the refusal leaves everything as it was. Children that another path of the checkpoint
        reached first (a built optimizer's variable list) are not looked up here.
        """
        found = super()._lookup_dependency(name, cached_dependencies)
        if found is None:
            masks = [pw.mask for pw in getattr(self, "pruned_weights", [])]
            found = next((mask for mask in masks if mask.name == name), None)
        if (found is None and cached_dependencies is not None
                and name in self.layer._trackable_children()):
            raise ValueError(
                f"Sparse24 {self.name!r}: the checkpoint being restored holds the unwrapped layer "
                f"{self.layer.name!r} ({type(self.layer).__name__}: its {name!r}) where this "
                "model has the wrapper, so it would restore nothing here: it was written from "
                "the model before prune(). Restore it into that model, then prune it. Nothing "
                "was restored."
            )
        return found

    def load_own_variables(self, store):
        """Loads the masks (`.keras`, `.weights.h5`), first refusing any made for another
        pattern: a 2:4 file loaded into a 1:4 model (or the reverse) would run with the file's
        sparsity under this layer's pattern name."""
        n, m = parse_pattern(self.pattern)
        for i, pw in enumerate(self.pruned_weights):
            value = np.asarray(store[str(i)]) if str(i) in store else None
            if value is None or value.shape != tuple(pw.mask.shape):
                break  # Keras' own check names the missing or misshaped variable
            if problem := pattern_mismatch(value, pw.axis, n, m):
                raise ValueError(
                    f"Sparse24 {self.name!r}: the mask of {pw.name!r} being loaded {problem}, "
                    f"but this layer is {self.pattern}. Was the file saved from a model pruned "
                    "with another pattern? Its masks were left as they were."
                )
        super().load_own_variables(store)
        self.masks_source = "loaded"

    def _resolved_spec(self, variables: dict[str, keras.Variable]) -> dict[str, int]:
        """`{path in `variables`: axis}` of the weights to prune: the registry's when none were
        named; a config's by their positions (its paths may hold other automatic names); else the
        named paths, read by the older scope rule where they are not current paths (configs saved
        before positions were)."""
        if self._spec is None:
            m = parse_pattern(self.pattern)[1]
            eligible, reasons = scan_layer(self.layer, m)
            if not eligible and not reasons:  # not a kind the registry knows: a user's block
                eligible, reasons = _block_weights(self.layer, m, variables)
            if not eligible:
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} ({type(self.layer).__name__}) has no "
                    f"weight to prune for pattern {self.pattern}: "
                    f"{'; '.join(reasons) or 'not a prunable kind, nor any layer inside it'}. "
                    "Name the weights: Sparse24(layer, weights={'kernel': 0})."
                )
            return {path: axis for path, _, axis in eligible}
        path_of = {id(v): p for p, v in variables.items()}
        if self._positions is not None:
            layer_variables = self.layer.variables
            if self._layer_variables not in (None, len(layer_variables)):
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} has {len(layer_variables)} variables, "
                    f"not the {self._layer_variables} it had when this wrapper was saved, so "
                    f"weight_positions={self._positions} cannot be matched to weights="
                    f"{self._spec}. A layer without a build() that builds every sublayer makes "
                    "some weights only in the calls that use them (a shared block first called "
                    "without some of its sublayers): give it a build() that builds them all."
                )
            if len(self._positions) != len(self._spec) or not all(
                0 <= i < len(layer_variables) for i in self._positions
            ):
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} has {len(layer_variables)} variables; "
                    f"weight_positions={self._positions} does not fit weights={self._spec}."
                )
            return {
                path_of[id(layer_variables[i])]: axis
                for i, axis in zip(self._positions, self._spec.values())
            }
        old = scope_relative_variables(self.layer)
        return {
            path_of[id(old[p])] if p not in variables and p in old else p: axis
            for p, axis in self._spec.items()
        }

    def __call__(self, *args, **kwargs):
        waiting = self._weights_wait_for_first_call()
        if not self.layer.built or waiting:
            # Multi-input layers (MHA) build from their own call signature. A symbolic call builds
            # without running the forward, whose state updates (moving statistics, RNN states)
            # would otherwise happen twice on a first eager call. Inputs it cannot stand for
            # (ragged tensors) or a call it cannot trace (Python that needs the data) fall back to
            # a real call: then those updates do happen twice, as documented.
            symbolic = keras.tree.map_structure(symbolic_stand_in, (args, kwargs))
            traced = False
            if not any(is_data(v) for v in keras.tree.flatten(symbolic)):
                with contextlib.suppress(Exception):  # the real call below raises what is real
                    self.layer(*symbolic[0], **symbolic[1])
                    traced = True
            if not (traced and self.layer.built and not self._weights_wait_for_first_call()):
                self.layer(*args, **kwargs)
        if waiting and self.built:  # Keras marks a layer built once build_from_config returns
            self.build()
        return super().__call__(*args, **kwargs)

    def compute_output_shape(self, *args, **kwargs):
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_output_spec(self, *args, **kwargs):
        """The layer's own shape logic where it has one; else a symbolic trace of `call`, which
        runs the layer's `__call__` (its input casts and autocast scope)."""
        own = type(self.layer)
        if (
            own.compute_output_shape is keras.layers.Layer.compute_output_shape
            and own.compute_output_spec is keras.layers.Layer.compute_output_spec
        ):
            return keras.Operation.compute_output_spec(self, *args, **kwargs)
        return self.layer.compute_output_spec(*args, **kwargs)

    def compute_mask(self, inputs, previous_mask=None):
        return self.layer.compute_mask(inputs, previous_mask)

    @property
    def reset_state(self):
        """The wrapped layer's `reset_state` (an RNN's; AttributeError for a layer without one),
        so a `hasattr(layer, "reset_state")` loop over a model reaches wrapped RNNs."""
        return self.layer.reset_state

    @property
    def reset_states(self):
        """Keras' alias of `reset_state`."""
        return self.layer.reset_states

    def get_build_config(self):
        return {"layer": self.layer.get_build_config()}

    def build_from_config(self, config):
        if not self.layer.built and config and config.get("layer"):
            self.layer.build_from_config(config["layer"])
        if not self._weights_wait_for_first_call():
            self.build()  # else the first call builds the layer's sublayers, then this wrapper

    def _weights_wait_for_first_call(self) -> bool:
        """True when the wrapped layer is built but has fewer variables than when this wrapper's
        config was saved: a block without a build() (Keras' examples' TransformerBlock), made
        again from its config, makes its sublayers' weights when first called (positions index
        the full list: they are read only then)."""
        return (self.layer.built and not self.pruned_weights and self._layer_variables is not None
                and len(self.layer.variables) < self._layer_variables)

    def check_masks_apply(self) -> None:
        """Raises ValueError, naming the layer, if the wrapped layer's forward no longer reads its
        masked variables: Keras quantized it or enabled LoRA on it (also after pruning)."""
        layer, variables = self.layer, [pw.variable for pw in self.pruned_weights]
        if names := lora_layers(layer, variables):
            raise ValueError(
                f"Sparse24: LoRA is enabled on {names} inside {layer.name!r}: the kernel it uses, "
                "kernel + lora_a @ lora_b, is dense, so it cannot be kept 2:4. Prune without LoRA, "
                "or fine-tune the pruned model without it."
            )
        if names := quantized_layers(layer):
            raise ValueError(
                f"Sparse24: {names} inside {layer.name!r} were quantized: the quantized kernel is "
                "made from the raw weight, not the masked one, so it is not 2:4. Quantize the "
                "stripped model instead: plain = tf_sparse24.strip(model); plain.quantize(...)."
            )

    def effective_weight(self, pw: PrunedWeight) -> tf.Tensor:
        """The exactly-N:M weight the forward uses: `variable * mask`."""
        value = stored_value(pw.variable)  # the inner layer autocasts the product for itself
        return value * tf.cast(pw.mask.value, value.dtype)

    def update_masks(self, method: str | None = None) -> None:
        """Recomputes every mask from the current variable values by `method` (None: the
        wrapper's own `method`), which becomes the wrapper's method."""
        self._assign_masks(self._computed_masks(method), method)

    def _computed_masks(self, method: str | None = None) -> list[tf.Tensor]:
        """The masks `update_masks(method)` would assign, one per pruned weight; all checked
        (shapes, NaN/Inf) and nothing assigned."""
        method = self.method if method is None else method
        return [
            compute_mask(pw.variable, pw.pattern, pw.axis, method, name=f"{self.name}/{pw.name}")
            for pw in self.pruned_weights
        ]

    def _assign_masks(self, masks: list[tf.Tensor], method: str | None = None) -> None:
        """Assigns masks from `_computed_masks(method)`; `method` becomes the wrapper's."""
        for pw, mask in zip(self.pruned_weights, masks, strict=True):
            pw.mask.assign(mask)
        self.method = self.method if method is None else method
        self.masks_source = "update_masks()"

    def call(self, *args, **kwargs):
        self.check_masks_apply()
        # Out of the autocast scope Keras opened for this call: a StatelessScope converts each value
        # to its variable's `dtype`, which reads as the 16-bit compute dtype inside it, so a float32
        # sublayer would get rounded weights. Each inner layer autocasts for itself.
        with without_autocast():
            masked = {id(pw.variable): self.effective_weight(pw) for pw in self.pruned_weights}
            state = [(v, masked.get(id(v), v.value)) for v in self.layer.variables]
            scope = RecordingScope(state)
        with scope, calls_not_rematerialized(self.layer) as dropped:
            outputs = self.layer(*args, **kwargs)
        if self._remat_dropped is not None and (dropped := self._remat_dropped + dropped):
            self._remat_dropped = None
            warnings.warn(
                f"Sparse24: keras.RematScope does not rematerialize {dropped} in {self.name!r}: "
                "recomputed calls would give the pruned weights no gradient (tf.recompute_grad "
                "differentiates only a call's inputs and the variables read inside it, and the "
                "wrapper passes the masked weights in). Their activations are kept instead: more "
                "memory, same results. RematScope(mode='activations') is kept.",
                stacklevel=2,
            )
        masks = {id(pw.variable): pw.mask for pw in self.pruned_weights}
        for var in scope.assigned.values():  # the layer's own state updates
            value = tf.cast(scope.get_current_value(var), var.dtype)
            if id(var) in masks:
                # A layer that assigns its own kernel (SpectralNormalization) made the new value
                # from the masked one: only the kept positions take it, the pruned ones keep
                # their stored values, which a later mask recomputation may bring back.
                kept = tf.cast(masks[id(var)].value, tf.bool)
                value = tf.where(kept, value, stored_value(var))
            var.assign(value)
        for loss in scope.losses:
            self.add_loss(loss)
        return outputs

    def get_config(self):
        return {
            **super().get_config(),
            "pattern": self.pattern,
            "weights": self._spec,
            "weight_positions": self._positions,
            "layer_variables": self._layer_variables,
            "method": self.method,
        }
