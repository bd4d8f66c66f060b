"""Python side of the sparse24 custom ops: loading, raw ops with gradients, CompressedWeight.

The ops (`Sparse24Compress`, `Sparse24Decompress`, `Sparse24MatMul`) live in the C++ library
`_sparse24_ops*.so` next to this file, built against the installed TensorFlow by `pip install
--no-build-isolation .` or `make ops`. The compressed format is `sparse24/v1` (docs/FORMAT.md;
`tf_sparse24.format` is its numpy definition).

Example:
    >>> w = tf.constant([[1.0], [0.0], [2.0], [0.0]])      # a 2:4 [K=4, N=1] kernel
    >>> cw = compress(w)
    >>> sparse_matmul(tf.constant([[1.0, 1.0, 1.0, 1.0]]), cw).numpy().tolist()
    [[3.0]]
"""

from __future__ import annotations

import ctypes
import glob
import math
import operator
import os
import threading
import warnings
from types import ModuleType

import tensorflow as tf

from tf_sparse24.masks import is_integer_axis

_LIBRARY_GLOB = "_sparse24_ops*.so"
_load_lock = threading.Lock()
_library: ModuleType | None = None

ISA_ENV_VAR = "TF_SPARSE24_CPU_ISA"
CPU_ISAS = ("auto", "scalar", "avx2", "avx512", "avx512bf16")


class OpLibraryError(ImportError):
    """The op library is missing, or was built for another TensorFlow."""


def library_path() -> str:
    """Path of the op library next to this module (the first match of `_sparse24_ops*.so`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    matches = sorted(glob.glob(os.path.join(here, _LIBRARY_GLOB)))
    return matches[0] if matches else os.path.join(here, "_sparse24_ops.so")


def _built_tf_version(path: str) -> str:
    """TensorFlow version the library was built against ("unknown" if not recorded: Bazel)."""
    try:
        fn = ctypes.CDLL(path, mode=os.RTLD_LAZY).tf_sparse24_tf_version
    except (OSError, AttributeError):
        return "unknown"
    fn.restype = ctypes.c_char_p
    return fn().decode()


DTYPES = (tf.float32, tf.bfloat16, tf.float16)  # the ops' kernels (CPU and GPU)
OP_NAMES = ("sparse24_compress", "sparse24_decompress", "sparse24_mat_mul")  # the op module's


def load_library() -> ModuleType:
    """Loads the op library once per process and returns its op module.

    Raises:
        OpLibraryError: if the file is missing or does not load into this TensorFlow; the message
            names the expected file, the running TensorFlow version, the one the library was built
            for, and how to rebuild it.
    """
    global _library
    with _load_lock:
        if _library is not None:
            return _library
        path = library_path()
        rebuild = (
            "Rebuild it against this TensorFlow with `make ops` (or `pip install "
            "--no-build-isolation .`); custom ops are ABI-bound to the TensorFlow minor version."
        )
        if not os.path.exists(path):
            raise OpLibraryError(
                f"tf_sparse24 op library not found: expected {path} for TensorFlow "
                f"{tf.__version__}. {rebuild}"
            )
        try:
            library = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise OpLibraryError(
                f"could not load the tf_sparse24 op library {path} (built for TensorFlow "
                f"{_built_tf_version(path)}) into TensorFlow {tf.__version__}: {e}. {rebuild}"
            ) from e
        missing = [op for op in OP_NAMES if not hasattr(library, op)]
        if missing:  # e.g. built from a source tree without cc/: a library with no kernels
            raise OpLibraryError(
                f"the tf_sparse24 op library {path} does not define the ops {missing}. {rebuild}"
            )
        built = _built_tf_version(path)
        if built != "unknown" and built.split(".")[:2] != tf.__version__.split(".")[:2]:
            raise OpLibraryError(
                f"the tf_sparse24 op library {path} was built for TensorFlow {built}, but "
                f"TensorFlow {tf.__version__} is running. {rebuild}"
            )
        _library = library
        return _library


# --------------------------------------------------------------------------------------------------
# CPU kernel variant (for tests and benchmarks)


def _c_function(name: str, restype, argtypes=()):
    """A plain C entry point of the op library (the extern "C" block of sparse24_kernels.cc)."""
    load_library()
    fn = getattr(ctypes.CDLL(library_path()), name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def supported_cpu_isas() -> list[str]:
    """The CPU kernel variants this machine can run, e.g. ["scalar", "avx2"]."""
    supported = _c_function("tf_sparse24_cpu_isa_supported", ctypes.c_int, [ctypes.c_char_p])
    return [name for name in CPU_ISAS[1:] if supported(name.encode()) == 1]


def cpu_isa() -> str:
    """The CPU variant `Sparse24MatMul` runs now: the forced one, or the best this CPU supports."""
    forced = os.environ.get(ISA_ENV_VAR, "") or "auto"
    if forced != "auto":
        return forced
    return _c_function("tf_sparse24_best_cpu_isa", ctypes.c_char_p)().decode()


def set_cpu_isa(name: str) -> None:
    """Forces the CPU SpMM variant (one of `CPU_ISAS`) for later calls.

    Sets the environment variable `TF_SPARSE24_CPU_ISA`, which the kernel reads on every call
    (so it also works when set before starting Python). Meant for tests and benchmarks.

    Raises:
        ValueError: for an unknown name, or a variant this CPU cannot run (the op itself also fails
            with InvalidArgument if the variable names one).
    """
    if name not in CPU_ISAS:
        raise ValueError(f"unknown CPU kernel variant; use one of {CPU_ISAS}. Received: {name!r}")
    if name != "auto" and name not in supported_cpu_isas():
        raise ValueError(
            f"this CPU cannot run the {name!r} kernel variant; it supports {supported_cpu_isas()}"
        )
    os.environ[ISA_ENV_VAR] = name


# --------------------------------------------------------------------------------------------------
# Raw ops


def sparse24_compress(dense: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """`Sparse24Compress`: 2:4 dense [K, N] -> (values [N, K/2], meta [N, ceil(K/8)] uint8)."""
    return tuple(load_library().sparse24_compress(dense))


def sparse24_decompress(values: tf.Tensor, meta: tf.Tensor, k: int) -> tf.Tensor:
    """`Sparse24Decompress`: (values [N, K/2], meta [N, ceil(K/8)]) -> dense [K, N]."""
    try:
        k = operator.index(k)  # an int (numpy's too); int(8.7) would quietly be 8
    except TypeError:
        raise TypeError(f"sparse24_decompress: k must be an integer. Received: k={k!r}") from None
    return load_library().sparse24_decompress(values, meta, k=k)


def sparse24_matmul(x: tf.Tensor, values: tf.Tensor, meta: tf.Tensor) -> tf.Tensor:
    """`Sparse24MatMul`: x [..., K] @ W [K, N] with W given as (values, meta) -> [..., N]."""
    return load_library().sparse24_mat_mul(x, values, meta)


def kept_rows(meta: tf.Tensor, k: int) -> tf.Tensor:
    """Row index in W (0..K-1) of every stored value: int32 [N, K/2], read from `meta`."""
    meta = tf.cast(meta, tf.int32)
    low, high = meta % 16, meta // 16
    nibbles = tf.reshape(tf.stack([low, high], axis=-1), [tf.shape(meta)[0], -1])[:, : k // 4]
    positions = tf.stack([nibbles % 4, nibbles // 4], axis=-1)
    positions = tf.reshape(positions, [tf.shape(meta)[0], k // 2])
    return positions + 4 * (tf.range(k // 2, dtype=tf.int32) // 2)


def _gather_kept(dense: tf.Tensor, meta: tf.Tensor, k: int) -> tf.Tensor:
    """values-shaped [N, K/2] gather of dense [K, N] at the positions `meta` keeps."""
    return tf.gather(tf.transpose(dense), kept_rows(meta, k), axis=1, batch_dims=1)


def _static_k(op: tf.Operation, k: int | None, half_k: int | None) -> int:
    """K for the gradient's Sparse24Decompress (an op attribute, so static): from the dense side's
    static shape (`k`), else from values' [N, K/2]."""
    if k is not None:
        return int(k)
    if half_k is not None:
        return 2 * int(half_k)
    raise ValueError(
        f"the gradient of {op.type} needs a static K: give x (or the dense input) a static last "
        "dimension, or values a static [N, K/2] shape"
    )


@tf.RegisterGradient("Sparse24MatMul")
def _sparse24_matmul_grad(op: tf.Operation, dy: tf.Tensor):
    """d/dx = dy @ W^T (W decompressed); d/dvalues = (x^T dy) at the kept positions; meta: None."""
    x, values, meta = op.inputs
    k = _static_k(op, x.shape[-1] if x.shape.rank else None, values.shape[-1])
    n = tf.shape(values)[0]
    w = sparse24_decompress(values, meta, k)  # [K, N]
    m = tf.reduce_prod(tf.shape(x)[:-1])  # not -1: an empty tensor would make that 1
    dy2 = tf.reshape(dy, [m, n])
    x2 = tf.reshape(x, [m, k])
    dx = tf.reshape(tf.matmul(dy2, w, transpose_b=True), tf.shape(x))
    dvalues = _gather_kept(tf.matmul(x2, dy2, transpose_a=True), meta, k)
    return dx, dvalues, None


@tf.RegisterGradient("Sparse24Decompress")
def _sparse24_decompress_grad(op: tf.Operation, ddense: tf.Tensor):
    return _gather_kept(ddense, op.inputs[1], op.get_attr("k")), None


@tf.RegisterGradient("Sparse24Compress")
def _sparse24_compress_grad(op: tf.Operation, dvalues: tf.Tensor, unused_dmeta: tf.Tensor):
    # values is a gather of dense at positions fixed by its non-zeros: the gradient scatters back.
    k = _static_k(op, op.inputs[0].shape[0] if op.inputs[0].shape.rank else None,
                  op.outputs[0].shape[-1])
    return sparse24_decompress(dvalues, op.outputs[1], k)


# --------------------------------------------------------------------------------------------------
# High-level API


def _kn_view(shape: tf.TensorShape, axis: int, caller: str = "") -> tuple[int, int]:
    """K and N of the `[K, N]` view of a kernel of `shape` grouped along `axis` (in range):
    K = prod(shape[:axis+1]), N = prod(shape[axis+1:]).

    Raises:
        ValueError: `shape[axis]` is not a multiple of 4 (the view's groups would straddle the
            axis); the message starts with `caller`.
    """
    if shape[axis] % 4:
        raise ValueError(
            f"{caller}: the grouping axis must have a size that is a multiple of 4. Received: "
            f"kernel shape {shape}, axis={axis} (size {shape[axis]})"
        )
    return math.prod(shape[: axis + 1]), math.prod(shape[axis + 1 :])


class CompressedWeight(tf.experimental.ExtensionType):
    """A kernel stored in the sparse24/v1 format.

    Attributes:
        values: [N, K/2] kept elements of the kernel's [K, N] view.
        meta: [N, ceil(K/8)] uint8 in-group positions.
        shape: the dense kernel's shape.
        dtype: the dense kernel's dtype.
        axis: the grouping axis; K = prod(shape[:axis+1]), N = prod(shape[axis+1:]).
    """

    __name__ = "tf_sparse24.CompressedWeight"

    values: tf.Tensor
    meta: tf.Tensor
    shape: tf.TensorShape
    dtype: tf.DType
    axis: int = 0

    def __validate__(self):
        if not self.shape.is_fully_defined():
            raise ValueError(f"CompressedWeight needs a fully known shape. Received: {self.shape}")
        if not 0 <= self.axis < self.shape.rank:
            raise ValueError(f"axis {self.axis} is out of range for kernel shape {self.shape}")
        k, n = _kn_view(self.shape, self.axis, "CompressedWeight")
        if self.values.dtype != self.dtype or self.meta.dtype != tf.uint8:
            raise ValueError(
                f"CompressedWeight expects values of dtype {self.dtype.name} and uint8 meta. "
                f"Received: values {self.values.dtype.name}, meta {self.meta.dtype.name}"
            )
        for name, want in (("values", [n, k // 2]), ("meta", [n, math.ceil(k / 8)])):
            got = getattr(self, name).shape
            if not got.is_compatible_with(want):
                raise ValueError(
                    f"CompressedWeight: {name} must be {want} for kernel shape "
                    f"{tuple(self.shape.as_list())}, axis={self.axis} (K={k}, N={n}). "
                    f"Received: {name} shape {got.as_list()}"
                )

    @property
    def k(self) -> int:
        """Rows of the [K, N] view (the reduction size)."""
        return _kn_view(self.shape, self.axis)[0]

    @property
    def n(self) -> int:
        """Columns of the [K, N] view (the outputs)."""
        return _kn_view(self.shape, self.axis)[1]


def compress(w: tf.Tensor, axis: int = 0) -> CompressedWeight:
    """Compresses a 2:4 sparse kernel of any rank, grouped along `axis` (see docs/FORMAT.md).

    Args:
        w: the kernel (float32, bfloat16 or float16) with a static shape; 2:4 along `axis`.
        axis: its grouping axis (Dense: 0; ConvND [..., in, out]: rank - 2).

    Returns:
        A `CompressedWeight`.

    Raises:
        ValueError: if `shape[axis]` is not a multiple of 4 or `axis` is out of range.
        TypeError: if `axis` is not an integer (a bool is refused too).
        tf.errors.InvalidArgumentError: if `w` is not 2:4; the message names row k, column n and
            group g of the [K, N] view.
    """
    w = tf.convert_to_tensor(w)
    shape = w.shape
    if not shape.is_fully_defined():
        raise ValueError(f"compress needs a kernel with a fully known shape. Received: {shape}")
    if not is_integer_axis(axis):
        raise TypeError(
            f"compress expects an integer axis. Received: axis={axis!r}, kernel shape {shape}"
        )
    if not -shape.rank <= axis < shape.rank:
        raise ValueError(f"axis {axis} is out of range for kernel shape {shape}")
    axis = int(axis) % shape.rank
    k, n = _kn_view(shape, axis, "compress")
    values, meta = sparse24_compress(tf.reshape(w, [k, n]))
    return CompressedWeight(values=values, meta=meta, shape=shape, dtype=w.dtype, axis=axis)


def decompress(cw: CompressedWeight) -> tf.Tensor:
    """The dense kernel of `cw` (its original shape; +0.0 where nothing is kept)."""
    return tf.reshape(sparse24_decompress(cw.values, cw.meta, cw.k), cw.shape)


def sparse_matmul(x: tf.Tensor, cw: CompressedWeight) -> tf.Tensor:
    """`tensordot(x, W, axis + 1)` with W given compressed: the contraction a layer does.

    Args:
        x: [..., *shape[:axis+1]] (Dense: [..., in]; MHA output projection: [..., heads, dim]).
        cw: the compressed kernel.

    Returns:
        [..., *shape[axis+1:]] in `cw.dtype`.

    Raises:
        TypeError: x is a tensor of another dtype than `cw.dtype` (no implicit promotion, as in
            `tf.linalg.matmul`; numpy arrays and Python numbers are converted to `cw.dtype`).
        ValueError: x does not end with the kernel's contracted dims.
    """
    if tf.is_tensor(x) and x.dtype != cw.dtype:
        raise TypeError(
            f"sparse_matmul: x is {x.dtype.name} but the compressed kernel is {cw.dtype.name}; "
            f"cast one to the other's dtype (tf.cast(x, {cw.dtype.name!r})). Received: x shape "
            f"{x.shape}, kernel shape {cw.shape}"
        )
    x = tf.convert_to_tensor(x, dtype=cw.dtype)
    contracted = cw.shape[: cw.axis + 1]
    if x.shape.rank is not None and not x.shape[
        x.shape.rank - len(contracted) :
    ].is_compatible_with(contracted):
        raise ValueError(
            f"sparse_matmul: x must end with the kernel's contracted dims {contracted.as_list()}. "
            f"Received: x shape {x.shape}, kernel shape {cw.shape}, axis={cw.axis}"
        )
    batch = tf.shape(x)[: tf.rank(x) - len(contracted)]
    x2 = tf.reshape(x, tf.concat([batch, [cw.k]], axis=0)) if len(contracted) > 1 else x
    y = sparse24_matmul(x2, cw.values, cw.meta)
    if cw.shape.rank - cw.axis - 1 == 1:
        return y
    out_dims = tf.constant(cw.shape[cw.axis + 1 :].as_list(), tf.int32)
    return tf.reshape(y, tf.concat([batch, out_dims], axis=0))


# Register the ops at import: `import tf_sparse24` is all an accelerated SavedModel needs to load.
# Without a usable library the pure-Python parts still work; the import says why, and every op
# call raises it.
try:
    load_library()
except OpLibraryError as error:
    warnings.warn(
        f"{error} Until then the ops (accelerated exports, tf_sparse24.ops) raise this error; "
        "pruning, training and portable exports work.",
        stacklevel=2,
    )
