"""Prunes and fine-tunes the tiny model under MirroredStrategy on 2 logical CPU devices.

Usage: python mirrored_worker.py OUT.npz EPOCHS [prune_outside]

`prune_outside`: the dense model is made in `strategy.scope()`, but pruned (and, at the end,
stripped) outside it; only `compile` is in the scope, as Keras wants for any model made in it.

Runs in its own process because logical devices must be configured before TensorFlow initialises,
which the test process has long done. Saves every replica's own copy of each mask and effective
weight (read inside `strategy.run`, i.e. from that replica's variable) plus the loss history.
"""

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.*
from helpers import scenario  # noqa: E402
import tf_sparse24  # noqa: E402


def read_per_replica(strategy, layer, pw):
    """(mask, effective weight) as each replica sees its own variables, inside `strategy.run`."""

    @tf.function
    def read():
        return strategy.run(lambda: (tf.identity(pw.mask.value), layer.effective_weight(pw)))

    return read()


def copies(variable) -> int:
    """How many per-device copies `variable` has (1: not distributed)."""
    return len(tf.distribute.get_strategy().experimental_local_results(variable.value))


def main(out: str, epochs: int, where: str = "prune_inside") -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    with strategy.scope():
        model = scenario.dense_model(seed=0)
        if where == "prune_inside":
            model = tf_sparse24.prune(model)
    if where == "prune_outside":
        model = tf_sparse24.prune(model)
    with strategy.scope():
        scenario.compile_for_fine_tuning(model)
        arrays = {"strategy_kept": np.array(model.distribute_strategy is strategy)}
        arrays["copies"] = np.array([copies(v) for v in model.weights])
    arrays["loss"] = scenario.fine_tune(model, epochs)
    stripped = tf_sparse24.strip(model)
    with strategy.scope():
        arrays["strip_copies"] = np.array([copies(v) for v in stripped.weights])
    for layer in tf_sparse24.pruned_layers(model):
        for pw in layer.pruned_weights:
            key = f"{layer.layer.name}/{pw.name}"
            per_replica = read_per_replica(strategy, layer, pw)
            masks, effective = (strategy.experimental_local_results(t) for t in per_replica)
            assert len(masks) == 2, f"{key}: {len(masks)} replica copies"
            for r in range(2):
                arrays[f"{key}:mask{r}"] = masks[r].numpy()
                arrays[f"{key}:effective{r}"] = np.asarray(effective[r])
            arrays[f"{key}:axis"] = np.array(pw.axis)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
