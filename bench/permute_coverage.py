"""How much of a real architecture `tf_sparse24.permute` reaches, and that it keeps the function.

For each keras.applications model, or one of the transformers built here (`ViT`: patch conv,
learned positions, pre-LayerNorm blocks of MultiHeadAttention and a GELU MLP, 4 blocks of width 64;
`TextTransformer`: examples/text_transformer.py's model; `Llama`: RMSNorm, grouped-query causal
attention and SwiGLU blocks; `KerasExample`: keras.io's text-classification transformer, whose
embedding and block are custom layers) (random weights: nothing is downloaded;
32x32x3 inputs unless --size says otherwise, 10 classes; every 1-D weight (biases, BatchNorm and
LayerNorm parameters and statistics, LayerScale) randomized so that a misaligned channel would show;
float64 so that rounding does not hide one): the channel spaces permuted and skipped (with the most
common skip reasons), how many of the model's Dense, Conv (groups=1), SeparableConv, EinsumDense,
attention and recurrent (GRU, LSTM, SimpleRNN, Bidirectional) layers read a permuted space (their
input channels reordered: what 2:4 groups; for attention, the query, key and value projections;
for a Bidirectional, both directions' cell kernels), how many attention layers had their value
heads reordered, permute's wall time, and the largest |output difference| between the model and
its permuted copy.

    .venv/bin/python bench/permute_coverage.py                        # ResNet50 MobileNetV2 EfficientNetB0
    .venv/bin/python bench/permute_coverage.py Xception --size 71     # Xception needs >= 71x71
    .venv/bin/python bench/permute_coverage.py --as-base MobileNetV2  # nested, as in fine-tuning
    .venv/bin/python bench/permute_coverage.py ViT TextTransformer Llama KerasExample
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import keras
import numpy as np

ATTENTION = ("MultiHeadAttention", "GroupedQueryAttention")
RECURRENT = ("GRU", "LSTM", "SimpleRNN", "Bidirectional")
CONSUMERS = ("Dense", "Conv1D", "Conv2D", "Conv3D", "SeparableConv1D", "SeparableConv2D",
             "EinsumDense", *ATTENTION, *RECURRENT)


@keras.saving.register_keras_serializable(package="permute_coverage")
class PositionTable(keras.layers.Layer):
    """x + a learned [tokens, C] table (the ViT example's position embedding, added in)."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + self.table


def vit(size: int, depth: int = 4, dim: int = 64, heads: int = 4) -> keras.Model:
    """A small pre-LayerNorm ViT from keras layers: 4x4 patches, learned positions, `depth`
    blocks of self-attention and a GELU MLP, mean pooling, 10 classes."""
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    patches = layers.Reshape((-1, dim))(layers.Conv2D(dim, 4, strides=4, name="patches")(inputs))
    x = PositionTable(name="positions")(patches)
    for i in range(depth):
        y = layers.LayerNormalization(epsilon=1e-6)(x)
        x = layers.Add()([x, layers.MultiHeadAttention(heads, dim // heads, name=f"attn{i}")(y, y)])
        y = layers.Dense(2 * dim, activation="gelu", name=f"mlp{i}_in")(
            layers.LayerNormalization(epsilon=1e-6)(x))
        x = layers.Add()([x, layers.Dense(dim, name=f"mlp{i}_out")(y)])
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-6)(x))
    return keras.Model(inputs, layers.Dense(10, name="head")(x), name="vit")


def llama(depth: int = 2, dim: int = 64, vocab: int = 1000, tokens: int = 16) -> keras.Model:
    """A small Llama-style decoder from keras layers: token embedding, `depth` pre-RMSNorm blocks
    of grouped-query self-attention (8 query heads, 2 key/value heads, causal) and a SwiGLU MLP
    (`silu(gate(x)) * up(x)` -> down), a final RMSNorm and a vocabulary head (no rotary position
    embedding: Keras has no layer for it)."""
    layers = keras.layers
    ids = keras.Input((tokens,), dtype="int32")
    x = layers.Embedding(vocab, dim, name="embed")(ids)
    for i in range(depth):
        y = layers.RMSNormalization(name=f"attn_norm{i}")(x)
        y = layers.GroupQueryAttention(dim // 8, 8, 2, use_bias=False, name=f"attn{i}")(
            y, y, use_causal_mask=True)
        x = layers.Add()([x, y])
        y = layers.RMSNormalization(name=f"mlp_norm{i}")(x)
        gate = layers.Dense(3 * dim, use_bias=False, name=f"gate{i}")(y)
        up = layers.Dense(3 * dim, use_bias=False, name=f"up{i}")(y)
        y = layers.Dense(dim, use_bias=False, name=f"down{i}")(keras.ops.silu(gate) * up)
        x = layers.Add()([x, y])
    x = layers.RMSNormalization(name="final_norm")(x)
    return keras.Model(ids, layers.Dense(vocab, use_bias=False, name="lm_head")(x), name="llama")


def keras_example(maxlen: int = 200, vocab: int = 2000) -> keras.Model:
    """keras.io's text-classification transformer at its sizes (embed 32, 2 heads, FFN 32;
    vocabulary 2000 instead of 20000 to keep it quick), from examples/text_transformer.py's
    custom layers: permute() has to follow their calls."""
    example = _text_transformer_example()
    layers = keras.layers
    ids = keras.Input((maxlen,), dtype="int32")
    x = example.TransformerBlock(32, 2, 32, name="block")(
        example.TokenAndPositionEmbedding(maxlen, vocab, 32, name="embed")(ids))
    x = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(x))
    x = layers.Dropout(0.1)(layers.Dense(20, activation="relu")(x))
    return keras.Model(ids, layers.Dense(2, activation="softmax")(x), name="keras_example")


def _text_transformer_example():
    """examples/text_transformer.py as a module."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import text_transformer as example

    return example


def text_transformer() -> keras.Model:
    """examples/text_transformer.py's model: Embedding, self-attention, FFN, mean, logits."""
    return _text_transformer_example().build_model(keras)


def build(name: str, size: int, as_base: bool, rng: np.random.Generator) -> tuple:
    """`(model, input batch, row name)` for a keras.applications model name or one built here."""
    shape = (size, size, 3)
    images = rng.normal(size=(2, *shape))
    if name == "ViT":
        return vit(size), images, name
    if name in ("TextTransformer", "Llama", "KerasExample"):
        model = {"TextTransformer": text_transformer, "Llama": llama,
                 "KerasExample": keras_example}[name]()
        embed = model.get_layer("embed")
        vocab = getattr(embed, "input_dim", None) or embed.token_emb.input_dim
        return model, rng.integers(0, vocab, (2, model.input.shape[1])), name
    if as_base:
        base = getattr(keras.applications, name)(weights=None, input_shape=shape, include_top=False)
        inputs = keras.Input(shape)
        pooled = keras.layers.GlobalAveragePooling2D()(base(inputs))
        model = keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled))
        return model, images, f"{name} as a base model"
    model = getattr(keras.applications, name)(weights=None, input_shape=shape, classes=10)
    return model, images, name


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
    from tf_sparse24.wrapper import walk_layers

    print("| model | spaces permuted / skipped | layers read a permuted space | attention heads "
          "permuted | permute s | max abs output diff (output scale) |")
    print("| --- | --- | --- | --- | --- | --- |")
    notes = []
    for name in args.models:
        keras.utils.set_random_seed(args.seed)
        rng = np.random.default_rng(args.seed)
        model, x, name = build(name, args.size, args.as_base, rng)
        layers = walk_layers(model)  # nested models' layers too (ConvNeXt nests Sequentials)
        randomize_vectors(layers, rng)
        start = time.perf_counter()
        permuted, reports = tf_sparse24.permute(model, seed=args.seed, progress=False)
        seconds = time.perf_counter() - start
        attention = [layer for layer in layers if type(layer).__name__ in ATTENTION]
        # counted as their attention layer / Bidirectional: its projections / directions
        holders = [layer for layer in layers
                   if type(layer).__name__ in (*ATTENTION, "Bidirectional")]
        projections = {id(sub) for layer in holders for sub in walk_layers(layer)}
        kernels = sum(type(layer).__name__ in CONSUMERS and getattr(layer, "groups", 1) == 1
                      and id(layer) not in projections
                      for layer in layers)  # permute leaves grouped convs alone
        done = [r for r in reports if r.permuted]
        before = np.asarray(model(x, training=False))
        diff = np.abs(np.asarray(permuted(x, training=False)) - before).max()
        print(f"| {name} | {len(done)} / {len(reports) - len(done)} | "
              f"{len({c for r in done if not r.heads for c in r.consumers})} of {kernels} | "
              f"{sum(1 for r in done if r.heads)} of {len(attention)} | {seconds:.0f} | "
              f"{diff:.1e} ({np.abs(before).max():.1e}) |", flush=True)
        reasons = collections.Counter(r.reason for r in reports if not r.permuted)
        notes += [f"{name}: {n} x {reason}" for reason, n in reasons.most_common(3)]
    print("\nMost common skip reasons:\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
