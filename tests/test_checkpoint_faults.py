"""Checkpoints and faults: a fine-tuning process SIGKILLed mid-epoch resumes, losing nothing.

The worker (tests/helpers/train_worker.py) trains with BackupAndRestore, ModelCheckpoint, a
tf.train.CheckpointManager and Sparse24Callback at once. The restarted process builds its model
from a *different* seed, so prune() computes different masks there: the masks it trains with must
still be the checkpointed ones. The reference for "nothing lost" is an uninterrupted run of the same
recipe in this process.
"""

import json
import signal

import numpy as np
import pytest
import tensorflow as tf

import keras
import tf_sparse24  # noqa: F401  (registers Sparse24 for load_model)
from helpers import procs, scenario, train_worker

EPOCHS = 4
KILL_EPOCH, KILL_BATCH = 2, 2  # of 4 batches; epochs 0 and 1 are complete when the process dies


def assert_same_state(got: dict, want: dict, what: str, exact: bool = True) -> None:
    assert sorted(got) == sorted(want), f"{what}: pruned weights {sorted(got)} != {sorted(want)}"
    for key in want:
        np.testing.assert_array_equal(
            got[key]["mask"], want[key]["mask"], err_msg=f"{what}: {key} mask"
        )
        for field in ("variable", "effective"):
            if exact:
                np.testing.assert_array_equal(
                    got[key][field], want[key][field], err_msg=f"{what}: {key} {field}"
                )
            else:
                np.testing.assert_allclose(
                    got[key][field],
                    want[key][field],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"{what}: {key} {field}",
                )


def load_state(path) -> dict:
    with np.load(path) as z:
        return scenario.unflatten({k: z[k] for k in z.files if k != "first_epoch"})


def progress(run) -> list[dict]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_keeps_masks_and_epochs(tmp_path):
    run = tmp_path / "run"
    victim = procs.start(
        "train_worker.py", run, 0, EPOCHS, KILL_EPOCH, KILL_BATCH, log=tmp_path / "victim.log"
    )
    try:
        parked = procs.wait_for_file(run / "parked", victim, timeout=300)
    finally:
        procs.kill(victim, signal.SIGKILL)
    assert parked, (
        f"worker never reached the kill point:\n{(tmp_path / 'victim.log').read_text()[-3000:]}"
    )
    assert victim.returncode == -signal.SIGKILL
    assert [p["epoch"] for p in progress(run)] == [0, 1]
    last_done = load_state(run / "epoch_1.npz")
    for key, entry in last_done.items():
        assert scenario.is_nm(entry["effective"], int(entry["axis"])), key

    # What survived on disk holds exactly the last completed epoch.
    saved = keras.saving.load_model(run / "model_02.keras")
    assert_same_state(scenario.pruned_state(saved), last_done, "ModelCheckpoint model_02.keras")

    fresh = train_worker.build(init_seed=1)
    fresh_masks = scenario.pruned_state(fresh)
    assert any(
        not np.array_equal(fresh_masks[k]["mask"], last_done[k]["mask"]) for k in last_done
    ), "precondition: a model pruned from other weights must have other masks"
    fresh.optimizer.build(fresh.trainable_variables)
    latest = tf.train.latest_checkpoint(str(run / "ckpt"))
    assert latest.endswith("ckpt-2"), latest
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        latest
    ).assert_existing_objects_matched()
    assert_same_state(scenario.pruned_state(fresh), last_done, "CheckpointManager restore")
    assert int(fresh.optimizer.iterations.numpy()) == 2 * train_worker.SAMPLES // train_worker.BATCH

    # Restart from another seed: BackupAndRestore must bring back epoch 1's masks, not recompute.
    procs.run("train_worker.py", run, 1, EPOCHS, tmp=tmp_path, timeout=300).check()
    begins = sorted(run.glob("begin_*.npz"), key=lambda p: p.stat().st_mtime)
    assert len(begins) == 2, begins
    with np.load(begins[-1]) as z:
        assert int(z["first_epoch"]) == KILL_EPOCH, (
            "resumed run did not start at the interrupted epoch"
        )
    resumed = load_state(begins[-1])
    assert_same_state(resumed, last_done, "state the resumed run started from")
    recomputed = {
        k: scenario.magnitude_mask(v["variable"], int(v["axis"])) for k, v in resumed.items()
    }
    assert any(not np.array_equal(recomputed[k], resumed[k]["mask"]) for k in resumed), (
        "precondition: recomputing masks from the restored weights would change them"
    )
    assert [p["epoch"] for p in progress(run)] == list(range(EPOCHS))

    # Nothing lost: the resumed run ends where an uninterrupted run ends.
    reference = train_worker.train(tmp_path / "reference", 0, EPOCHS, checkpoints=False)
    final = load_state(run / f"epoch_{EPOCHS - 1}.npz")
    assert_same_state(
        final, scenario.pruned_state(reference), "resumed vs uninterrupted", exact=False
    )
    for key, entry in final.items():
        assert scenario.is_nm(entry["effective"], int(entry["axis"])), key
    ref_loss = [p["loss"] for p in progress(tmp_path / "reference")]
    np.testing.assert_allclose([p["loss"] for p in progress(run)], ref_loss, rtol=1e-5)


class Interrupt(keras.callbacks.Callback):
    """Raises at (epoch, batch), like a crash that the same process survives (Keras' own recipe)."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize(
    "schedule", [{"start_step": 6}, {"update_every": 5}], ids=["dense-warmup", "periodic-recompute"]
)
def test_resume_keeps_the_mask_schedule(tmp_path, schedule):
    """Masks computed on schedule before an interruption survive it; the schedule continues by step.

    Interrupted-then-resumed must end exactly like an uninterrupted run, with the resumed model
    built from other weights (so anything recomputed off schedule would show).
    """
    x, y = scenario.data(train_worker.SAMPLES)
    steps = train_worker.SAMPLES // train_worker.BATCH

    def fit(model, *callbacks):
        model.fit(
            x,
            y,
            batch_size=train_worker.BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[*callbacks, tf_sparse24.Sparse24Callback(**schedule)],
        )

    reference = train_worker.build(init_seed=0)
    fit(reference)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    first = train_worker.build(init_seed=0)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(first, backup, Interrupt(2, 1))
    assert int(first.optimizer.iterations.numpy()) == 2 * steps + 2
    resumed = train_worker.build(init_seed=1)
    fit(resumed, keras.callbacks.BackupAndRestore(str(tmp_path / "backup")))
    assert_same_state(
        scenario.pruned_state(resumed),
        scenario.pruned_state(reference),
        f"resumed vs uninterrupted with {schedule}",
        exact=False,
    )
    for key, entry in scenario.pruned_state(resumed).items():
        assert 0 < entry["mask"].mean() < 1, f"{key}: masks were never computed"
        assert scenario.is_nm(entry["effective"], int(entry["axis"])), key
