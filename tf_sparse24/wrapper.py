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

import dataclasses

import keras
import tensorflow as tf

from tf_sparse24.masks import compute_mask, parse_pattern
from tf_sparse24.registry import relative_variables, scan_layer


@dataclasses.dataclass
class PrunedWeight:
    """One pruned variable of a wrapped layer."""

    name: str  # path relative to the wrapped layer, e.g. "kernel", "query/kernel"
    variable: keras.Variable
    mask: keras.Variable
    axis: int
    pattern: str


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

    Example:
        >>> layer = Sparse24(keras.layers.Dense(8))
        >>> y = layer(np.ones((2, 16), "float32"))
        >>> layer.update_masks()
    """

    def __init__(
        self, layer, pattern: str = "2:4", weights: dict | None = None, **kwargs
    ):
        parse_pattern(pattern)
        kwargs.setdefault("name", f"sparse24_{layer.name}")
        super().__init__(layer, **kwargs)
        self.pattern = pattern
        self.supports_masking = (
            layer.supports_masking
        )  # Keras masks pass through like the layer's
        self._spec = dict(weights) if weights is not None else None
        self.pruned_weights: list[PrunedWeight] = []

    def build(self, input_shape=None):
        super().build(input_shape)
        variables = relative_variables(self.layer)
        if self._spec is None:
            eligible, reasons = scan_layer(self.layer, parse_pattern(self.pattern)[1])
            if not eligible:
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} ({type(self.layer).__name__}) has no "
                    f"weight to prune for pattern {self.pattern}: {'; '.join(reasons) or 'not a prunable kind'}."
                )
            self._spec = {path: axis for path, _, axis in eligible}
        for path, axis in self._spec.items():
            if path not in variables:
                raise ValueError(
                    f"Sparse24: layer {self.layer.name!r} has no variable {path!r}. "
                    f"Available: {sorted(variables)}"
                )
            var = variables[path]
            mask = self.add_weight(
                name=path.replace("/", "_") + "_mask",
                shape=var.shape,
                dtype=var.dtype,
                initializer="ones",
                trainable=False,
                autocast=False,
            )
            setattr(
                self, mask.name, mask
            )  # an attribute, so tf.train.Checkpoint tracks it too
            self.pruned_weights.append(
                PrunedWeight(path, var, mask, axis % var.ndim, self.pattern)
            )
        self.built = True

    def __call__(self, *args, **kwargs):
        if (
            not self.layer.built
        ):  # multi-input layers (MHA) build from their own call signature
            self.layer(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def compute_mask(self, inputs, previous_mask=None):
        return self.layer.compute_mask(inputs, previous_mask)

    def get_build_config(self):
        return {"layer": self.layer.get_build_config()}

    def build_from_config(self, config):
        if not self.layer.built and config and config.get("layer"):
            self.layer.build_from_config(config["layer"])
        self.build()

    def effective_weight(self, pw: PrunedWeight) -> tf.Tensor:
        """The exactly-N:M weight the forward uses: `variable * mask`."""
        value = (
            pw.variable.value
        )  # the compute dtype inside a mixed-precision call (autocast)
        return value * tf.cast(pw.mask.value, value.dtype)

    def update_masks(self, method: str = "magnitude") -> None:
        """Recomputes every mask by `method` from the current variable values."""
        masks = [
            compute_mask(
                pw.variable, pw.pattern, pw.axis, method, name=pw.variable.path
            )
            for pw in self.pruned_weights
        ]  # all checked before any assignment
        for pw, mask in zip(self.pruned_weights, masks):
            pw.mask.assign(mask)

    def call(self, *args, **kwargs):
        masked = {
            id(pw.variable): self.effective_weight(pw) for pw in self.pruned_weights
        }
        state = [(v, masked.get(id(v), v.value)) for v in self.layer.variables]
        with keras.StatelessScope(state_mapping=state) as scope:
            outputs = self.layer(*args, **kwargs)
        for var, value in state:  # forward state updates (RNG seeds, moving statistics)
            new = scope.get_current_value(var)
            if new is not value:
                var.assign(new)
        return outputs

    def get_config(self):
        return {**super().get_config(), "pattern": self.pattern, "weights": self._spec}
