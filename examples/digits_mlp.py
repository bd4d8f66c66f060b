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
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import workflow  # examples/workflow.py: the shared dense -> prune -> fine-tune recipe

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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    return workflow.run(f"digits MLP, seed {args.seed}", load_data(args.seed), build_model,
                        epochs=EPOCHS, finetune_epochs=FINETUNE_EPOCHS, lr=LR,
                        batch_size=BATCH_SIZE)


if __name__ == "__main__":
    main(sys.argv[1:])
