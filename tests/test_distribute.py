"""2:4 fine-tuning under tf.distribute: MirroredStrategy (2 logical CPUs) and 2-worker MWMS.

Both run in worker processes (tests/helpers/*_worker.py): logical devices must be set before
TensorFlow initialises, and MWMS needs one process per worker. The reference is a single-device run
of the same recipe in this process; masks are also checked against a numpy magnitude reference.
"""

import re

import numpy as np
import pytest

import tf_sparse24
from helpers import procs, scenario

EPOCHS = 2
PORT_CLASH = re.compile(r"(?i)address already in use|failed to add port|could not bind")


def single_device_reference(epochs: int) -> tuple[dict, np.ndarray]:
    """The same prune + fine-tune on this process's default (single) device."""
    dense = scenario.dense_model(seed=0)
    initial = {f"{layer.name}/kernel": layer.kernel.numpy() for layer in dense.layers}
    model = tf_sparse24.prune(dense)
    scenario.compile_for_fine_tuning(model)
    loss = scenario.fine_tune(model, epochs)
    state = scenario.pruned_state(model)
    for key, entry in state.items():
        entry["initial_magnitude_mask"] = scenario.magnitude_mask(initial[key], int(entry["axis"]))
    return state, loss


def assert_replica_matches(key: str, mask: np.ndarray, effective: np.ndarray, ref: dict) -> None:
    axis = int(ref["axis"])
    np.testing.assert_array_equal(
        mask, ref["mask"], err_msg=f"{key}: mask differs from single device"
    )
    np.testing.assert_array_equal(
        mask,
        ref["initial_magnitude_mask"],
        err_msg=f"{key}: mask is not the magnitude mask of the initial weights",
    )
    assert scenario.is_nm(effective, axis), f"{key}: effective weight is not 2:4 after training"
    assert not effective[mask == 0].any(), f"{key}: non-zero at a pruned position"
    np.testing.assert_allclose(
        effective,
        ref["effective"],
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"{key}: weights differ from the single-device run",
    )


@pytest.mark.slow
@pytest.mark.parametrize("where", ["prune_inside", "prune_outside"])
def test_mirrored_strategy_two_logical_cpus(tmp_path, where):
    """`prune_outside`: a model made in the scope and pruned outside it: the pruned copy (and its
    strip()) is made under the model's strategy, as Keras ties a model to the one it was made
    in (the copy had single-device variables: fit failed, or trained on one device)."""
    out = tmp_path / "mirrored.npz"
    procs.run("mirrored_worker.py", out, EPOCHS, where, tmp=tmp_path, timeout=300).check()
    got = np.load(out)
    assert got["strategy_kept"], f"{where}: the pruned model is not tied to the strategy"
    assert set(got["copies"]) == {2}, f"{where}: per-device copies of the weights {got['copies']}"
    assert set(got["strip_copies"]) == {2}, f"{where}: strip() copies {got['strip_copies']}"
    ref, ref_loss = single_device_reference(EPOCHS)
    assert ref, "prune() pruned nothing in the tiny model"
    for key, entry in ref.items():
        np.testing.assert_array_equal(
            got[f"{key}:mask0"],
            got[f"{key}:mask1"],
            err_msg=f"{key}: replicas hold different masks",
        )
        for replica in range(2):
            assert_replica_matches(
                key, got[f"{key}:mask{replica}"], got[f"{key}:effective{replica}"], entry
            )
    np.testing.assert_allclose(got["loss"], ref_loss, rtol=1e-5)


def run_mwms(tmp_path, epochs: int) -> list:
    """Runs the 2-worker cluster; retries once with new ports if one was taken meanwhile."""
    for attempt in range(2):
        ports = procs.free_ports(2)
        outs = [tmp_path / f"worker{i}.npz" for i in range(2)]
        logs = [tmp_path / f"worker{i}.{attempt}.log" for i in range(2)]
        workers = [
            procs.start(
                "mwms_worker.py",
                outs[i],
                epochs,
                i,
                log=logs[i],
                env=procs.worker_env(TF_CONFIG=procs.tf_config(ports, i)),
            )
            for i in range(2)  # worker i initialises from seed i: MWMS must sync them
        ]
        results = procs.wait_all(workers, logs, timeout=400)
        if attempt == 0 and any(PORT_CLASH.search(r.output) for r in results):
            continue  # a port picked as free was taken before the worker bound it
        for r in results:
            r.check()
        return [np.load(o) for o in outs]
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_multi_worker_mirrored_two_processes(tmp_path):
    workers = run_mwms(tmp_path, EPOCHS)
    ref, ref_loss = single_device_reference(EPOCHS)
    for key, entry in ref.items():
        masks = [w[f"{key}:mask"] for w in workers]
        np.testing.assert_array_equal(
            masks[0], masks[1], err_msg=f"{key}: workers hold different masks"
        )
        for w in workers:
            assert_replica_matches(key, w[f"{key}:mask"], w[f"{key}:effective"], entry)
            np.testing.assert_array_equal(w[f"{key}:effective"], workers[0][f"{key}:effective"])
    for w in workers:
        np.testing.assert_allclose(w["loss"], ref_loss, rtol=1e-5)
