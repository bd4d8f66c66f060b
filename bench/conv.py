"""Would 2:4 convolutions run faster through Sparse24MatMul? Dense conv vs the sparse matmul route.

The accelerated export runs Dense and matmul-shaped EinsumDense kernels with `Sparse24MatMul` and
decompresses convolution kernels at load (dense speed). This script measures the two ways a
channels-last Conv2D could use the op instead, on the same 2:4 kernel, side by side in one process:

* 1x1 (pointwise) kernels: `Sparse24MatMul(x[B, H, W, Cin], values, meta)` is the convolution;
* k x k kernels: `tf.image.extract_patches` (patch layout = the format's [kh*kw*Cin, Cout] view,
  in-channel fastest) then `Sparse24MatMul`, i.e. im2col.

against `tf.nn.conv2d` (what `keras.layers.Conv2D` runs). Ratio = dense time / sparse-route time,
medians of interleaved samples (each a tf.while_loop of back-to-back calls, as in bench/matmul.py).

    .venv/bin/python bench/conv.py            # the shapes below, about 2 minutes on 2 cores
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from matmul import _iterations, _looped, _random_2to4, _run_numpy, _time_pair

from tf_sparse24 import ops

# (batch, height = width, in channels, out channels, kernel size): ResNet / MobileNet-like layers.
SHAPES = [
    (8, 28, 256, 256, 1),
    (8, 14, 512, 512, 1),
    (32, 7, 1024, 256, 1),
    (1, 56, 64, 256, 1),
    (8, 28, 128, 128, 3),
    (8, 14, 256, 256, 3),
]


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"TF {tf.__version__}, kernel variant: {ops.cpu_isa()}, float32, channels_last, stride 1")
    header = (f"{'B x H x W x Cin -> Cout, k':>28} {'M x K x N':>16} {'conv ms':>8} "
              f"{'sparse ms':>9} {'ratio':>6} {'max |diff|':>10}")
    print(header)
    print("-" * len(header))
    for b, hw, cin, cout, k in SHAPES:
        w2d = _random_2to4(rng, k * k * cin, cout)
        kernel = tf.constant(w2d.reshape(k, k, cin, cout))
        values, meta = ops.sparse24_compress(tf.constant(w2d))
        x = tf.constant(rng.standard_normal((b, hw, hw, cin)).astype(np.float32))

        def conv(x, kernel):
            return tf.reshape(tf.nn.conv2d(x, kernel, 1, "SAME"), [-1, cout])

        def sparse(x, values, meta, k=k):
            if k > 1:
                x = tf.image.extract_patches(x, [1, k, k, 1], [1, 1, 1, 1], [1, 1, 1, 1], "SAME")
            return tf.reshape(ops.sparse24_matmul(x, values, meta), [-1, cout])

        diff = np.abs(_run_numpy(tf.function(conv), x, kernel)
                      - _run_numpy(tf.function(sparse), x, values, meta)).max()  # fmt: skip
        iterations = _iterations(tf.function(conv), x, kernel)
        td, ts, _, _ = _time_pair(
            functools.partial(_run_numpy, _looped(conv, iterations), x, kernel),
            functools.partial(_run_numpy, _looped(sparse, iterations), x, values, meta),
            8.0, 5, 100,
        )  # fmt: skip
        print(f"{f'{b}x{hw}x{hw}x{cin} -> {cout}, {k}x{k}':>28} "
              f"{f'{b * hw * hw}x{k * k * cin}x{cout}':>16} {td / iterations * 1e3:8.2f} "
              f"{ts / iterations * 1e3:9.2f} {td / ts:6.2f} {diff:10.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
