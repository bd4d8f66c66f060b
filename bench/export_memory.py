"""Peak memory while exporting: how far the process's peak RSS rises above what it holds while an
export is written.

Two pruned float32 models, each exported with Keras' `model.export()` (the stripped model, dense:
the reference), `tf_sparse24.export(mode="portable")` and `mode="accelerated"`:
  mlp        a stack of --layers Dense(W, W) (W = --width): nearly all weights in pruned kernels
  embedding  Embedding(V, 768) (V = --vocab, not pruned: stored dense) -> Dense(768) -> Dense(8)
Every (model, export) pair runs in a fresh subprocess, so no export's peak or freed memory carries
into another's. The subprocess builds and prunes the model, writes a warm-up export of a small copy
(width or vocabulary / 64: TensorFlow's one-time tracing and saving set-up, which does not grow with
the weights), resets VmHWM to the current RSS (writing 5 to /proc/self/clear_refs, Linux only),
writes the export and reports VmHWM's rise: the memory the export needs on top of the live model.
Run:

    .venv/bin/python bench/export_memory.py [--width 4096] [--layers 8] [--vocab 100000]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_sparse24  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from end_to_end import status_kib  # noqa: E402  (bench/end_to_end.py)

KINDS = ("dense", "portable", "accelerated")


def mlp(width: int, layers: int) -> keras.Model:
    return keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)]
    )


def embedding(vocab: int) -> keras.Model:
    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Dense(768)(keras.layers.Embedding(vocab, 768)(tokens))
    return keras.Model(tokens, keras.layers.Dense(8)(h))


def build(name: str, args: argparse.Namespace, scale: int = 1) -> tuple[keras.Model, int]:
    """The pruned model, and the bytes of the model's own weights (not the pruning masks)."""
    keras.utils.set_random_seed(0)
    if name == "mlp":
        model = mlp(args.width // scale, args.layers)
    else:
        model = embedding(args.vocab // scale)
    weight_bytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.weights)
    return tf_sparse24.prune(model), weight_bytes


def write(kind: str, pruned: keras.Model, export_dir: str) -> None:
    if kind == "dense":
        tf_sparse24.strip(pruned).export(export_dir, format="tf_saved_model", verbose=False)
    else:
        tf_sparse24.export(pruned, export_dir, mode=kind)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of the two models (this script's and bench/load_memory.py's)."""
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=100000)


def reset_peak_rss() -> None:
    """Collects garbage, then sets VmHWM to the current RSS (Linux only): the next peak read is
    what the process reaches from here on."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_child(script: str, *argv: str) -> list[int]:
    """Runs `script --_child *argv` in a fresh interpreter; the integers on its last output line."""
    out = subprocess.run([sys.executable, script, "--_child", *argv],
                         check=True, capture_output=True, text=True).stdout
    return [int(word) for word in out.splitlines()[-1].split()]


def child(name: str, kind: str, args: argparse.Namespace) -> None:
    """Subprocess body: prints `weight_bytes peak_growth_kib` for one export."""
    root = tempfile.mkdtemp(prefix="sparse24-export-memory-")
    write(kind, build(name, args, scale=64)[0], os.path.join(root, "warm-up", "1"))
    pruned, weight_bytes = build(name, args)
    reset_peak_rss()
    start = status_kib("VmHWM")
    write(kind, pruned, os.path.join(root, "measured", "1"))
    print(weight_bytes, status_kib("VmHWM") - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        child(*args._child, args)
        return
    flags = ["--width", str(args.width), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    print(f"peak RSS rise while writing one export over the live pruned model, one fresh "
          f"subprocess each, {os.cpu_count()} CPUs")
    print(f"{'model':10s} {'weights MiB':>11s} {'export':>12s} {'peak rise MiB':>14s} "
          f"{'x weights':>10s}")
    for name in ("mlp", "embedding"):
        for kind in KINDS:
            weight_bytes, rise_kib = run_child(__file__, name, kind, *flags)
            weights, rise = weight_bytes / 2**20, rise_kib / 1024
            print(f"{name:10s} {weights:11.1f} {kind:>12s} {rise:14.1f} {rise / weights:9.2f}x")


if __name__ == "__main__":
    main()
