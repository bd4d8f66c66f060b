"""Long-run check: 20 epochs of 2:4 fine-tuning on the MNIST example, invariant and memory watched.

Trains the example CNN (examples/mnist_2to4.py: same data, model and seeds) dense for a few epochs,
prunes it, then fine-tunes for `--epochs` epochs. After every epoch it checks, in numpy and
independently of tf_sparse24, that every effective weight is exactly 2:4 and every mask equals the
one prune() computed, and records the process RSS and the number of live Python objects. The table
ends with the RSS and object-count drift from the end of the first fine-tuning epoch (after
warm-up: tracing, allocator pools) to the last one.

    python bench/long_run.py                 # 20 epochs, ~3-5 minutes on 2 loaded cores
    python bench/long_run.py --epochs 5      # quicker look
    python bench/long_run.py --dense         # the same epochs without pruning: TF/Keras' own drift

Exit status 1 if the invariant ever breaks.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

import keras
import numpy as np

import tf_sparse24

ROOT = Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("mnist_2to4", ROOT / "examples" / "mnist_2to4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def is_2to4(w: np.ndarray, axis: int) -> bool:
    groups = np.moveaxis(w, axis, -1).reshape(-1, 4)
    return bool(((groups != 0).sum(axis=1) <= 2).all())


class Watch(keras.callbacks.Callback):
    """Checks the invariant and samples memory after every epoch."""

    def __init__(self, x_val, y_val):
        super().__init__()
        self.x_val, self.y_val = x_val, y_val
        self.rows, self.broken = [], False

    def on_train_begin(self, logs=None):
        self.masks = {  # empty for the --dense baseline
            f"{w.name}/{pw.name}": np.array(pw.mask.numpy())
            for w in tf_sparse24.pruned_layers(self.model)
            for pw in w.pruned_weights
        }
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        ok = same = True
        for wrapper in tf_sparse24.pruned_layers(self.model):
            for pw in wrapper.pruned_weights:
                ok &= is_2to4(np.asarray(wrapper.effective_weight(pw)), pw.axis)
                same &= np.array_equal(pw.mask.numpy(), self.masks[f"{wrapper.name}/{pw.name}"])
        self.broken |= not (ok and same)
        gc.collect()
        self.rows.append(
            (
                epoch + 1,
                logs["loss"],
                logs.get("val_accuracy", float("nan")),
                ok,
                same,
                rss_mb(),
                len(gc.get_objects()),
                time.perf_counter() - self.t0,
            )
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="fine-tuning epochs")
    parser.add_argument("--dense-epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dense",
        action="store_true",
        help="baseline: continue training the dense model instead (same epochs)",
    )
    args = parser.parse_args(argv)

    example = load_example()
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = example.load_data(args.seed, None)
    dense = example.build_model()
    example.compile_model(dense, 1e-3)  # the example's loss (from logits), optimizer and metrics
    dense.fit(x_train, y_train, batch_size=64, epochs=args.dense_epochs, verbose=0)
    dense_acc = dense.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    rss_before = rss_mb()

    model = dense if args.dense else tf_sparse24.prune(dense)
    example.compile_model(model, 1e-3)
    start_acc = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    watch = Watch(x_test, y_test)
    callbacks = [watch] if args.dense else [tf_sparse24.Sparse24Callback(), watch]
    model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=args.epochs,
        verbose=0,
        validation_data=(x_test, y_test),
        callbacks=callbacks,
    )

    what = "DENSE BASELINE (no pruning)" if args.dense else "2:4"
    print(
        f"MNIST {what} long run: {len(x_train)} train / {len(x_test)} test digits, "
        f"{args.dense_epochs} dense + {args.epochs} more epochs; RSS before {rss_before:.0f} MiB; "
        f"test accuracy after dense training {dense_acc:.4f}, at the start of these epochs "
        f"{start_acc:.4f}"
    )
    print(
        f"{'epoch':>5} {'loss':>8} {'val_acc':>8} {'2:4 ok':>6} {'masks':>6} {'RSS MiB':>8} "
        f"{'py objects':>10} {'elapsed s':>9}"
    )
    for epoch, loss, acc, ok, same, rss, objs, t in watch.rows:
        ok, same = ("-", "-") if args.dense else (str(ok), "same" if same else "MOVED")
        print(
            f"{epoch:>5} {loss:>8.4f} {acc:>8.4f} {ok:>6} {same:>6} "
            f"{rss:>8.1f} {objs:>10} {t:>9.1f}"
        )
    first, last = watch.rows[0], watch.rows[-1]
    half = watch.rows[len(watch.rows) // 2 :]
    slope = np.polyfit([r[0] for r in half], [r[5] for r in half], 1)[0] if len(half) > 1 else 0.0
    print(
        f"drift epoch {first[0]} -> {last[0]}: RSS {last[5] - first[5]:+.1f} MiB, "
        f"least-squares RSS slope over epochs {half[0][0]}-{last[0]}: {slope:+.2f} MiB/epoch, "
        f"Python objects {last[6] - first[6]:+d}"
    )
    if not args.dense:
        print(
            "invariant:",
            "BROKEN" if watch.broken else "exact 2:4 and unchanged masks after every epoch",
        )
    return 1 if watch.broken else 0


if __name__ == "__main__":
    sys.exit(main())
