"""Cost of 2:4 masked fine-tuning vs dense training, and N:M mask computation throughput.

Side by side in one process: each model is trained dense and as `tf_sparse24.prune(model)` (with
and without `Sparse24Callback`), runs interleaved, median over repeats. Goal: masked/dense <= 1.10.

    .venv/bin/python bench/train_overhead.py [--repeats 5] [--steps 20] [--mask-elements 100e6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import tf_sparse24
from tf_sparse24.masks import compute_mask


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(16),
        ]
    )


def cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(16),
        ]
    )


def lstm() -> keras.Model:
    return keras.Sequential(
        [keras.Input((20, 64)), keras.layers.LSTM(128), keras.layers.Dense(16)]
    )


MODELS = {  # name -> (factory, input shape, batch size)
    "mlp 784-1024-1024": (mlp, (784,), 256),
    "cnn (mnist example)": (cnn, (28, 28, 1), 64),
    "lstm 64->128": (lstm, (20, 64), 64),
}


def _compile(model: keras.Model) -> keras.Model:
    model.compile(
        keras.optimizers.Adam(1e-4),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def step_time(model: keras.Model, x, y, batch: int, callbacks) -> tuple[float, float]:
    """(wall, CPU) seconds per training step over one epoch of `len(x) // batch` steps.

    CPU time (all threads of this process) is much less sensitive than wall time to other jobs
    sharing the machine.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
    )
    steps = len(x) // batch
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def bench_training(repeats: int, steps: int) -> None:
    print(
        f"Training step time (median of {repeats} interleaved runs of {steps} steps, Adam), ms;"
    )
    print(
        "ratio = masked / dense, from wall time and from process CPU time (robust to machine load)"
    )
    print(
        f"{'model':<22}{'dense':>8}{'masked':>8}{'+cb':>8}{'wall ratio':>12}{'+cb':>7}"
        f"{'CPU ratio':>11}{'+cb':>7}"
    )
    rng = np.random.default_rng(0)
    for name, (factory, shape, batch) in MODELS.items():
        keras.utils.set_random_seed(0)
        dense = _compile(factory())
        x = rng.normal(size=(steps * batch, *shape)).astype("float32")
        y = rng.integers(0, 16, size=steps * batch).astype("int32")
        masked = _compile(tf_sparse24.prune(dense))
        with_cb = _compile(tf_sparse24.prune(dense))
        runs = {"dense": [], "masked": [], "cb": []}
        variants = [
            ("dense", dense, []),
            ("masked", masked, []),
            ("cb", with_cb, [tf_sparse24.Sparse24Callback()]),
        ]
        for key, model, cbs in variants:  # warm-up: trace and compile
            step_time(model, x[: 2 * batch], y[: 2 * batch], batch, cbs)
        for _ in range(repeats):
            for key, model, cbs in variants:
                runs[key].append(step_time(model, x, y, batch, cbs))
        d, m, c = (
            statistics.median(r[0] for r in runs[k]) * 1e3
            for k in ("dense", "masked", "cb")
        )
        dc, mc, cc = (
            statistics.median(r[1] for r in runs[k]) for k in ("dense", "masked", "cb")
        )
        print(
            f"{name:<22}{d:>8.1f}{m:>8.1f}{c:>8.1f}{m / d:>12.2f}{c / d:>7.2f}"
            f"{mc / dc:>11.2f}{cc / dc:>7.2f}"
        )


def bench_masks(elements: float, repeats: int) -> None:
    shapes = [(4096, 4096), (3, 3, 512, 512), (1024, 4096), (4096, 1024)]
    kernels, total = [], 0
    while total < elements:
        shape = shapes[len(kernels) % len(shapes)]
        kernels.append(tf.random.stateless_normal(shape, seed=[len(kernels), 0]))
        total += int(np.prod(shape))
    axes = [len(k.shape) - 2 for k in kernels]
    compute_mask(kernels[0], axis=axes[0]).numpy()  # trace once
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        masks = [compute_mask(k, "2:4", axis=a) for k, a in zip(kernels, axes)]
        _ = [m.numpy() for m in masks]
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    t, c = statistics.median(times), statistics.median(cpu_times)
    print(
        f"\n2:4 mask computation: {len(kernels)} kernels, {total / 1e6:.1f}M elements (fp32), "
        f"{repeats} runs"
    )
    print(
        f"wall: median {t:.2f} s (min {min(times):.2f} s) = {total / t / 1e6:.0f}M elements/s; "
        f"CPU: median {c:.2f} s over all threads"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mask-elements", type=float, default=100e6, help="0 skips the mask bench")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_training:
        bench_training(args.repeats, args.steps)
    if args.mask_elements > 0:
        bench_masks(args.mask_elements, max(3, args.repeats))


if __name__ == "__main__":
    main()
