"""2:4 workflow on scikit-learn's digits with an MLP: dense, prune, fine-tune, with and without
channel permutation.

Data: `sklearn.datasets.load_digits()` (1,797 real 8x8 handwritten digits shipped inside the
scikit-learn wheel; no download), split 80/20 stratified by class, features scaled to [0, 1].

    python examples/digits_mlp.py            # ~1 minute on 2 cores
    python examples/digits_mlp.py --seed 1
"""

from __future__ import annotations

import argparse
import sys

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import tf_sparse24

# Training budget shared with bench/accuracy.py (dense epochs; 2:4 fine-tuning epochs).
EPOCHS, FINETUNE_EPOCHS, LR, BATCH_SIZE = 40, 20, 1e-3, 32


def load_data(seed: int):
    """`(x_train, x_test, y_train, y_test)`: 1,437 / 360 digits, 64 features in [0, 1]."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)


def build_model(k=keras) -> "keras.Model":
    """64 -> 256 -> 128 -> 10 MLP. `k` is the Keras module (tf_keras builds the same net for tfmot)."""
    return k.Sequential(
        [
            k.Input((64,)),
            k.layers.Dense(256, activation="relu", name="fc1"),
            k.layers.Dense(128, activation="relu", name="fc2"),
            k.layers.Dense(10, name="logits"),
        ],
        name="digits_mlp",
    )


def compile_model(model, lr: float = LR, k=keras) -> None:
    model.compile(k.optimizers.Adam(lr), k.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def accuracy(model, x, y) -> float:
    return 100.0 * float(np.mean(np.argmax(model.predict(x, batch_size=512, verbose=0), axis=1) == y))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed)

    dense = build_model()
    compile_model(dense)
    dense.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0)
    results = {"dense": accuracy(dense, x_test, y_test)}

    for name, start in (("2:4", dense), ("2:4 + permutation", None)):
        if start is None:
            start, reports = tf_sparse24.permute(dense, progress=False, print_fn=print)
        pruned = tf_sparse24.prune(start)
        results[f"{name}, one-shot"] = accuracy(pruned, x_test, y_test)
        compile_model(pruned, LR / 10)  # same optimizer at the tail of a decayed schedule's rate
        pruned.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=FINETUNE_EPOCHS, verbose=0,
                   callbacks=[tf_sparse24.Sparse24Callback()])
        results[f"{name}, fine-tuned"] = accuracy(pruned, x_test, y_test)

    print(f"digits MLP ({len(x_train)} train / {len(x_test)} test, seed {args.seed})")
    for key, value in results.items():
        print(f"  {key:<34}{value:>7.2f}%")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
