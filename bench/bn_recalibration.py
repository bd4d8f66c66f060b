"""One-shot 2:4 accuracy of a BatchNorm network with and without `recalibrate_batch_norm`.

The small MNIST ResNet of bench/accuracy.py (task `mnist_resnet`, same data, epochs and seeds):
train dense; one-shot `prune` (no fine-tuning), then re-estimate the BatchNormalization
statistics on N training samples; the same after `permute`. Test accuracy in %, per seed and mean.

    .venv/bin/python bench/bn_recalibration.py                 # 3 seeds, 1024 samples
    .venv/bin/python bench/bn_recalibration.py --samples 256 --seeds 1
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import ROOT, task_spec, train_dense

sys.path.insert(0, os.path.join(ROOT, "examples"))
from workflow import accuracy  # examples/workflow.py

COLUMNS = ["dense", "one-shot", "one-shot + BN recal", "perm one-shot", "perm one-shot + BN recal"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024, help="training samples to recalibrate on")
    args = parser.parse_args()
    import keras

    import tf_sparse24

    spec = task_spec("mnist_resnet", quick=False)
    rows = []
    for seed in range(args.seeds):
        dense, (x_train, x_test, _, y_test), _ = train_dense(spec, seed, keras)
        row = {"dense": accuracy(dense, x_test, y_test)}
        permuted, _ = tf_sparse24.permute(dense, seed=seed, progress=False)
        for prefix, source in (("", dense), ("perm ", permuted)):
            pruned = tf_sparse24.prune(source)
            row[f"{prefix}one-shot"] = accuracy(pruned, x_test, y_test)
            tf_sparse24.recalibrate_batch_norm(pruned, x_train[: args.samples], batch_size=64)
            row[f"{prefix}one-shot + BN recal"] = accuracy(pruned, x_test, y_test)
        rows.append(row)
        print(f"[seed {seed}] " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(f"\nmnist_resnet, test accuracy %, mean ± std over {args.seeds} seed(s); "
          f"recalibrated on {args.samples} training samples")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    print("| " + " | ".join(f"{np.mean([r[c] for r in rows]):.2f} ± {np.std([r[c] for r in rows]):.2f}"
                            for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
