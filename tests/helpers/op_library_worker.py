"""Loads one built op library into TensorFlow and reports, as one JSON line, what it does.

Run as `python tests/helpers/op_library_worker.py LIBRARY` in a fresh process, so the library under
test is the only sparse24 library loaded (the package's own is never imported; the numpy format
reference is loaded from its file). Reports the CPU ops' results against that reference and a
float64 matmul, the error a non-2:4 input gets, and every kernel TensorFlow now has registered for
the three ops ("DEVICE:dtype"), which is how a GPU build is told from a CPU one on a machine
without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ("Sparse24Compress", "Sparse24Decompress", "Sparse24MatMul")


def _format_reference():
    spec = importlib.util.spec_from_file_location(
        "fmt", os.path.join(REPO, "tf_sparse24", "format.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def registered_kernels() -> dict[str, list[str]]:
    """{op: sorted "DEVICE:dtype" for every registered kernel}."""
    found = {}
    for op in OPS:
        entries = set()
        for kernel in kernels.get_registered_kernels_for_op(op).kernel:
            for constraint in kernel.constraint:
                for dtype in constraint.allowed_values.list.type:
                    entries.add(f"{kernel.device_type}:{tf.dtypes.as_dtype(dtype).name}")
        found[op] = sorted(entries)
    return found


def main(path: str) -> None:
    library = tf.load_op_library(path)
    fmt = _format_reference()
    rng = np.random.default_rng(7)
    k, n, m = 72, 40, 9
    w = rng.standard_normal((k, n)).astype(np.float32)
    drop = np.argsort(rng.random((k // 4, 4, n)), axis=1)[:, :2]
    np.put_along_axis(w.reshape(k // 4, 4, n), drop, 0.0, axis=1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    values, meta = library.sparse24_compress(w)
    want_values, want_meta = fmt.compress(w)
    y = library.sparse24_mat_mul(x, values, meta).numpy()
    bad = w.copy()
    bad[4:8, 3] = 1.0
    try:
        library.sparse24_compress(bad)
        error = ""
    except tf.errors.InvalidArgumentError as e:
        error = e.message
    dense = library.sparse24_decompress(values, meta, k).numpy()
    report = {
        "values_equal": bool(np.array_equal(values.numpy(), want_values)),
        "meta_equal": bool(np.array_equal(meta.numpy(), want_meta)),
        "dense_equal": bool(np.array_equal(dense, w)),
        "matmul_error": float(np.abs(y - x.astype(np.float64) @ w.astype(np.float64)).max()),
        "bad_input_error": error,
        "kernels": registered_kernels(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
