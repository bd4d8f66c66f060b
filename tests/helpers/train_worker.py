"""Masked fine-tuning with every checkpoint mechanism on; can park itself mid-epoch to be killed.

Usage: python train_worker.py WORKDIR INIT_SEED EPOCHS [KILL_EPOCH KILL_BATCH]

Builds the tiny model from INIT_SEED, prunes it (masks from those weights) and fine-tunes with
`BackupAndRestore` (WORKDIR/backup), `ModelCheckpoint` (WORKDIR/model_EE.keras), a
`tf.train.CheckpointManager` (WORKDIR/ckpt) and `Sparse24Callback`. After every epoch it writes
WORKDIR/epoch_E.npz (masks, variables, effective weights) and appends the epoch to
WORKDIR/progress.jsonl; when training (re)starts it writes WORKDIR/begin_<pid>.npz with the state
the run actually starts from (after any restore) and the first epoch it runs.
With KILL_EPOCH/KILL_BATCH it writes WORKDIR/parked after that batch and sleeps, so the test can
SIGKILL it mid-epoch at a known point. `train()` is also imported by the test for the reference run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.*
from helpers import scenario  # noqa: E402
import tf_sparse24

BATCH = 16
SAMPLES = 64


class Recorder(keras.callbacks.Callback):
    """Writes the start state, each finished epoch, and parks at the kill point."""

    def __init__(self, workdir: Path, kill_at: tuple[int, int] | None):
        super().__init__()
        self.workdir, self.kill_at = workdir, kill_at
        self.epoch = self.first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.first_epoch is None:  # after BackupAndRestore and Sparse24Callback began
            self.first_epoch = epoch
            np.savez(
                self.workdir / f"begin_{os.getpid()}.npz",
                first_epoch=np.array(epoch),
                **scenario.flat_state(self.model),
            )

    def on_train_batch_end(self, batch, logs=None):
        if self.kill_at == (self.epoch, batch):
            (self.workdir / "parked").write_text(f"{self.epoch}:{batch}")
            time.sleep(300)  # the test kills us here; the limit only bounds a forgotten worker

    def on_epoch_end(self, epoch, logs=None):
        np.savez(self.workdir / f"epoch_{epoch}.npz", **scenario.flat_state(self.model))
        with open(self.workdir / "progress.jsonl", "a") as f:
            f.write(
                json.dumps({"epoch": epoch, "loss": float(logs["loss"]), "pid": os.getpid()}) + "\n"
            )


class ManagedCheckpoint(keras.callbacks.Callback):
    """Saves model + optimizer through tf.train.CheckpointManager after every epoch."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def on_train_begin(self, logs=None):
        ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
        self.manager = tf.train.CheckpointManager(ckpt, str(self.directory), max_to_keep=2)

    def on_epoch_end(self, epoch, logs=None):
        self.manager.save(checkpoint_number=epoch + 1)


def build(init_seed: int):
    """The pruned, compiled model every run starts from (before any restore)."""
    model = tf_sparse24.prune(scenario.dense_model(seed=init_seed))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    return model


def train(
    workdir: Path,
    init_seed: int,
    epochs: int,
    kill_at: tuple[int, int] | None = None,
    checkpoints: bool = True,
):
    workdir.mkdir(parents=True, exist_ok=True)
    x, y = scenario.data(SAMPLES)
    model = build(init_seed)
    recorder = Recorder(workdir, kill_at)
    callbacks = []
    if checkpoints:
        callbacks += [
            keras.callbacks.BackupAndRestore(str(workdir / "backup")),
            keras.callbacks.ModelCheckpoint(str(workdir / "model_{epoch:02d}.keras")),
            ManagedCheckpoint(workdir / "ckpt"),
        ]
    callbacks += [tf_sparse24.Sparse24Callback(), recorder]
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


if __name__ == "__main__":
    kill = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else None
    train(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), kill)
