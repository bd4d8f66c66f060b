"""Serving latency and size of the portable and accelerated exports vs a dense SavedModel.

One process, one model: a pruned MLP (mostly Dense, as the size bound of issue 4 assumes) is
exported three ways and each SavedModel is loaded back the way a server would load it:
  dense        Keras' own `model.export()` of the stripped model (dense kernels, stock ops)
  portable     `tf_sparse24.export(mode="portable")` (compressed, rebuilt with stock ops per call)
  accelerated  `tf_sparse24.export(mode="accelerated")` (compressed, Sparse24MatMul)
Calls of `signatures["serving_default"]` are interleaved round-robin over the three and the table
shows medians, so machine noise hits all three alike. Run:

    .venv/bin/python bench/serving.py [--width 2048] [--repeats 30] [--policy mixed_bfloat16]

`--policy` builds the model under a Keras dtype policy: under mixed precision the pruned exports
store the 16-bit compute-dtype values (Keras' own export: the float32 variables).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sparse24  # noqa: E402


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def build(width: int, features: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((features,), name="features"),
        keras.layers.Dense(width, activation="relu", name="fc1"),
        keras.layers.Dense(width, activation="relu", name="fc2"),
        keras.layers.Dense(features, activation="relu", name="fc3"),
        keras.layers.Dense(16, name="logits"),
    ])  # fmt: skip
    return tf_sparse24.prune(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--policy", default="float32",
                        choices=["float32", "mixed_bfloat16", "mixed_float16"])
    args = parser.parse_args()

    keras.config.set_dtype_policy(args.policy)
    model = build(args.width, args.features)
    root = tempfile.mkdtemp(prefix="sparse24-serving-")
    dirs = {name: os.path.join(root, name, "1") for name in ("dense", "portable", "accelerated")}
    tf_sparse24.strip(model).export(dirs["dense"], format="tf_saved_model", verbose=False)
    tf_sparse24.export(model, dirs["portable"], mode="portable")
    tf_sparse24.export(model, dirs["accelerated"], mode="accelerated")
    fns = {
        "dense": tf.saved_model.load(dirs["dense"]).signatures["serving_default"],
        "portable": tf_sparse24.load(dirs["portable"]).signatures["serving_default"],
        "accelerated": tf_sparse24.load(dirs["accelerated"]).signatures["serving_default"],
    }
    input_name = next(iter(fns["dense"].structured_input_signature[1]))

    sizes = {name: dir_bytes(os.path.join(d, "variables")) for name, d in dirs.items()}
    weights = sum(v.numpy().nbytes for v in model.variables if "mask" not in v.path)
    print(f"model: {args.features}-{args.width}-{args.width}-{args.features}-16 MLP, 2:4 pruned, "
          f"{args.policy}; TF {tf.__version__}, {os.cpu_count()} CPUs, "
          f"op ISA {tf_sparse24.ops.cpu_isa()}")
    print(f"\n{'export':12s} {'variables/ bytes':>17s} {'vs dense weights':>17s}")
    print(f"{'(weights)':12s} {weights:17d} {1:16.3f}x   dense float32 bytes, each variable once")
    for name, size in sizes.items():
        note = "   Keras model.export stores each variable twice" if name == "dense" else ""
        print(f"{name:12s} {size:17d} {size / weights:16.3f}x{note}")

    rng = np.random.default_rng(0)
    print(f"\n{'batch':>5s} {'export':12s} {'median ms':>10s} {'vs dense':>9s}   "
          f"(max |diff| vs dense)")
    for batch in args.batches:
        x = tf.constant(rng.standard_normal((batch, args.features)).astype(np.float32))
        outs = {name: next(iter(fn(**{input_name: x}).values())).numpy()
                for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(3):  # warm-up
            for fn in fns.values():
                fn(**{input_name: x})
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                next(iter(fn(**{input_name: x}).values())).numpy()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["dense"])
        for name in fns:
            med = statistics.median(times[name])
            diff = float(np.abs(outs[name] - outs["dense"]).max())
            print(f"{batch:5d} {name:12s} {med * 1e3:10.3f} {med / base:8.2f}x   ({diff:.2g})")


if __name__ == "__main__":
    main()
