"""Recalibrates BatchNormalization statistics of a model built under MirroredStrategy (2 logical
CPUs), with plain and with synchronized BatchNormalization layers.

Usage: python bn_mirrored_worker.py OUT.npz

Runs in its own process because logical devices must be configured before TensorFlow initialises.
Saves the inputs and each replica's own copy of every moving statistic; tests/test_batchnorm.py
checks them against its float64 reference.
"""

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_batchnorm
from test_batchnorm import _model  # noqa: E402

import tf_sparse24  # noqa: E402


def main(out: str) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    x = np.random.default_rng(3).normal(size=(96, 6, 6, 4)).astype("float32")
    arrays = {"x": x}
    for synchronized in (False, True):
        with strategy.scope():
            model = _model(synchronized)
            tf_sparse24.recalibrate_batch_norm(model, x, batch_size=32)
        for name in ("bn1", "bn2"):
            layer = model.get_layer(name)
            for what, variable in (("mean", layer.moving_mean), ("variance", layer.moving_variance)):
                copies = strategy.experimental_local_results(variable.value)
                assert len(copies) == 2, f"{name}: {len(copies)} replica copies"
                for replica, value in enumerate(copies):
                    arrays[f"{synchronized}/{name}/{what}/{replica}"] = np.asarray(value)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
