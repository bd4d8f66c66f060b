"""Peak memory while exporting: how much the process's peak RSS grows while an export is written.

Two pruned float32 models, each exported with Keras' `model.export()` (the stripped model, dense),
`tf_sparse24.export(mode="portable")` and `mode="accelerated"`:
  mlp        1024-W-W-1024-16 MLP (W = --width), nearly all weights in pruned kernels
  embedding  Embedding(V, 768) (V = --vocab, not pruned: stored dense) -> Dense(768) -> Dense(8)
Each export is written twice in this process; the first warms TensorFlow's tracing and saving up,
and the table shows the growth of VmHWM (reset to the current RSS by writing 5 to
/proc/self/clear_refs, Linux only) while the second is written: a growth over what the process
already holds, freed memory the allocator kept from the first export included (Keras' dense
export shows about 0 for that reason). Run:

    .venv/bin/python bench/export_memory.py [--width 4096] [--vocab 30000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_sparse24  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from end_to_end import status_kib  # noqa: E402  (bench/end_to_end.py)


def peak_growth_mib(fn) -> float:
    """How much this process's peak RSS (VmHWM) grows while `fn()` runs, in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status_kib("VmHWM")
    fn()
    return (status_kib("VmHWM") - start) / 1024


def mlp(width: int) -> keras.Model:
    return keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(16),
    ])  # fmt: skip


def embedding(vocab: int) -> keras.Model:
    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Dense(768)(keras.layers.Embedding(vocab, 768)(tokens))
    return keras.Model(tokens, keras.layers.Dense(8)(h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=2, help="measured exports per kind")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    root = tempfile.mkdtemp(prefix="sparse24-export-memory-")
    print(f"peak RSS growth while exporting, MiB (median of {args.repeats}; each after a "
          "warm-up export of the same kind)")
    print(f"{'model':10s} {'weights MiB':>11s} {'dense':>8s} {'portable':>9s} {'accelerated':>12s}")
    for name, model in (("mlp", mlp(args.width)), ("embedding", embedding(args.vocab))):
        pruned = tf_sparse24.prune(model)
        stripped = tf_sparse24.strip(pruned)
        writers = {
            "dense": lambda d: stripped.export(d, format="tf_saved_model", verbose=False),
            "portable": lambda d: tf_sparse24.export(pruned, d, mode="portable"),
            "accelerated": lambda d: tf_sparse24.export(pruned, d, mode="accelerated"),
        }
        growth = {}
        for kind, write in writers.items():
            write(os.path.join(root, name, kind, "warm-up", "1"))
            growth[kind] = statistics.median(
                peak_growth_mib(lambda w=write, d=os.path.join(root, name, kind, str(i), "1"): w(d))
                for i in range(args.repeats))
        weights = sum(v.numpy().nbytes for v in model.weights) / 2**20
        print(f"{name:10s} {weights:11.1f} {growth['dense']:8.1f} {growth['portable']:9.1f} "
              f"{growth['accelerated']:12.1f}")


if __name__ == "__main__":
    main()
