"""Tiny deterministic models, data and numpy references shared by the tests and their workers.

Everything is seeded so a worker process and the test process build the same thing. The 2:4 checks
here are written in numpy, independently of `tf_sparse24`, so they can catch its mistakes.
"""

from __future__ import annotations

import numpy as np

FEATURES, HIDDEN, OUTPUTS = 16, 16, 4


def data(
    samples: int = 64, seed: int = 1, zero_targets: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A regression problem: x [samples, 16], y [samples, 4] (all zeros if `zero_targets`)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, FEATURES).astype("float32")
    y = (
        np.zeros((samples, OUTPUTS), "float32")
        if zero_targets
        else (np.tanh(x @ rng.randn(FEATURES, OUTPUTS)).astype("float32"))
    )
    return x, y


def dense_model(seed: int = 0, dtype: str | None = None):
    """16 -> Dense(16, relu) -> Dense(4): both kernels prunable along axis 0."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden", dtype=dtype),
            keras.layers.Dense(OUTPUTS, name="out", dtype=dtype),
        ],
        name="tiny",
    )


def compile_for_fine_tuning(model) -> None:
    """The fine-tuning recipe's optimizer and loss: SGD(0.05, momentum 0.9), MSE."""
    import keras

    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")


def fine_tune(model, epochs: int) -> np.ndarray:
    """`fit` on `data()` in a fixed order (batch 16) with `Sparse24Callback`; the loss per epoch.

    One recipe for the single-device reference and the MirroredStrategy worker, so their weights
    can be compared value for value.
    """
    import tf_sparse24

    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[tf_sparse24.Sparse24Callback()],
    )
    return np.array(history.history["loss"])


def pruned_state(model) -> dict[str, dict[str, np.ndarray]]:
    """{"<inner layer>/<weight>": {"mask", "variable", "effective", "axis"}} per pruned weight."""
    import tf_sparse24

    state = {}
    for layer in tf_sparse24.pruned_layers(model):
        for pw in layer.pruned_weights:
            state[f"{layer.layer.name}/{pw.name}"] = {
                "mask": np.array(pw.mask.numpy()),
                "variable": np.array(pw.variable.numpy()),
                "effective": np.array(layer.effective_weight(pw)),
                "axis": np.array(pw.axis),
            }
    return state


def flat_state(model) -> dict[str, np.ndarray]:
    """`pruned_state` flattened to npz-friendly keys "<layer>/<weight>:<field>"."""
    return {f"{k}:{f}": v for k, d in pruned_state(model).items() for f, v in d.items()}


def unflatten(npz) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in npz.files if hasattr(npz, "files") else npz:
        name, field = key.rsplit(":", 1)
        out.setdefault(name, {})[field] = npz[key]
    return out


def groups(w: np.ndarray, axis: int, m: int = 4) -> np.ndarray:
    """The [G, M] view: groups of M consecutive elements along `axis`."""
    moved = np.moveaxis(np.asarray(w), axis, -1)
    assert moved.shape[-1] % m == 0, f"axis {axis} of {w.shape} not a multiple of {m}"
    return moved.reshape(-1, m)


def is_nm(w: np.ndarray, axis: int, n: int = 2, m: int = 4) -> bool:
    """Numpy reference: every group along `axis` has at most n non-zeros."""
    return bool(((groups(w, axis, m) != 0).sum(axis=1) <= n).all())


def magnitude_mask(w: np.ndarray, axis: int, n: int = 2, m: int = 4) -> np.ndarray:
    """Numpy float64 reference mask: keep the n largest |w| per group, lower index wins ties."""
    w = np.asarray(w)
    g = np.abs(groups(w.astype(np.float64), axis, m))
    order = np.argsort(-g, axis=1, kind="stable")  # stable: equal magnitudes keep index order
    keep = np.zeros_like(g, dtype=bool)
    np.put_along_axis(keep, order[:, :n], True, axis=1)
    moved_shape = np.moveaxis(w, axis, -1).shape
    return np.moveaxis(keep.reshape(moved_shape), -1, axis).astype(w.dtype)
