"""Times Sparse24Compress / Sparse24Decompress against the numpy reference (tf_sparse24.format).

Both run once per weight (at export or load), so this is about staying out of the way, not peak
speed. Prints median ms over repeats, measured side by side in one process:

    .venv/bin/python bench/compress.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tensorflow as tf

from tf_sparse24 import format as fmt
from tf_sparse24 import ops

SHAPES = [(768, 3072), (3072, 768), (4096, 4096)]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def random_24(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    w = rng.standard_normal((k, n)).astype(np.float32)
    drop = rng.random((n, k // 4, 4)).argsort(axis=-1)[..., :2]  # two random zeros per group
    groups = w.T.reshape(n, k // 4, 4).copy()
    np.put_along_axis(groups, drop, 0.0, axis=-1)
    return np.ascontiguousarray(groups.reshape(n, k).T)


def time_shape(w: np.ndarray, repeats: int) -> list[float]:
    """[op compress, numpy compress, op decompress, numpy decompress] median ms for one matrix."""
    k = w.shape[0]
    wt = tf.constant(w)
    values, meta = ops.sparse24_compress(wt)
    np_values, np_meta = fmt.compress(w)
    if not (np.array_equal(values.numpy(), np_values) and np.array_equal(meta.numpy(), np_meta)):
        raise RuntimeError(f"op and numpy reference disagree on a {w.shape} matrix")
    return [
        median_ms(lambda: ops.sparse24_compress(wt)[1].numpy(), repeats),
        median_ms(lambda: fmt.compress(w), repeats),
        median_ms(lambda: ops.sparse24_decompress(values, meta, k).numpy(), repeats),
        median_ms(lambda: fmt.decompress(np_values, np_meta, k), repeats),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        "| K x N (float32) | op compress ms | numpy compress ms | op decompress ms "
        "| numpy decompress ms |"
    )
    print("| --- | --- | --- | --- | --- |")
    for k, n in SHAPES:
        cells = time_shape(random_24(rng, k, n), args.repeats)
        print(f"| {k} x {n} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
