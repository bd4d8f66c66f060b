"""What channel permutation does to one-shot 2:4 accuracy, space kind by space kind.

Per seed: trains a task's dense model (bench/accuracy.py's tasks and budgets), then prunes it 2:4
without retraining three ways, side by side on the same dense weights: as it is, after `permute`
restricted to the consumers named by --only (e.g. the spaces permute reached before it followed a
transformer's residual stream), and after a full `permute`. Prints test accuracy and the fraction
of |w| the 2:4 masks keep over all pruned layers, per seed and as mean ± std.

    .venv/bin/python bench/permute_oneshot.py --task text_transformer --only ffn2 --seeds 10
"""

from __future__ import annotations

import argparse

import numpy as np
from accuracy import task_spec, train_dense  # bench/accuracy.py (it puts examples/ on the path)
from workflow import accuracy  # examples/workflow.py


def kept_fraction(pruned) -> float:
    """|w| kept by the masks over |w| of the dense kernels, summed over all pruned layers."""
    import tf_sparse24

    kept = total = 0.0
    for wrapper in tf_sparse24.pruned_layers(pruned):
        for pw in wrapper.pruned_weights:
            w = np.abs(np.asarray(pw.variable, dtype=np.float64))
            kept += float((w * np.asarray(pw.mask)).sum())
            total += float(w.sum())
    return kept / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="text_transformer")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated consumer names for the "
                        "restricted permute (empty: leave that column out)")
    args = parser.parse_args()
    import keras

    import tf_sparse24

    spec = task_spec(args.task, quick=False)
    only = [name for name in args.only.split(",") if name]
    methods = ["no permute", *([f"permute only {args.only}"] if only else []), "permute"]
    results = {m: [] for m in methods}
    for seed in range(args.seeds):
        dense, (_, x_test, _, y_test), _ = train_dense(spec, seed, keras)
        row = [f"seed {seed}: dense {accuracy(dense, x_test, y_test):.2f}"]
        for method in methods:
            source = dense
            if method != "no permute":
                source, _ = tf_sparse24.permute(dense, layers=only if "only" in method else None,
                                                seed=seed, progress=False)
            pruned = tf_sparse24.prune(source)
            acc, kept = accuracy(pruned, x_test, y_test), 100 * kept_fraction(pruned)
            results[method].append((acc, kept))
            row.append(f"{method} {acc:.2f} (kept {kept:.3f}%)")
        print(", ".join(row), flush=True)
    print(f"\n{args.task}, one-shot 2:4, {args.seeds} seeds (mean ± std)")
    print("| method | test accuracy % | |w| kept by the masks % |")
    print("| --- | --- | --- |")
    for method, values in results.items():
        acc, kept = np.array(values).T
        print(f"| {method} | {acc.mean():.2f} ± {acc.std():.2f} | "
              f"{kept.mean():.3f} ± {kept.std():.3f} |")


if __name__ == "__main__":
    main()
