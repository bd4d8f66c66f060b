"""2:4 sparse training from scratch with SR-STE vs dense and vs the prune + fine-tune recipe.

Per task and seed, all with the example's optimizer (Adam), batch size and dense epoch budget E:
- dense: E epochs from random init;
- SR-STE 2:4: `prune(untrained, wrapper=SRSTE)`, E epochs (masks follow the weights every step,
  sparse-refined decay lambda_W = 2e-4, the paper's default);
- STE 2:4: the same with decay 0 (plain straight-through estimator, the paper's baseline);
- prune + fine-tune: the dense model pruned one-shot, fine-tuned F epochs at lr/10 (E + F epochs).
It prints test accuracy (mean ± std over seeds), seconds per epoch (median over the run's epochs)
relative to dense, and how many kept positions differ from the masks of the initial weights
(SR-STE's topology change, cf. the paper's Sparse Architecture Divergence).

    .venv/bin/python bench/srste.py                   # digits MLP + MNIST CNN, 3 seeds
    .venv/bin/python bench/srste.py --quick           # 1 seed, halved epochs
    .venv/bin/python bench/srste.py --step-cost       # interleaved ms/step: dense, Sparse24, SRSTE
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import keras
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import digits_mlp
import mnist_2to4

import tf_sparse24
from tf_sparse24 import SRSTE

TASKS = {
    "digits_mlp": {
        "load": digits_mlp.load_data,
        "build": digits_mlp.build_model,
        "epochs": digits_mlp.EPOCHS,
        "finetune": digits_mlp.FINETUNE_EPOCHS,
        "lr": digits_mlp.LR,
        "batch": digits_mlp.BATCH_SIZE,
    },
    "mnist_cnn": {
        "load": lambda seed: mnist_2to4.load_data(seed, None),
        "build": mnist_2to4.build_model,
        "epochs": 12,
        "finetune": 6,
        "lr": 1e-3,
        "batch": 64,
    },
}
METHODS = ["dense", "SR-STE 2:4", "STE 2:4", "prune+fine-tune"]


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def _compile(model, lr):
    model.compile(
        keras.optimizers.Adam(lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def _fit(model, data, spec, epochs, callbacks=()) -> float:
    """Trains; returns the median seconds per epoch (the first epoch, which traces, excluded)."""
    timer = EpochTimer()
    model.fit(
        data[0],
        data[2],
        batch_size=spec["batch"],
        epochs=epochs,
        verbose=0,
        callbacks=[timer, *callbacks],
    )
    return float(np.median(timer.seconds[1:] or timer.seconds))


def _accuracy(model, data) -> float:
    logits = model.predict(data[1], batch_size=512, verbose=0)
    return 100.0 * float(np.mean(np.argmax(logits, axis=1) == data[3]))


def _kept(model) -> np.ndarray:
    """The magnitude masks of the current weights of every pruned weight, flattened."""
    return np.concatenate(
        [
            np.asarray(tf_sparse24.compute_mask(pw.variable, pw.pattern, pw.axis)).ravel()
            for layer in tf_sparse24.pruned_layers(model)
            for pw in layer.pruned_weights
        ]
    )


def run(spec: dict, seed: int) -> dict:
    data = spec["load"](seed)
    out = {}
    keras.utils.set_random_seed(seed)
    dense = spec["build"]()
    init_weights = dense.get_weights()
    _compile(dense, spec["lr"])
    out["sec dense"] = _fit(dense, data, spec, spec["epochs"])
    out["dense"] = _accuracy(dense, data)
    for name, decay in (("SR-STE 2:4", 2e-4), ("STE 2:4", 0.0)):
        keras.utils.set_random_seed(seed)
        start = spec["build"]()
        start.set_weights(init_weights)  # the dense run's initialisation
        model = tf_sparse24.prune(start, wrapper=functools.partial(SRSTE, decay=decay))
        before = _kept(model)
        _compile(model, spec["lr"])
        out[f"sec {name}"] = _fit(
            model, data, spec, spec["epochs"], [tf_sparse24.Sparse24Callback()]
        )
        out[name] = _accuracy(model, data)
        out[f"moved {name}"] = 100.0 * float(np.mean(before != _kept(model)))
    keras.utils.set_random_seed(seed)
    pruned = tf_sparse24.prune(dense)
    _compile(pruned, spec["lr"] / 10)
    out["sec prune+fine-tune"] = _fit(
        pruned, data, spec, spec["finetune"], [tf_sparse24.Sparse24Callback()]
    )
    out["prune+fine-tune"] = _accuracy(pruned, data)
    return out


def step_cost(repeats: int = 15, jit: bool = False) -> None:
    """Training-step time of a 512-512-512-16 MLP (batch 64): dense vs fixed masks vs SR-STE.

    The three models alternate in every repeat, so machine load hits them alike; medians.
    """
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 512)).astype("float32"), rng.normal(size=(64, 16)).astype("float32")

    def mlp():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((512,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(16),
            ]
        )

    models = {
        "dense": mlp(),
        "Sparse24 (fixed masks)": tf_sparse24.prune(mlp()),
        "SRSTE": tf_sparse24.prune(mlp(), wrapper=SRSTE),
    }
    for model in models.values():
        model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=jit)
        model.train_on_batch(x, y)
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(10):
                model.train_on_batch(x, y)
            times[name].append((time.perf_counter() - start) / 10)
    dense = np.median(times["dense"])
    print(
        f"train step, MLP 512-512-512-16, batch 64, jit_compile={jit} (median of {repeats}x10 steps)"
    )
    for name, values in times.items():
        print(
            f"  {name:<24}{np.median(values) * 1e3:8.2f} ms   {np.median(values) / dense:.2f}x dense"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, halved epochs")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument(
        "--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)"
    )
    parser.add_argument("--step-cost", action="store_true", help="only the step-time comparison")
    args = parser.parse_args()
    if args.step_cost:
        step_cost(jit=False)
        step_cost(jit=True)
        return
    seeds = range(args.seeds or (1 if args.quick else 3))
    rows = {}
    for task in args.tasks.split(","):
        spec = dict(TASKS[task])
        if args.quick:
            spec["epochs"], spec["finetune"] = (
                max(2, spec["epochs"] // 2),
                max(2, spec["finetune"] // 2),
            )
        runs = []
        for seed in seeds:
            runs.append(run(spec, seed))
            print(
                f"[{task} seed {seed}] " + ", ".join(f"{k} {v:.3g}" for k, v in runs[-1].items()),
                flush=True,
            )
        rows[task] = (spec, runs)

    print(f"\nTest accuracy %, mean ± std over {len(seeds)} seed(s) (Adam; fine-tune at lr/10)")
    print(
        f"{'task':<12}{'epochs E(+F)':>13}"
        + "".join(f"{m:>17}" for m in METHODS)
        + f"{'SR-STE - dense':>16}"
    )
    for task, (spec, runs) in rows.items():
        cells = []
        for m in METHODS:
            v = np.array([r[m] for r in runs])
            cells.append(f"{v.mean():.2f} ± {v.std():.2f}")
        gap = np.mean([r["SR-STE 2:4"] - r["dense"] for r in runs])
        budget = f"{spec['epochs']}(+{spec['finetune']})"
        print(f"{task:<12}{budget:>13}" + "".join(f"{c:>17}" for c in cells) + f"{gap:>+16.2f}")
    print(
        "\nSeconds per epoch (median; ratio to dense) and kept positions moved from the initial masks"
    )
    for task, (spec, runs) in rows.items():
        dense_sec = np.median([r["sec dense"] for r in runs])
        parts = [f"dense {dense_sec:.3f}s"]
        for m in METHODS[1:]:
            sec = np.median([r[f"sec {m}"] for r in runs])
            parts.append(f"{m} {sec:.3f}s ({sec / dense_sec:.2f}x)")
        moved = "; ".join(
            f"{m} {np.mean([r[f'moved {m}'] for r in runs]):.1f}%" for m in METHODS[1:3]
        )
        print(f"{task:<12}" + ", ".join(parts) + f"; moved: {moved}")


if __name__ == "__main__":
    main()
