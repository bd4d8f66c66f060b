"""Prunes and fine-tunes the tiny model under MirroredStrategy on 2 logical CPU devices.

Usage: python mirrored_worker.py OUT.npz EPOCHS

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


def main(out: str, epochs: int) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    with strategy.scope():
        model = tf_sparse24.prune(scenario.dense_model(seed=0))
        scenario.compile_for_fine_tuning(model)
    arrays = {"loss": scenario.fine_tune(model, epochs)}
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
    main(sys.argv[1], int(sys.argv[2]))
