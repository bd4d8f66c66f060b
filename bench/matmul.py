"""Sparse24MatMul vs dense tf.linalg.matmul on the same 2:4 matrix, side by side in one process.

Prints median milliseconds of each (calls interleaved, so load on the machine hits both alike), the
ratio dense / sparse, and the goal of issue 5 beside it, for float32 and bfloat16:

    .venv/bin/python bench/matmul.py            # full table (about 3 minutes on 2 cores)
    .venv/bin/python bench/matmul.py --quick    # fewer repeats, M=2048 skipped (about 30 s)
    .venv/bin/python bench/matmul.py --isa avx2 --dtypes float32 --shapes 1x4096x4096

Each timed sample is one call of a tf.function that runs the op back to back in a tf.while_loop
(enough iterations for ~20 ms), divided by the iteration count: a lone tf.function call costs
0.4-0.6 ms of Python and executor dispatch on this machine, the same for both sides, which would
otherwise dilute the ratio of short calls (M=32: 3 ms). Inside a SavedModel the ops run back to back
like this. `--per-call` times one tf.function call per sample instead (dispatch included).

`cpu ratio` is the same ratio in process CPU seconds (less sensitive to other jobs on the machine).
Also prints each side's GFLOP/s (dense counts all 2*M*K*N flops, sparse the useful half) and the
weight-read bandwidth of the dense GEMV row, the machine figures docs/KERNELS.md reasons with.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tf_sparse24 import ops

# (M, K, N): goal ratio for float32, bfloat16 (issue 5).
GOALS = {
    (1, 4096, 4096): (1.7, 1.5),
    (16, 4096, 4096): (1.6, 1.4),
    (256, 4096, 4096): (1.4, 1.2),
    (2048, 4096, 4096): (1.3, 1.0),
    (32, 768, 3072): (1.4, 1.2),
    (32, 3072, 768): (1.4, 1.2),
}


def _time_pair(dense, sparse, budget_s: float, min_reps: int, max_reps: int):
    """Medians of wall and process-CPU seconds of two callables, called alternately after a warm-up.

    CPU seconds (all threads) are reported too: on a machine shared with other jobs, wall time
    also measures how long the scheduler kept our threads waiting.
    """
    dense(), sparse()
    wall, cpu = ([], []), ([], [])
    start = time.perf_counter()
    while len(wall[0]) < max_reps and (
        len(wall[0]) < min_reps or time.perf_counter() - start < budget_s
    ):
        for i, fn in enumerate((dense, sparse)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    td, ts = float(np.median(wall[0])), float(np.median(wall[1]))
    return td, ts, float(np.median(cpu[0]) / np.median(cpu[1])), len(wall[0])


def _run_numpy(fn, *args):
    return fn(*args).numpy()


def _looped(op, iterations: int):
    """A tf.function running `op(*args)` `iterations` times in a tf.while_loop.

    Each result feeds a scalar the loop returns, so no iteration is pruned; a while loop runs its
    body once per iteration, so no two calls are merged as common subexpressions; and with
    parallel_iterations=1 the calls run one after another, never two at once.
    """

    def run(*args):
        def body(i, total):
            y = op(*args)
            return i + 1, total + tf.cast(y[0, 0], tf.float32)

        zero = (tf.constant(0), tf.constant(0.0))
        return tf.while_loop(lambda i, _: i < iterations, body, zero, parallel_iterations=1)[1]

    return tf.function(run)


def _iterations(fn, *args, target_s: float = 0.02) -> int:
    """Back-to-back calls per timed sample so that one sample lasts about `target_s`."""
    _run_numpy(fn, *args)
    start = time.perf_counter()
    _run_numpy(fn, *args)
    return max(1, round(target_s / max(time.perf_counter() - start, 1e-6)))


def _random_2to4(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    w = rng.standard_normal((k, n)).astype(np.float32)
    drop = np.argsort(rng.random((k // 4, 4, n)), axis=1)[
        :, :2
    ]  # 2 random zeros per group
    np.put_along_axis(w.reshape(k // 4, 4, n), drop, 0.0, axis=1)
    return w


def run(shapes, dtypes, quick: bool, per_call: bool = False) -> None:
    rng = np.random.default_rng(0)
    print(
        f"TF {tf.__version__}, kernel variant: {ops.cpu_isa()}, "
        f"intra-op threads: {tf.config.threading.get_intra_op_parallelism_threads() or 'auto'}"
    )
    header = (
        f"{'M x K x N':>18} {'dtype':>8} {'dense ms':>9} {'sparse ms':>9} {'ratio':>6} "
        f"{'goal':>5} {'met':>3} {'cpu ratio':>9} {'dense GF/s':>10} {'sparse GF/s':>11} {'reps':>4}"
    )
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        tf_dtype = tf.as_dtype(dtype)
        for m, k, n in shapes:
            w32 = _random_2to4(rng, k, n)
            w = tf.cast(tf.constant(w32), tf_dtype)
            values, meta = ops.sparse24_compress(w)
            x = tf.cast(
                tf.constant(rng.standard_normal((m, k)).astype(np.float32)), tf_dtype
            )
            dense_fn = tf.function(lambda a, b: tf.linalg.matmul(a, b))
            sparse_fn = tf.function(lambda a, v, s: ops.sparse24_matmul(a, v, s))
            iterations = 1 if per_call else _iterations(dense_fn, x, w)
            if iterations > 1:
                dense_fn = _looped(tf.linalg.matmul, iterations)
                sparse_fn = _looped(ops.sparse24_matmul, iterations)
            flops = 2.0 * m * k * n
            budget = (
                (2.0 if quick else 8.0) if flops < 1e10 else (4.0 if quick else 15.0)
            )
            td, ts, cpu_ratio, reps = _time_pair(
                functools.partial(_run_numpy, dense_fn, x, w),
                functools.partial(_run_numpy, sparse_fn, x, values, meta),
                budget,
                3 if quick else 5,
                30 if quick else 200,
            )
            td, ts = td / iterations, ts / iterations
            goal = GOALS.get((m, k, n), (None, None))[0 if dtype == "float32" else 1]
            ratio = td / ts
            met = "-" if goal is None else ("yes" if ratio >= goal else "no")
            goal_s = "-" if goal is None else f"{goal:.1f}"
            print(
                f"{f'{m}x{k}x{n}':>18} {dtype:>8} {td * 1e3:9.2f} {ts * 1e3:9.2f} {ratio:6.2f} "
                f"{goal_s:>5} {met:>3} {cpu_ratio:9.2f} {flops / td / 1e9:10.1f} {flops / 2 / ts / 1e9:11.1f} "
                f"{reps:4d}",
                flush=True,
            )
            if m == 1 and dtype == "float32":
                print(
                    f"{'':>18} dense GEMV reads W at {k * n * 4 / td / 1e9:.1f} GB/s; sparse reads "
                    f"values+meta at {(k * n * 2 + n * k // 8) / ts / 1e9:.1f} GB/s"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats; skip M=2048"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--shapes", default=None, help="comma-separated MxKxN (default: the goals)"
    )
    parser.add_argument(
        "--isa", default=None, choices=ops.CPU_ISAS, help="force a kernel variant"
    )
    parser.add_argument(
        "--per-call", action="store_true", help="one tf.function call per sample (dispatch included)"
    )
    args = parser.parse_args()
    if args.isa:
        ops.set_cpu_isa(args.isa)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [s for s in GOALS if not (args.quick and s[0] >= 2048)]
    run(shapes, args.dtypes.split(","), args.quick, args.per_call)


if __name__ == "__main__":
    main()
