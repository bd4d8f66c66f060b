"""How much of a real architecture `tf_sparse24.permute` reaches, and that it keeps the function.

For each keras.applications model (random weights: nothing is downloaded; 32x32x3 inputs unless
--size says otherwise, 10 classes; every 1-D weight (biases, BatchNorm and LayerNorm parameters and
statistics, LayerScale) randomized so that a misaligned channel would show; float64 so that rounding
does not hide one): the channel spaces permuted and skipped (with the most common skip reasons), how
many of the model's Dense/Conv (groups=1)/SeparableConv layers read a permuted space (their input
channels reordered: what 2:4 groups), permute's wall time, and the largest |output difference|
between the model and its permuted copy.

    .venv/bin/python bench/permute_coverage.py                        # ResNet50 MobileNetV2 EfficientNetB0
    .venv/bin/python bench/permute_coverage.py Xception --size 71     # Xception needs >= 71x71
    .venv/bin/python bench/permute_coverage.py --as-base MobileNetV2  # nested, as in fine-tuning
"""

from __future__ import annotations

import argparse
import collections
import time

import keras
import numpy as np

CONSUMERS = ("Dense", "Conv1D", "Conv2D", "Conv3D", "SeparableConv1D", "SeparableConv2D")


def randomize_vectors(layers: list, rng: np.random.Generator) -> None:
    """Every 1-D weight random, so that one misaligned channel shows in the output: scales (gamma,
    moving variance) in [0.5, 1.5), the rest (biases, beta, moving mean, LayerScale) ~ N(0, 0.3).
    Not Normalization's input statistics (preprocessing state, cached when the layer is built),
    nor a nested model's weights as a whole (its layers are in `layers` themselves)."""
    for layer in layers:
        if isinstance(layer, (keras.Model, keras.layers.Normalization)):
            continue
        for w in layer.weights:
            if w.ndim == 1:
                name = w.path.rsplit("/", 1)[-1]
                scale = name in ("gamma", "moving_variance")
                w.assign(rng.uniform(0.5, 1.5, w.shape) if scale else rng.normal(0, 0.3, w.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["ResNet50", "MobileNetV2", "EfficientNetB0"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--as-base", action="store_true",
                        help="nest the model (include_top=False) in a transfer-learning model: "
                             "input -> base -> global average pooling -> Dense(10)")
    args = parser.parse_args()
    keras.config.set_floatx("float64")
    import tf_sparse24
    from tf_sparse24.prune import walk_layers

    print("| model | spaces permuted / skipped | Dense/Conv/SeparableConv layers read a permuted space | "
          "permute s | max abs output diff (output scale) |")
    print("| --- | --- | --- | --- | --- |")
    notes = []
    for name in args.models:
        keras.utils.set_random_seed(args.seed)
        rng = np.random.default_rng(args.seed)
        shape = (args.size, args.size, 3)
        if args.as_base:
            base = getattr(keras.applications, name)(
                weights=None, input_shape=shape, include_top=False)
            inputs = keras.Input(shape)
            pooled = keras.layers.GlobalAveragePooling2D()(base(inputs))
            model = keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled))
            name = f"{name} as a base model"
        else:
            model = getattr(keras.applications, name)(weights=None, input_shape=shape, classes=10)
        layers = walk_layers(model)  # nested models' layers too (ConvNeXt nests Sequentials)
        randomize_vectors(layers, rng)
        x = rng.normal(size=(2, args.size, args.size, 3))
        start = time.perf_counter()
        permuted, reports = tf_sparse24.permute(model, seed=args.seed, progress=False)
        seconds = time.perf_counter() - start
        kernels = sum(type(layer).__name__ in CONSUMERS and getattr(layer, "groups", 1) == 1
                      for layer in layers)  # permute leaves grouped convs alone
        done = [r for r in reports if r.permuted]
        before = np.asarray(model(x, training=False))
        diff = np.abs(np.asarray(permuted(x, training=False)) - before).max()
        print(f"| {name} | {len(done)} / {len(reports) - len(done)} | "
              f"{len({c for r in done for c in r.consumers})} of {kernels} | {seconds:.0f} | "
              f"{diff:.1e} ({np.abs(before).max():.1e}) |", flush=True)
        reasons = collections.Counter(r.reason for r in reports if not r.permuted)
        notes += [f"{name}: {n} x {reason}" for reason, n in reasons.most_common(3)]
    print("\nMost common skip reasons:\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
