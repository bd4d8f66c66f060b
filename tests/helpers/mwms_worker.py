"""One worker of a 2-process MultiWorkerMirroredStrategy run on loopback (TF_CONFIG from the test).

Usage: TF_CONFIG=... python mwms_worker.py OUT.npz EPOCHS SEED

Keras 3.15's `Model.fit` cannot run under MultiWorkerMirroredStrategy (keras-team/keras#20585: its
symbolic build reduces the (x, y) batch structure across workers and fails), so this worker trains
with the custom-loop recipe TensorFlow documents for MWMS (`strategy.run` + a Keras optimizer) and
drives `Sparse24Callback` through a `keras.callbacks.CallbackList`, as `fit` would.
Each worker gets a different SEED: MWMS must still give every replica the same weights and masks.
"""

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.*
from helpers import scenario  # noqa: E402
import tf_sparse24

GLOBAL_BATCH = 16


def main(out: str, epochs: int, seed: int) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    x, y = scenario.data()
    with strategy.scope():
        model = tf_sparse24.prune(scenario.dense_model(seed=seed))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9))  # model.optimizer, as fit() has it
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    steps = len(x) // GLOBAL_BATCH

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(iterator):
        xb, yb = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    callbacks = keras.callbacks.CallbackList(
        [tf_sparse24.Sparse24Callback()], add_history=True, model=model, epochs=epochs, steps=steps
    )
    callbacks.on_train_begin()
    for epoch in range(epochs):
        callbacks.on_epoch_begin(epoch)
        iterator = iter(dist_dataset)
        total = 0.0
        for step in range(steps):
            callbacks.on_train_batch_begin(step)
            loss = float(train_step(iterator))
            total += loss
            callbacks.on_train_batch_end(step, {"loss": loss})
        callbacks.on_epoch_end(epoch, {"loss": total / steps})
    callbacks.on_train_end()

    np.savez(out, loss=np.array(model.history.history["loss"]), **scenario.flat_state(model))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
