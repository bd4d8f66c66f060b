"""`SRSTE`: N:M sparse training from scratch with the sparse-refined straight-through estimator.

Zhou et al., "Learning N:M Fine-grained Structured Sparse Neural Networks From Scratch" (ICLR
2021). Every forward recomputes the N:M mask (by magnitude, or the wrapper's other `method`) from
the current dense weights W and uses the pruned weight W~ = W * mask. The backward passes the
gradient at W~ straight through to all of W (pruned positions included, so a pruned weight can
grow back), and SR-STE adds the sparse-refined decay on the pruned positions (the paper's Eq. 5):

    W <- W - lr * (dL/dW~ + decay * (1 - mask) * W)

The decay term is the gradient of `0.5 * decay * sum(((1 - mask) * W) ** 2)`, which the layer adds
with `add_loss` in training, so it goes through loss scaling and distribution like any other loss.
"""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_sparse24.masked_call import stored_value
from tf_sparse24.masks import DEFAULT_METHOD, compute_mask
from tf_sparse24.wrapper import PrunedWeight, Sparse24

DEFAULT_DECAY = 2e-4  # the paper's lambda_W


@keras.saving.register_keras_serializable(package="tf_sparse24")
class SRSTE(Sparse24):
    """A `Sparse24` whose masks follow the dense weights at every step (SR-STE training).

    The forward always uses the exactly-N:M magnitude mask of the current weights, so `strip()`,
    `report()`, export and `Sparse24Callback`'s check see exact N:M weights at any moment. In
    training the mask variables are refreshed to the mask the forward used (for inspection and
    checkpoints); the forward itself never reads them, so `Sparse24Callback`'s mask schedule
    (`start_step`, `update_every`) has no effect on these layers.

    Args:
        layer: the Keras layer to wrap.
        pattern: "N:M", keep N of every M.
        weights: `{relative variable path: grouping axis}`; None uses the registry.
        method: the mask method of every step (`"transposable"`: masks 2:4 along both axes).
        decay: the sparse-refined decay lambda_W on pruned positions (0 gives plain STE).

    Raises:
        ValueError: `decay` is not a finite number >= 0 (plus `Sparse24`'s checks).

    Example:
        >>> model = tf_sparse24.prune(untrained_model, wrapper=tf_sparse24.SRSTE)
        >>> model.compile("sgd", "mse"); model.fit(x, y)   # masks move with the weights
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        pattern: str = "2:4",
        weights: dict | None = None,
        decay: float = DEFAULT_DECAY,
        method: str = DEFAULT_METHOD,
        **kwargs,
    ):
        if (
            isinstance(decay, (bool, np.bool_))
            or not isinstance(decay, numbers.Real)  # numpy scalars too (np.float32(1e-4))
            or not (math.isfinite(decay) and decay >= 0)
        ):
            raise ValueError(
                f"SRSTE({layer.name!r}): decay must be a finite number >= 0. Received: decay={decay!r}"
            )
        kwargs.setdefault("name", f"srste_{layer.name}")
        super().__init__(layer, pattern, weights, method=method, **kwargs)
        self.decay = float(decay)
        self._masks_this_call = None
        self._decay_loss = None  # the decay tensor this layer last passed to `add_loss`

    def current_mask(self, pw: PrunedWeight) -> tf.Tensor:
        """The N:M mask (by the wrapper's `method`) of the variable's current value, in the
        variable's dtype (inside and outside a mixed-precision call alike: 16-bit rounding would
        tie other weights)."""
        return compute_mask(stored_value(pw.variable), pw.pattern, pw.axis, self.method,
                            name=pw.variable.path)

    def effective_weight(self, pw: PrunedWeight) -> tf.Tensor:
        """`variable * current_mask`, with a straight-through (identity) gradient to the variable."""
        value = stored_value(pw.variable)
        mask = (self._masks_this_call or {}).get(id(pw.variable))
        masked = value * (self.current_mask(pw) if mask is None else mask)
        return value + tf.stop_gradient(masked - value)  # exactly `masked`: v + (0 or -v)

    def call(self, *args, training=None, **kwargs):
        # `training` is declared so Keras resolves it here; the wrapped layer inherits it from the
        # call context, so it is not forwarded (layers without a `training` argument would reject it).
        masks = {id(pw.variable): self.current_mask(pw) for pw in self.pruned_weights}
        if training:
            for pw in self.pruned_weights:
                pw.mask.assign(tf.cast(masks[id(pw.variable)], pw.mask.dtype))
            # The decay belongs to the weights, not to the call: a layer called more than once in
            # one forward (shared by two branches) adds it once. Keras empties `losses` when an
            # outer call starts, so the term is there only if this forward already added it.
            if self.decay and self.pruned_weights and not self._decay_added():
                decay = []
                for pw in self.pruned_weights:
                    pruned = (1 - masks[id(pw.variable)]) * stored_value(pw.variable)
                    decay.append(tf.reduce_sum(tf.square(tf.cast(pruned, "float32"))))
                # In floatx, as Keras sums it with the compiled loss (float16 under floatx float16).
                loss = 0.5 * self.decay * tf.add_n(decay)
                self._decay_loss = tf.cast(loss, keras.config.floatx())
                self.add_loss(self._decay_loss)
        self._masks_this_call = masks  # computed once per call; `effective_weight` reuses them
        try:
            return super().call(*args, **kwargs)
        finally:
            self._masks_this_call = None

    def _decay_added(self) -> bool:
        """Whether this forward's losses already hold the decay term (compared by identity: the
        stored tensor is kept alive, so its id cannot pass to another loss)."""
        return self._decay_loss is not None and any(x is self._decay_loss for x in self.losses)

    def get_config(self):
        return {**super().get_config(), "decay": self.decay}
