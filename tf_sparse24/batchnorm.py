"""Re-estimating BatchNormalization statistics after one-shot pruning.

Zeroing half of every kernel moves the activations each BatchNormalization layer normalizes, so the
moving mean and variance it learned on the dense model no longer fit them: a one-shot 2:4 network
with batch norm can lose most of its accuracy before any fine-tuning (a small MNIST ResNet: 95% ->
29%, docs/ACCURACY.md). Running some training inputs through the pruned model in training mode
and averaging the batch statistics refits them, all other state put back (AdaBN, Li et al. 2016;
"batch norm re-estimation" in NNCF and AIMET). Fine-tuning refreshes them too; this is for a model
that is not fine-tuned, or before fine-tuning starts.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf

from tf_sparse24.layer_calls import calls_replaced
from tf_sparse24.wrapper import Sparse24


def _batch_norms(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer in `model`, nested models and wrapped layers included."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)]


def _forward_state(model: keras.Model) -> list:
    """The variables a forward can write: the model's (less Sparse24 masks, which no forward
    writes), and stateful RNNs' states (Keras keeps those untracked, outside `model.variables`)."""
    layers = list(model._flatten_layers(include_self=False, recursive=True))
    masks = {id(pw.mask) for layer in layers if isinstance(layer, Sparse24)
             for pw in layer.pruned_weights}
    states = [v for layer in layers
              if getattr(layer, "stateful", False) and getattr(layer, "states", None) is not None
              for v in keras.tree.flatten(layer.states)]
    return [v for v in model.variables if id(v) not in masks] + states


ARRAY_STRUCTURES = (np.ndarray, tf.Tensor, list, tuple, dict)  # model inputs, as Keras reads x


def _check_input_arrays(model: keras.Model, x) -> None:
    """Refuses a list/tuple/dict `x` that is not one array per model input: `(x_train, y_train)`
    or a list of `(x, y)` batches would otherwise be cut into batches as several inputs."""
    if not isinstance(x, (list, tuple, dict)):
        return
    try:
        wanted = len(keras.tree.flatten(model.input))
    except (AttributeError, ValueError):  # a Sequential model never called has only `inputs`
        if not getattr(model, "inputs", None):  # a subclassed model: no symbolic inputs to count
            return
        wanted = len(model.inputs)
    if (got := len(keras.tree.flatten(x))) != wanted:
        raise ValueError(
            f"recalibrate_batch_norm(): x is a {type(x).__name__} of {got} arrays, read as the "
            f"inputs of model {model.name!r}, which takes {wanted}. Pass the inputs only (no "
            "targets), or batches as a tf.data.Dataset or an iterator (iter(list_of_batches)).")


def _check_dataset(model: keras.Model, x, steps: int | None) -> None:
    """Refuses a tf.data.Dataset known to repeat forever (`ds.repeat()`, as fed to
    `fit(steps_per_epoch=...)`) without `steps`: the loop over it would never end; and one of
    single examples (not batched): each element has one axis less than the model's inputs, and
    is not a batch that Keras completes (a Functional model appends a missing last axis of size
    1: `[batch]` elements for `keras.Input((1,))`). An element that already ends in that axis of
    size 1 (`[1]` for `keras.Input((1,))`, `[steps, 1]` for `keras.Input((None, 1))`) is one
    example: Keras would run it as a batch of one row, whose variance is zero."""
    if not isinstance(x, tf.data.Dataset):
        return
    if steps is None and int(x.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError("recalibrate_batch_norm(): x is an infinite dataset (it repeats "
                         "forever); pass steps=, the number of batches to use.")
    spec = x.element_spec[0] if isinstance(x.element_spec, tuple) else x.element_spec
    given = [s.shape for s in keras.tree.flatten(spec)]
    wanted = [tf.TensorShape(t.shape) for t in getattr(model, "inputs", None) or []]

    def one_example(shape: tf.TensorShape, model_input: tf.TensorShape) -> bool:
        if shape.rank is None or shape.rank != model_input.rank - 1:
            return False
        return not (model_input[-1] == 1 and shape.rank and shape[-1] != 1
                    and model_input.is_compatible_with(shape + [1]))

    if len(given) == len(wanted) and all(map(one_example, given, wanted)):
        raise ValueError(
            f"recalibrate_batch_norm(): x is a dataset of single examples (element shapes "
            f"{[tuple(s.shape) for s in keras.tree.flatten(spec)]}; model {model.name!r} takes "
            f"{[tuple(t.shape) for t in model.inputs]}): batch it, e.g. x.batch(32).")


def _input_batches(x, batch_size: int) -> Iterable:
    """Model inputs batch by batch: slices of arrays (one, or a list/tuple/dict of them), or the
    inputs of each element of a tf.data.Dataset / iterable (`x` of `(x, y)` or
    `(x, y, sample_weight)`; a `keras.utils.PyDataset`'s lists too, as Keras reads them)."""
    if isinstance(x, ARRAY_STRUCTURES):
        rows = len(keras.tree.flatten(x)[0])
        for start in range(0, rows, batch_size):
            yield keras.tree.map_structure(lambda a, s=start: a[s:s + batch_size], x)
    else:
        lists_are_tuples = isinstance(x, keras.utils.PyDataset)
        for element in x:
            if lists_are_tuples and isinstance(element, list):
                element = tuple(element)
            yield element[0] if isinstance(element, tuple) else element


class _AveragingCall:
    """A `call` for `layer` that sets its `momentum` before each training-mode call, so that its
    moving statistics end as the average of the batch statistics of all its calls, each weighted
    by its rows: `moving = (seen * moving + rows * batch) / (seen + rows)` per call, however many
    times one forward calls the layer (a tower shared by two branches runs it twice). `seen`
    counts the rows: 0 means the forward never reached this `call`. A call on no rows has no
    statistics (Keras' would be NaN, kept by any momentum): it runs in inference mode."""

    def __init__(self, layer: keras.layers.BatchNormalization):
        self.layer, self.call = layer, layer.call
        self.signature = inspect.signature(self.call)
        self.seen = 0

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        arguments = bound.arguments
        if arguments.get("training"):  # BatchNormalization updates its statistics on this call
            if not tf.executing_eagerly():
                raise RuntimeError(
                    f"recalibrate_batch_norm(): layer {self.layer.name!r} was called inside a "
                    "tf.function; its calls cannot be counted there. Run the model eagerly.")
            rows = int(keras.ops.shape(next(iter(arguments.values())))[0])
            if not rows:
                arguments["training"] = False
                return self.call(*bound.args, **bound.kwargs)
            self.layer.momentum = self.seen / (self.seen + rows)
            self.seen += rows
        return self.call(*args, **kwargs)


def _uncounted(calls: list[_AveragingCall], saved: list) -> tuple[list[str], list[str]]:
    """The layers the forward never ran through their `call`: those whose statistics changed
    anyway (a tf.function traced before recalibration ran its old graph, with the old momentum)
    and those left as they were (not called in training mode)."""
    changed, untouched = [], []
    for call, (_, _, mean, variance) in zip(calls, saved):
        if not call.seen:
            same = (np.array_equal(call.layer.moving_mean.numpy(), mean)
                    and np.array_equal(call.layer.moving_variance.numpy(), variance))
            (untouched if same else changed).append(call.layer.name)
    return changed, untouched


def recalibrate_batch_norm(
    model: keras.Model, x, *, batch_size: int = 32, steps: int | None = None
) -> list[str]:
    """Re-estimates the moving mean and variance of every BatchNormalization layer of `model`.

    Runs `model(batch, training=True)` over the batches of `x` and sets each layer's moving
    statistics to the average of its batch statistics (biased variance), weighted by batch size.
    A layer that one forward calls several times (shared by two branches) averages the
    statistics of every call, as if each were a batch of its own. For that each layer's `momentum`
    is set before each of its calls, by a `call` set on the layer; both are restored afterwards,
    even on error. The model must run eagerly. Nothing else changes: every other variable the
    forward writes (SpectralNormalization's kernel, a stateful RNN's states, dropout seeds) is
    put back afterwards, from a copy of them held during the run (host memory: about the
    model's weights once more); layers with
    `trainable=False` are recalibrated too. Use training inputs, after `tf_sparse24.prune` or
    `strip` (in bench/bn_recalibration.py 1,024 samples did as well as 4,000). Under a
    `tf.distribute` strategy, pass arrays or a plain (not distributed) Dataset: batches run whole,
    in cross-replica context, and every replica gets the same statistics.

    Args:
        model: a built Keras model.
        x: model inputs: an array (or a list/tuple/dict of arrays, one per input, as Keras
            reads `x`), or a tf.data.Dataset / iterator of batches whose elements are inputs or
            `(inputs, targets[, sample_weights])` tuples.
        batch_size: rows per batch when `x` is arrays.
        steps: use at most this many batches (None: all of `x`).

    Returns:
        The names of the layers recalibrated: those the forward called in training mode (empty
        if the model has no BatchNormalization). A warning names any other.

    Raises:
        ValueError: for an unbuilt model, a bad `batch_size`/`steps`, arrays that are not one
            per model input (`(x_train, y_train)`), a dataset known to be infinite
            (`ds.repeat()`) without `steps`, or no
            batch in `x`; a
            BatchNormalization layer with `renorm=True` (its statistics are coupled to renorm's).
            If a batch fails in the model, every layer's statistics are restored before the error
            propagates: nothing is half-updated.
        RuntimeError: a BatchNormalization layer was called inside a `tf.function`, or its
            statistics changed without its `call` being run (a forward traced as a
            `tf.function` before recalibration); statistics are restored as above.
    """
    if not model.built:
        raise ValueError(f"recalibrate_batch_norm(): model {model.name!r} is not built.")
    if batch_size < 1 or (steps is not None and steps < 1):
        raise ValueError(f"batch_size and steps must be positive; got {batch_size}, {steps}.")
    _check_input_arrays(model, x)
    layers = _batch_norms(model)
    if renorm := [layer.name for layer in layers if layer.renorm]:
        raise ValueError(
            f"recalibrate_batch_norm(): layers {renorm} use renorm=True; not supported.")
    if not layers:
        warnings.warn(f"model {model.name!r} has no BatchNormalization layer: nothing to do.",
                      stacklevel=2)
        return []
    _check_dataset(model, x, steps)
    saved = [(layer.momentum, layer.trainable, layer.moving_mean.numpy(),
              layer.moving_variance.numpy()) for layer in layers]
    # Everything else a training-mode forward writes (SpectralNormalization's kernel and power
    # iteration vector, a stateful RNN's states, dropout seeds) is put back afterwards.
    statistics = {id(v) for layer in layers for v in (layer.moving_mean, layer.moving_variance)}
    others = [(v, v.numpy()) for v in _forward_state(model) if id(v) not in statistics]
    calls = [_AveragingCall(layer) for layer in layers]
    batches = 0
    try:
        for layer in layers:
            layer.trainable = True  # a frozen BatchNormalization runs in inference mode
        # Each instance's `call` only, for the batches below.
        with calls_replaced([(call.layer, call) for call in calls]):
            for step, batch in enumerate(_input_batches(x, batch_size)):
                if steps is not None and step >= steps:
                    break
                model(batch, training=True)
                batches += 1
        if not batches:
            raise ValueError("recalibrate_batch_norm(): `x` yielded no batch.")
        changed, untouched = _uncounted(calls, saved)
        if changed:
            raise RuntimeError(
                f"recalibrate_batch_norm(): the statistics of {changed} changed without a call "
                "of the layer: the model's forward is a tf.function traced before "
                "recalibration, which runs its old graph (old momentum). Recalibrate a model "
                "whose forward runs eagerly (its call not a tf.function).")
    except BaseException:
        for layer, (_, _, mean, variance) in zip(layers, saved):
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
        raise
    finally:
        for layer, (momentum, trainable, _, _) in zip(layers, saved):
            layer.momentum, layer.trainable = momentum, trainable
        for variable, value in others:
            variable.assign(value)
    if untouched:
        warnings.warn(f"recalibrate_batch_norm(): {untouched} were not called in training mode "
                      "by the model's forward (or only in a tf.function traced before): left as "
                      "they were.", stacklevel=2)
    return [call.layer.name for call in calls if call.seen]
