"""The 2:4 recipe the examples share: train dense, prune (plain and after channel permutation),
fine-tune with `Sparse24Callback`, and report test accuracy at each stage.

Fine-tuning uses the dense optimizer at a tenth of its rate: the tail of a decayed schedule.
Keras and tf_sparse24 are imported where they are used, so bench/accuracy.py's tfmot process
(tf_keras) can use `compile_model` and `accuracy` without loading Keras 3.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def compile_model(model, lr: float, k=None) -> None:
    """Adam + sparse categorical cross-entropy on logits. `k`: keras (default), or tf_keras."""
    if k is None:
        import keras as k
    model.compile(k.optimizers.Adam(lr), k.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def accuracy(model, x, y, batch_size: int = 512) -> float:
    """Test accuracy in percent. Calls the model eagerly, batch by batch: `predict()` traces a
    function for each model, and for its last, shorter batch, which after a few models makes
    TensorFlow print retracing warnings that mean nothing here."""
    logits = [np.asarray(model(x[i:i + batch_size], training=False))
              for i in range(0, len(x), batch_size)]
    return 100.0 * float(np.mean(np.argmax(np.concatenate(logits), axis=1) == y))


def run(title: str, data, build_model: Callable, *, epochs: int, finetune_epochs: int, lr: float,
        batch_size: int) -> dict:
    """Runs the recipe on `data = (x_train, x_test, y_train, y_test)`; prints and returns accuracies."""
    import tf_sparse24

    x_train, x_test, y_train, y_test = data
    dense = build_model()
    compile_model(dense, lr)
    dense.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0)
    results = {"dense": accuracy(dense, x_test, y_test)}

    for name, start in (("2:4", dense), ("2:4 + permutation", None)):
        if start is None:
            start, _ = tf_sparse24.permute(dense, progress=False, print_fn=print)
        pruned = tf_sparse24.prune(start)
        results[f"{name}, one-shot"] = accuracy(pruned, x_test, y_test)
        compile_model(pruned, lr / 10)
        pruned.fit(x_train, y_train, batch_size=batch_size, epochs=finetune_epochs, verbose=0,
                   callbacks=[tf_sparse24.Sparse24Callback()])
        results[f"{name}, fine-tuned"] = accuracy(pruned, x_test, y_test)

    print(f"{title} ({len(x_train)} train / {len(x_test)} test)")
    for key, value in results.items():
        print(f"  {key:<34}{value:>7.2f}%")
    return results
