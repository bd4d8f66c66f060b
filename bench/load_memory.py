"""Peak memory while loading: how far the process's peak RSS rises while an export loads, with the
stock `tf.saved_model.load` and with the checking `tf_sparse24.load`, and what stays resident.

The exports are the ones bench/export_memory.py measures (float32, pruned; `--width`, `--layers`,
`--vocab` as there), each written in `portable` and `accelerated` mode:
  mlp        a stack of --layers Dense(W, W) (W = --width): nearly all weights in pruned kernels
  embedding  Embedding(V, 768) (V = --vocab, not pruned: stored dense) -> Dense(768) -> Dense(8)
They are written once into --exports (kept there and reused by a later run with the same sizes, so
a before/after comparison loads the very same files), with a 1/64-size copy of each for warm-up.
Every (model, mode, loader) runs in a fresh subprocess, which imports tf_sparse24 (and loads the op
library for an accelerated export: the stock loader needs it too), loads the small copy with the
same loader (TensorFlow's one-time loading set-up, which does not grow with the weights), resets
VmHWM to the current RSS (writing 5 to /proc/self/clear_refs, Linux only), loads the export and
reports VmHWM's rise (the peak) and VmRSS's rise with the loaded object alive (resident). A
portable export decompresses its kernels into dense variables while it loads, with either loader;
glibc keeps part of that scratch in its heap, so those rows vary by about 50 MiB from run to run
(MALLOC_MMAP_THRESHOLD_=1048576 in the environment makes them exact).
Run:

    .venv/bin/python bench/load_memory.py [--width 4096] [--layers 8] [--vocab 100000]
                                          [--exports DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_sparse24  # noqa: E402
from tf_sparse24 import ops  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from end_to_end import status_kib  # noqa: E402  (bench/end_to_end.py)
from export_memory import add_model_arguments, build, reset_peak_rss, run_child  # noqa: E402

MODES = ("portable", "accelerated")
LOADERS = ("stock", "tf_sparse24")


def load(loader: str, export_dir: str):
    if loader == "stock":
        return tf.saved_model.load(export_dir)
    return tf_sparse24.load(export_dir)


def child(loader: str, mode: str, export_dir: str, warm_up_dir: str) -> None:
    """Subprocess body: prints `peak_rise_kib resident_rise_kib` for one load."""
    if mode == "accelerated":
        ops.load_library()
    load(loader, warm_up_dir)
    reset_peak_rss()
    start_peak, start_rss = status_kib("VmHWM"), status_kib("VmRSS")
    loaded = load(loader, export_dir)
    gc.collect()
    print(status_kib("VmHWM") - start_peak, status_kib("VmRSS") - start_rss)
    del loaded


def write_exports(root: str, args: argparse.Namespace) -> dict[str, int]:
    """Writes the missing exports under `root`; returns each model's weight bytes."""
    weights = {}
    for name in ("mlp", "embedding"):
        for scale, part in ((64, "warm-up"), (1, "measured")):
            pruned, weight_bytes = build(name, args, scale=scale)
            if scale == 1:
                weights[name] = weight_bytes
            for mode in MODES:
                path = os.path.join(root, name, mode, part, "1")
                if not os.path.isdir(path):
                    tf_sparse24.export(pruned, path, mode=mode)
            del pruned
            gc.collect()
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--exports", help="directory to write the exports to (or reuse them from)")
    parser.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        child(*args._child)
        return
    root = args.exports or tempfile.mkdtemp(prefix="sparse24-load-memory-")
    root = os.path.join(root, f"w{args.width}-l{args.layers}-v{args.vocab}")
    weights = write_exports(root, args)
    print(f"peak RSS rise while loading one export, and the RSS rise that stays with the loaded "
          f"object, one fresh subprocess each, {os.cpu_count()} CPUs")
    print(f"{'model':10s} {'weights MiB':>11s} {'export':>12s} {'loader':>12s} "
          f"{'peak rise MiB':>14s} {'resident MiB':>13s} {'peak x weights':>15s}")
    for name in ("mlp", "embedding"):
        for mode in MODES:
            for loader in LOADERS:
                peak_kib, resident_kib = run_child(
                    __file__, loader, mode, os.path.join(root, name, mode, "measured", "1"),
                    os.path.join(root, name, mode, "warm-up", "1"))
                peak, resident = peak_kib / 1024, resident_kib / 1024
                mib = weights[name] / 2**20
                print(f"{name:10s} {mib:11.1f} {mode:>12s} {loader:>12s} {peak:14.1f} "
                      f"{resident:13.1f} {peak / mib:14.2f}x")


if __name__ == "__main__":
    main()
