"""What running a layer under a variable mapping needs, for the `Sparse24` wrapper.

Inside the wrapper's `keras.StatelessScope` a layer reads `variable * mask`; these pieces keep the
rest of Keras' machinery consistent with that: the scope passes on the layer's own assignments and
losses, regularizers and constraints act on the effective weight, variables are read in their stored
dtype, `RematScope` is kept from recomputing a call (its gradients would miss the masked weights),
and a first call can be run symbolically.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state  # where Keras keeps its autocast scope


class RecordingScope(keras.StatelessScope):
    """A `StatelessScope` that remembers every variable the layer assigned inside it, and collects
    the losses it added.

    `call` passes both on afterwards: RNG seeds, moving statistics, stateful RNNs' states (which
    Keras keeps out of `layer.variables`), and `add_loss` / activity-regularizer losses (which a
    non-collecting scope would drop).
    """

    def __init__(self, state_mapping):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.assigned: dict[int, keras.Variable] = {}

    def add_update(self, update):
        self.assigned[id(update[0])] = update[0]
        super().add_update(update)


class MaskedRegularizer:
    """A pruned variable's own regularizer, applied to the effective weight `variable * mask`.

    Keras evaluates weight regularizers on the raw variable, outside the wrapper's scope; masked,
    the pruned positions neither add to the loss nor get its gradient (contract 2).
    """

    def __init__(self, regularizer, mask: keras.Variable):
        self.regularizer, self.mask = regularizer, mask

    def __call__(self, x):
        return self.regularizer(x * keras.ops.cast(self.mask, x.dtype))


class MaskedConstraint:
    """A pruned variable's own constraint (`kernel_constraint=UnitNorm()`), applied to the
    effective weight `variable * mask`.

    Keras applies a constraint to the raw variable after each update: the pruned positions would
    count (a unit-norm raw column is not a unit-norm effective one) and move. Masked, the weight the
    forward uses satisfies the constraint and the pruned positions stay as they are.
    """

    def __init__(self, constraint, mask: keras.Variable):
        self.constraint, self.mask = constraint, mask

    def __call__(self, w):
        mask = keras.ops.cast(self.mask, w.dtype)
        return self.constraint(w * mask) * mask + w * (1 - mask)


@contextlib.contextmanager
def without_autocast():
    """No autocast scope: variables read, and report their `dtype`, as stored. Keras'
    `AutocastScope(None)` reads values as stored but reports every float variable's `dtype` as
    `floatx()`, so a float16/bfloat16/float64 layer's mapped weights would be cast to float32."""
    outer = global_state.get_global_attribute("autocast_scope")
    global_state.set_global_attribute("autocast_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("autocast_scope", outer)


@contextlib.contextmanager
def calls_not_rematerialized(layer: keras.layers.Layer):
    """Runs `layer` and its sublayers without `keras.RematScope`'s whole-call rematerialization
    (modes "full", "larger_than", "list_of_layers"); yields the names of the layers it applied to.

    `tf.recompute_grad` differentiates a call with respect to its inputs and the variables read
    inside it only. The masked weights the wrapper maps the variables to are neither, so a
    rematerialized inner call gave the pruned weights no gradient: they silently never trained.
    Mode "activations" (only the activation function is recomputed) is kept.
    """
    dropped = [sub for sub in layer._flatten_layers(include_self=True)
               if rematerializes_call(sub._remat_mode, sub.name)]
    saved = [sub._remat_mode for sub in dropped]
    for sub in dropped:
        sub._remat_mode = None
    try:
        yield [sub.name for sub in dropped]
    finally:
        for sub, mode in zip(dropped, saved):
            sub._remat_mode = mode


def rematerializes_call(mode, name: str) -> bool:
    """Whether a layer made under RematScope `mode` may recompute its whole call."""
    if mode is None or mode.mode == "activations":
        return False
    return mode.mode != "list_of_layers" or name in mode.layer_names


def stored_value(variable: keras.Variable):
    """The variable's current value in its own dtype: inside a mixed-precision call, `.value` is
    autocast to the caller's 16-bit compute dtype, which would round a float32 sublayer's weights
    and tie magnitudes that differ in float32. Each inner layer still autocasts for itself."""
    with without_autocast():
        return variable.value


def symbolic_stand_in(value):
    """A `KerasTensor` standing for a dense tensor, variable or numpy array; anything else as it
    is."""
    if isinstance(value, (tf.Tensor, tf.Variable, keras.Variable)):
        return keras.KerasTensor(value.shape, keras.backend.standardize_dtype(value.dtype))
    if isinstance(value, np.ndarray) and value.ndim and value.dtype.kind in "biufcUSO":
        dtype = "string" if value.dtype.kind in "USO" else value.dtype.name
        return keras.KerasTensor(value.shape, dtype)
    return value


def is_data(value) -> bool:
    """A tensor `symbolic_stand_in` left as it is (ragged, sparse): a symbolic call would run on it.
    (`tf.is_tensor` is true for those composite tensors, false for a KerasTensor.)"""
    return tf.is_tensor(value)
