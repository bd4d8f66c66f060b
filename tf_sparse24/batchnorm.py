"""Re-estimating BatchNormalization statistics after one-shot pruning.

Zeroing half of every kernel moves the activations each BatchNormalization layer normalizes, so the
moving mean and variance it learned on the dense model no longer fit them: a one-shot 2:4 network
with batch norm can lose most of its accuracy before any fine-tuning (a small MNIST ResNet: 95% ->
29%, docs/ACCURACY.md). Running some training inputs through the pruned model in training mode
and averaging the batch statistics refits them without changing a weight (AdaBN, Li et al. 2016;
"batch norm re-estimation" in NNCF and AIMET). Fine-tuning refreshes them too; this is for a model
that is not fine-tuned, or before fine-tuning starts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf


def _batch_norms(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer in `model`, nested models and wrapped layers included."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)]


def _input_batches(x, batch_size: int) -> Iterable:
    """Model inputs batch by batch: slices of arrays (one, or a list/dict of them), or the inputs
    of each element of a tf.data.Dataset / iterable (`x` of `(x, y)` or `(x, y, sample_weight)`)."""
    if isinstance(x, (np.ndarray, tf.Tensor, list, dict)):
        rows = len(keras.tree.flatten(x)[0])
        for start in range(0, rows, batch_size):
            yield keras.tree.map_structure(lambda a, s=start: a[s:s + batch_size], x)
    else:
        for element in x:
            yield element[0] if isinstance(element, tuple) else element


def recalibrate_batch_norm(
    model: keras.Model, x, *, batch_size: int = 32, steps: int | None = None
) -> list[str]:
    """Re-estimates the moving mean and variance of every BatchNormalization layer of `model`.

    Runs `model(batch, training=True)` over the batches of `x` and sets each layer's moving
    statistics to the average of its batch statistics, weighted by batch size (its `momentum` is
    set per batch for that, then restored). Weights are not changed; layers with
    `trainable=False` are recalibrated too. Use training inputs, after `tf_sparse24.prune` or
    `strip` (in bench/bn_recalibration.py 1,024 samples did as well as 4,000). Under a
    `tf.distribute` strategy, pass arrays or a plain (not distributed) Dataset: batches run whole,
    in cross-replica context, and every replica gets the same statistics.

    Args:
        model: a built Keras model.
        x: model inputs: an array (or a list/dict of arrays for several inputs), or a
            tf.data.Dataset / iterable of batches whose elements are inputs or `(inputs, targets[,
            sample_weights])` tuples.
        batch_size: rows per batch when `x` is arrays.
        steps: use at most this many batches (None: all of `x`).

    Returns:
        The names of the layers recalibrated (empty if the model has no BatchNormalization).

    Raises:
        ValueError: for an unbuilt model, a bad `batch_size`/`steps`, or no batch in `x`; a
            BatchNormalization layer with `renorm=True` (its statistics are coupled to renorm's).
            If a batch fails in the model, every layer's statistics are restored before the error
            propagates: nothing is half-updated.
    """
    if not model.built:
        raise ValueError(f"recalibrate_batch_norm(): model {model.name!r} is not built.")
    if batch_size < 1 or (steps is not None and steps < 1):
        raise ValueError(f"batch_size and steps must be positive; got {batch_size}, {steps}.")
    layers = _batch_norms(model)
    if renorm := [layer.name for layer in layers if layer.renorm]:
        raise ValueError(f"recalibrate_batch_norm(): layers {renorm} use renorm=True; not supported.")
    if not layers:
        warnings.warn(f"model {model.name!r} has no BatchNormalization layer: nothing to do.",
                      stacklevel=2)
        return []
    saved = [(layer.momentum, layer.trainable, layer.moving_mean.numpy(),
              layer.moving_variance.numpy()) for layer in layers]
    seen = 0
    try:
        for layer in layers:
            layer.trainable = True  # a frozen BatchNormalization runs in inference mode
        for step, batch in enumerate(_input_batches(x, batch_size)):
            if steps is not None and step >= steps:
                break
            rows = int(keras.ops.shape(keras.tree.flatten(batch)[0])[0])
            for layer in layers:  # moving = (seen * moving + rows * batch) / (seen + rows)
                layer.momentum = seen / (seen + rows)
            model(batch, training=True)
            seen += rows
        if not seen:
            raise ValueError("recalibrate_batch_norm(): `x` yielded no batch.")
    except BaseException:
        for layer, (_, _, mean, variance) in zip(layers, saved):
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
        raise
    finally:
        for layer, (momentum, trainable, _, _) in zip(layers, saved):
            layer.momentum, layer.trainable = momentum, trainable
    return [layer.name for layer in layers]
