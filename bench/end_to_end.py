"""End to end: serving latency and loaded memory of accelerated 2:4 SavedModels vs dense twins.

Models (float32, or with `--precision mixed_bfloat16` Keras' mixed bfloat16 policy: matmuls in
bfloat16, which the exports store their kernels in; Glorot-random weights, magnitude-pruned 2:4 with
`tf_sparse24.prune`, not trained: speed and memory do not depend on the values):
  mlp          1024-4096-4096-1024 MLP (ReLU), every kernel a Dense layer
  transformer  2 post-LN encoder blocks, d_model 512, 8 heads, FFN 2048, seq 64, built from
               `keras.layers.MultiHeadAttention` (its Q/K/V/O EinsumDense projections and the FFN
               Dense layers all run `Sparse24MatMul` in accelerated mode)
  tfm_dense    the same encoder with Q/K/V/O projections written as Dense layers (a functional
               attention); every pruned kernel runs `Sparse24MatMul` too

Each pruned model is exported with `tf_sparse24.export(mode="accelerated")`; its dense twin is
Keras' `model.export()` of `tf_sparse24.strip(model)` (the same weights, dense kernels, stock ops).
Latency: both SavedModels loaded in this process, calls of `serving_default` interleaved, median
over repeats. Memory: one fresh subprocess per SavedModel imports TensorFlow (and the op library),
warms the runtime up, reads VmHWM from /proc/self/status, loads with `tf.saved_model.load` (as TF
Serving does), runs one call, and reports the growth of VmHWM (peak RSS) and of VmRSS. Run:

    .venv/bin/python bench/end_to_end.py [--quick] [--precision mixed_bfloat16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

GOALS = {"mlp": 1.5, "transformer": 1.2, "tfm_dense": 1.2}
MEMORY_GOAL = 0.6
SEQ, D_MODEL, HEADS, FFN = 64, 512, 8, 2048


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(export_dir: str, accelerated: bool, shape: list[int]) -> None:
    """Subprocess body: prints `peak_growth_kib rss_growth_kib` for one load and one call."""
    import tensorflow as tf  # noqa: PLC0415

    if accelerated:
        from tf_sparse24 import ops  # noqa: PLC0415

        ops.load_library()
    warm = tf.function(lambda a: tf.matmul(a, a))
    warm(tf.ones([64, 64])).numpy()  # runtime, thread pools, tf.function machinery
    base_peak, base_rss = status_kib("VmHWM"), status_kib("VmRSS")
    fn = tf.saved_model.load(export_dir).signatures["serving_default"]
    name = next(iter(fn.structured_input_signature[1]))
    next(iter(fn(**{name: tf.ones(shape)}).values())).numpy()
    print(status_kib("VmHWM") - base_peak, status_kib("VmRSS") - base_rss)


def memory(export_dir: str, accelerated: bool, shape: list[int], repeats: int) -> tuple:
    """Median (peak, rss) growth in MiB over `repeats` fresh subprocesses."""
    peaks, rsss = [], []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, __file__, "--_child", export_dir, str(int(accelerated)),
             ",".join(map(str, shape))],
            check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        peaks.append(int(out[-2]) / 1024)
        rsss.append(int(out[-1]) / 1024)
    return statistics.median(peaks), statistics.median(rsss)


def build(kind: str, keras):
    keras.utils.set_random_seed(0)
    L = keras.layers
    if kind == "mlp":
        x = inputs = keras.Input((1024,), name="features")
        for i, width in enumerate((4096, 4096)):
            x = L.Dense(width, activation="relu", name=f"fc{i + 1}")(x)
        return keras.Model(inputs, L.Dense(1024, name="out")(x), name="mlp"), [1024]
    x = inputs = keras.Input((SEQ, D_MODEL), name="tokens")
    for b in range(2):
        if kind == "transformer":
            a = L.MultiHeadAttention(HEADS, D_MODEL // HEADS, name=f"mha{b}")(x, x)
        else:
            a = _dense_attention(x, b, keras)
        x = L.LayerNormalization(name=f"ln{b}a")(L.Add()([x, a]))
        h = L.Dense(FFN, activation="gelu", name=f"ffn{b}_1")(x)
        y = L.Dense(D_MODEL, name=f"ffn{b}_2")(h)
        x = L.LayerNormalization(name=f"ln{b}b")(L.Add()([x, y]))
    return keras.Model(inputs, x, name=kind), [SEQ, D_MODEL]


def _dense_attention(x, b: int, keras):
    """Multi-head self-attention whose four projections are plain Dense layers."""
    L = keras.layers
    q, k, v = (L.Dense(D_MODEL, name=f"att{b}_{n}")(x) for n in "qkv")
    return L.Dense(D_MODEL, name=f"att{b}_o")(_Attend(name=f"attend{b}")([q, k, v]))


def _attend_layer():
    """softmax(q k^T / sqrt(dh)) v per head, as a weightless Layer (`prune` copies Layers only,
    not bare keras.ops nodes of a Functional graph)."""
    import keras  # noqa: PLC0415

    ops, dh = keras.ops, D_MODEL // HEADS

    class Attend(keras.layers.Layer):
        def call(self, qkv):
            q, k, v = (ops.transpose(ops.reshape(t, (-1, SEQ, HEADS, dh)), (0, 2, 1, 3))
                       for t in qkv)
            w = ops.softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / dh**0.5, axis=-1)
            return ops.reshape(ops.transpose(ops.matmul(w, v), (0, 2, 1, 3)), (-1, SEQ, D_MODEL))

    return Attend


def _Attend(**kwargs):  # noqa: N802
    return _attend_layer()(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, mlp and transformer")
    parser.add_argument("--repeats", type=int, default=None, help="latency repeats per batch")
    parser.add_argument("--memory-repeats", type=int, default=None)
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(GOALS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16"],
                        help="Keras dtype policy the models are built under")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 20)
    mem_repeats = args.memory_repeats or (1 if args.quick else 3)
    models = args.models or (["mlp", "transformer"] if args.quick else list(GOALS))

    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import tf_sparse24  # noqa: PLC0415

    keras.mixed_precision.set_global_policy(args.precision)
    print(f"TF {tf.__version__}, keras {keras.__version__}, {os.cpu_count()} CPUs, op ISA "
          f"{tf_sparse24.ops.cpu_isa()}, policy {args.precision}, load average {os.getloadavg()[0]:.1f} at start; "
          f"{repeats} interleaved repeats per latency, median of {mem_repeats} subprocess(es) "
          "per memory figure")
    rng = np.random.default_rng(0)
    rows, notes = [], []
    root = tempfile.mkdtemp(prefix="sparse24-e2e-")
    for kind in models:
        model, shape = build(kind, keras)
        pruned = tf_sparse24.prune(model)
        dirs = {"dense": os.path.join(root, kind, "dense", "1"),
                "ours": os.path.join(root, kind, "ours", "1")}
        tf_sparse24.strip(pruned).export(dirs["dense"], format="tf_saved_model", verbose=False)
        meta = tf_sparse24.export(pruned, dirs["ours"], mode="accelerated")
        dense_at_load = [e["layer"] for e in meta["sparse"] if e["kernel"] == "dense_at_load"]
        n_sparse = len(meta["sparse"])
        notes.append(f"{kind}: {n_sparse - len(dense_at_load)}/{n_sparse} pruned kernels run "
                     f"Sparse24MatMul" + (f"; dense at load: {sorted(set(dense_at_load))}"
                                          if dense_at_load else ""))
        fns = {"dense": tf.saved_model.load(dirs["dense"]).signatures["serving_default"],
               "ours": tf_sparse24.load(dirs["ours"]).signatures["serving_default"]}
        names = {k: next(iter(f.structured_input_signature[1])) for k, f in fns.items()}
        mem = {k: memory(d, k == "ours", [1, *shape], mem_repeats) for k, d in dirs.items()}
        for batch in args.batches:
            x = tf.constant(rng.standard_normal((batch, *shape)).astype(np.float32))
            call = {k: (lambda f=f, n=names[k], x=x: next(iter(f(**{n: x}).values())).numpy())
                    for k, f in fns.items()}
            err = float(np.abs(call["ours"]() - call["dense"]()).max())
            for _ in range(2):
                for c in call.values():
                    c()
            times = {k: [] for k in call}
            for _ in range(repeats):
                for k, c in call.items():
                    start = time.perf_counter()
                    c()
                    times[k].append(time.perf_counter() - start)
            med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
            rows.append((kind, batch, med["dense"], med["ours"], med["dense"] / med["ours"],
                         GOALS[kind], err, mem))
        del fns, model, pruned

    print(f"\n{'model':12s} {'batch':>5s} {'dense ms':>9s} {'ours ms':>8s} {'speedup':>8s} "
          f"{'goal':>6s}  {'peak MiB d/ours':>16s} {'ratio':>6s} {'goal':>6s}  "
          f"{'RSS MiB d/ours':>15s}  max|diff|")
    for kind, batch, d, o, speedup, goal, err, mem in rows:
        (dp, dr), (op, orss) = mem["dense"], mem["ours"]
        print(f"{kind:12s} {batch:5d} {d:9.3f} {o:8.3f} {speedup:7.2f}x {goal:5.1f}x  "
              f"{dp:7.1f}/{op:7.1f} {op / dp:5.2f}x {MEMORY_GOAL:5.1f}x  "
              f"{dr:7.1f}/{orss:6.1f}  {err:.2g}")
    print()
    for note in notes:
        print(note)
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_child":
        _memory_child(sys.argv[2], sys.argv[3] == "1", [int(s) for s in sys.argv[4].split(",")])
    else:
        main()
