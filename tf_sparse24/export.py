"""SavedModel export of 2:4-pruned Keras models with compressed weights, and the checking loader.

`export` writes a SavedModel (TensorFlow Serving layout: `export_dir` is a numeric version
directory) that stores every 2:4 kernel in `sparse24/v1` form (`values` + `meta`, about 0.53x of the
dense bytes for float32) and every other model variable as a plain copy. The saved object is a
`tf.Module` that owns only these `tf.Variable`s; its serving function runs the Keras model under
`keras.StatelessScope`, mapping each Keras variable to a tensor built from the stored ones, so the
Keras variables are never captured and nothing is saved twice. This works for any layer type.

Modes:
* `portable`: stock TensorFlow ops only, so stock TensorFlow Serving, `saved_model_cli` and
  `tf.saved_model.load` without this package serve it. Each pruned kernel is decompressed once,
  when the SavedModel loads (`tf_sparse24.portable.decompress` in a resource initializer), into an
  in-memory dense kernel: small on disk, dense speed and dense memory when serving.
* `accelerated`: every pruned kernel of a `keras.layers.Dense` layer, and of a
  `keras.layers.EinsumDense` whose equation is a matmul after reshapes (`einsum_matmul`; this
  includes the query/key/value/output projections of `MultiHeadAttention`), is multiplied with
  `Sparse24MatMul` on the compressed weights at every call (compressed in memory). This holds
  wherever the layer is called: Functional, Sequential and subclassed models, nested models,
  custom layers, `Sparse24` wrappers. While `serve` is traced, each such layer's `call` is replaced
  (an instance attribute, removed again after the trace) by one that runs `Sparse24MatMul` then
  the layer's bias and activation. Every other compressed kernel (Conv, RNN kernels, other
  EinsumDense equations, a kernel also read outside its layer's call) is decompressed at load
  with `Sparse24Decompress` (kernels of LoRA-enabled or quantized layers are not compressed).
  Loading needs the op library (`import tf_sparse24`; TF Serving: link `//cc:sparse24_ops`).
  The metadata records, per weight, `kernel`: "sparse24_matmul" or "dense_at_load".

Example:
    >>> tf_sparse24.export(pruned_model, "models/mnist/1")
    >>> served = tf_sparse24.load("models/mnist/1")
    >>> served.signatures["serving_default"](pixels=x)["logits"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import UninitializedVariable

from tf_sparse24 import format as fmt
from tf_sparse24 import metadata as md
from tf_sparse24 import portable
from tf_sparse24.atomic_dir import check_replaceable, write_atomically
from tf_sparse24.layer_calls import calls_replaced
from tf_sparse24.masks import parse_pattern
from tf_sparse24.metadata import ExportError
from tf_sparse24.registry import eligible_weights, own_variables, quantized_layers
from tf_sparse24.signature import (
    flat_outputs,
    functional_view,
    input_specs,
    model_arguments,
    signature_output_names,
    unique_names,
)
from tf_sparse24.wrapper import Sparse24, walk_layers

SIGNATURE = "serving_default"
ACCELERATED_OPS = frozenset({"Sparse24MatMul", "Sparse24Decompress"})


@dataclasses.dataclass
class _Sparse:
    """One 2:4 weight of the model and its compressed form, as the variables the SavedModel stores
    (made from the compressed numpy arrays, which are then dropped: one copy while exporting)."""

    name: str  # unique label, the Keras variable path
    layer: keras.layers.Layer  # the (unwrapped) layer that owns the weight
    variable: keras.Variable
    mask: keras.Variable | None  # the wrapper's mask (mapped to ones: the weight is already masked)
    axis: int
    pattern: str
    values: tf.Variable
    meta: tf.Variable
    effective: Callable[[], Any]  # the value the forward uses, in the variable's dtype

    @property
    def k(self) -> int:
        return math.prod(self.variable.shape[: self.axis + 1])


def export(
    model: keras.Model,
    export_dir: str | os.PathLike,
    mode: str = "portable",
    overwrite: bool = False,
    input_signature: (list[tf.TensorSpec] | tf.TensorSpec | dict[str, tf.TensorSpec]
                      | None) = None,
) -> dict[str, Any]:
    """Exports a pruned (or stripped) Keras model as a SavedModel with compressed 2:4 weights.

    The weights stored compressed are the pruned weights of every `Sparse24` wrapper (their
    effective, masked values) and every registry-eligible kernel of a plain layer that is exactly
    2:4 along its reduction axis (so `strip(model)` exports the same way). Everything else is
    stored dense. The directory is written next to `export_dir` under a temporary name and renamed
    into place, so a failed export leaves nothing behind.

    Args:
        model: a built Keras model. Functional and Sequential models take their signature from
            `model.input`; subclassed models need `input_signature`.
        export_dir: the version directory to create, e.g. `models/my_model/1`.
        mode: "portable" (stock TF ops only) or "accelerated" (`Sparse24MatMul`, needs the ops).
        overwrite: replace an existing `export_dir` (atomically: the old one is renamed away, the
            new one renamed in, then the old one deleted) if it is a previous export, an empty
            directory or a file; any other directory is refused.
        input_signature: named `tf.TensorSpec`s of the model's inputs (a list, or one spec),
            overriding `model.input`; a dict `{name: tf.TensorSpec}` for a (subclassed) model
            called with a dict.

    Returns:
        The metadata written to `assets/sparse24.json`.

    Raises:
        ValueError: bad mode or model, a pruned weight that is not 2:4, a model without any 2:4
            weight (export a dense model with `model.export` instead), stateful RNN layers, a
            TimeDistributed layer served with an unknown number of time steps (Keras 3.15
            computes it wrongly in a traced function).
        FileExistsError: `export_dir` exists and `overwrite` is False, or it is a directory
            that is neither empty nor a SavedModel.
    """
    if mode not in md.MODES:
        raise ValueError(f"mode must be one of {md.MODES}. Received: mode={mode!r}")
    if not isinstance(model, keras.Model):
        raise ValueError(f"export expects a keras.Model. Received: {type(model).__name__}")
    if not model.built:  # (a subclassed model loaded from a file whose build() could not run)
        raise ValueError(
            f"export() needs a built model: call model {model.name!r} on data first (a subclassed "
            "model taking several inputs needs a build() taking their shapes to be rebuilt when "
            "loaded; see docs/USAGE.md)"
        )
    export_dir = os.path.abspath(os.fspath(export_dir))
    if os.path.lexists(export_dir) and not overwrite:  # a dangling link too
        raise FileExistsError(f"{export_dir} exists; pass overwrite=True to replace it")
    check_replaceable(export_dir)
    if not os.path.basename(export_dir).isdigit():
        warnings.warn(
            f"export_dir {export_dir!r} is not a numeric version directory: TensorFlow Serving "
            "serves only <model>/<number>/ (e.g. models/my_model/1). tf.saved_model.load reads "
            "it anyway.",
            stacklevel=2,
        )
    model = functional_view(model)
    stateful = [
        layer.name for layer in model._flatten_layers(include_self=False)
        if getattr(layer, "stateful", False)
    ]
    if stateful:  # Keras keeps their state variables out of model.variables: nothing to save
        raise ValueError(
            f"model {model.name!r} has stateful RNN layers {stateful}: a served signature has no "
            "state between requests. Export a copy built with stateful=False."
        )
    specs = input_specs(model, input_signature)
    keys = [s.name for s in specs] if isinstance(input_signature, dict) else None
    sparse = _sparse_weights(model)
    if not sparse and (quantized := quantized_layers(model)):
        raise ValueError(
            f"model {model.name!r} has no 2:4 sparse float weights to compress: its layers "
            f"{quantized} are quantized (model.quantize), and tf_sparse24.export compresses float "
            "kernels only. Export it with Keras' model.export(): quantizing a stripped model "
            "keeps its 2:4 zeros."
        )
    if not sparse:
        raise ValueError(
            f"model {model.name!r} has no 2:4 sparse weights to compress: prune it with "
            "tf_sparse24.prune (and fine-tune) first, or export the dense model with model.export()"
        )
    ops = None
    if mode == "accelerated":
        from tf_sparse24 import ops  # noqa: PLC0415  (the op library is only needed here)

        ops.load_library()

    return write_atomically(
        export_dir, lambda tmp: _write(model, tmp, mode, specs, keys, sparse, ops)
    )


def load(export_dir: str | os.PathLike) -> Any:
    """Loads an export of either mode and checks its metadata, its graph's and every tensor's
    checksum.

    Args:
        export_dir: the version directory written by `export`.

    Returns:
        The loaded object (`tf.saved_model.load`): `.signatures["serving_default"]`, the stored
        variables, `.metadata()` (the embedded JSON) and `.sparse24_metadata` (the parsed dict).

    Raises:
        ExportError: missing, unparsable, edited or unsupported metadata, unreadable variables, a
            tensor whose sha256 differs from the metadata (the message names the tensor), or a
            `saved_model.pb` or asset file whose sha256 differs from `assets.extra/SHA256SUMS`.
    """
    export_dir = os.fspath(export_dir)
    metadata = md.read(export_dir)
    if not md.check_checksums(export_dir):
        warnings.warn(
            f"{export_dir} has no {md.CHECKSUMS} (exported before 2026-12-01): the "
            "tensors and metadata are checked, the graph (saved_model.pb) is not",
            stacklevel=2,
        )
    if metadata["mode"] == "accelerated":
        from tf_sparse24 import ops  # noqa: PLC0415

        ops.load_library()
    try:
        loaded = tf.saved_model.load(export_dir)
    except Exception as e:  # noqa: BLE001  (TF raises OpError, IndexError, ... on a bad file)
        raise ExportError(
            f"cannot load the SavedModel in {export_dir}: "
            f"{_unreadable_tensor(export_dir, metadata)}{type(e).__name__}: {e}"
        ) from e
    embedded = loaded.metadata().numpy().decode("utf-8")
    if md.loads(embedded, "embedded metadata") != metadata:
        raise ExportError(
            f"{md.path_in(export_dir)} differs from the metadata embedded in saved_model.pb: "
            "the file was edited or corrupted"
        )
    stored = _stored_tensors(loaded, metadata)
    for record, variable in stored:
        value = host_array(variable)  # a view of the variable's buffer: no copy on CPU
        if list(value.shape) != record["shape"] or value.dtype.name != record["dtype"]:
            raise ExportError(
                f"tensor {record['name']!r}: stored {value.dtype.name}{list(value.shape)}, "
                f"metadata says {record['dtype']}{record['shape']}"
            )
        if md.sha256(value) != record["sha256"]:
            raise ExportError(
                f"checksum mismatch for tensor {record['name']!r}: the stored variable's sha256 is "
                f"{md.sha256(value)}, the metadata says {record['sha256']}; the variables were "
                "modified or corrupted"
            )
    # Not through the tracking __setattr__, which would wrap the dict (json.dumps refuses that).
    object.__setattr__(loaded, "sparse24_metadata", metadata)
    return loaded


def _unreadable_tensor(export_dir: str, metadata: dict[str, Any]) -> str:
    """Names a missing data file of the checkpoint, else the first stored tensor the checkpoint
    reader cannot read back, if any."""
    prefix = os.path.join(export_dir, "variables", "variables")
    if missing := _missing_shards(prefix):
        return f"{missing} is missing; "
    try:
        reader = tf.train.load_checkpoint(prefix)
        keys = sorted(reader.get_variable_to_shape_map(), key=lambda k: (k.startswith("_"), k))
    except Exception as e:  # noqa: BLE001
        return f"the variables index is unreadable ({type(e).__name__}); "
    records = {"sparse_values": [e["values"] for e in metadata["sparse"]],
               "sparse_meta": [e["meta"] for e in metadata["sparse"]],
               "dense": metadata["dense"]}
    for key in keys:
        try:
            reader.get_tensor(key)
        except Exception:  # noqa: BLE001
            group, _, index = key.partition("/")
            index = index.split("/")[0]
            if group in records and index.isdigit() and int(index) < len(records[group]):
                name = records[group][int(index)]["name"]
                return f"tensor {name!r} (checkpoint key {key!r}) is corrupted; "
            return f"checkpoint key {key!r} is corrupted; "
    return ""


def _missing_shards(prefix: str) -> str | None:
    """The first data file (`prefix.data-00000-of-00001`, ...) of a checkpoint that is not there,
    judged from the shard count the present ones carry in their names; None if all are there.
    (The reader reports a missing one as an unreadable tensor.)"""
    names = [os.path.basename(p) for p in tf.io.gfile.glob(f"{prefix}.data-?????-of-?????")]
    counts = {int(name[-5:]) for name in names} or {1}
    for count in sorted(counts):
        for shard in range(count):
            path = f"{prefix}.data-{shard:05d}-of-{count:05d}"
            if not tf.io.gfile.exists(path):
                return path
    return None


def _stored_tensors(loaded: Any, metadata: dict[str, Any]) -> list[tuple[dict, tf.Variable]]:
    """(metadata record, loaded variable) for every stored tensor."""
    counts = (len(loaded.sparse_values), len(loaded.sparse_meta), len(loaded.dense))
    expected = (len(metadata["sparse"]),) * 2 + (len(metadata["dense"]),)
    if counts != expected:
        raise ExportError(
            f"the SavedModel stores {counts} (values, meta, dense) tensors, the metadata lists "
            f"{expected}"
        )
    pairs = []
    for entry, values, meta in zip(metadata["sparse"], loaded.sparse_values, loaded.sparse_meta):
        pairs += [(entry["values"], values), (entry["meta"], meta)]
    pairs += list(zip(metadata["dense"], loaded.dense))
    return pairs


def graph_ops(export_dir: str | os.PathLike) -> set[str]:
    """Op types used anywhere in a SavedModel (every graph and every library function)."""
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(os.fspath(export_dir), "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    ops, functions = set(), set()
    for graph in proto.meta_graphs:
        ops |= {node.op for node in graph.graph_def.node}
        for function in graph.graph_def.library.function:
            functions.add(function.signature.name)
            ops |= {node.op for node in function.node_def}
    return ops - functions  # calls of library functions appear as ops named after them


def nonstock_ops(ops: set[str]) -> set[str]:
    """The ops not registered by stock TensorFlow (`tf.raw_ops` lists every stock op).

    Custom op libraries never add to `tf.raw_ops`, so this holds in any process.
    """
    return {op for op in ops if not hasattr(tf.raw_ops, op)}


# --- Finding and compressing the 2:4 weights --------------------------------------------------


def _compress(
    name: str, value: np.ndarray, axis: int, pattern: str = "2:4"
) -> tuple[np.ndarray, np.ndarray]:
    try:
        return fmt.compress(fmt.to_2d(value, axis))
    except ValueError as e:
        why = "" if _always_2to4(pattern) else (
            f" It was pruned with pattern {pattern!r}, which can keep more than 2 of 4 "
            "consecutive weights; sparse24/v1 stores only 2:4: prune() with a pattern that is "
            "always 2:4 ('2:4', '1:4', '2:8', ...) to export it compressed."
        )  # fmt: skip
        raise ValueError(
            f"weight {name!r} (shape {list(value.shape)}, axis {axis}): {e}.{why}"
        ) from e


def _always_2to4(pattern: str) -> bool:
    """Whether every mask of `pattern` (N:M, groups of M from the axis' start) keeps at most 2 of
    each 4 consecutive elements from the start: the most any aligned window of 4 can hold."""
    n, m = parse_pattern(pattern)
    period = math.lcm(4, m)
    for start in range(0, period, 4):
        kept = 0
        for group in range(start // m, (start + 3) // m + 1):
            overlap = min(start + 4, (group + 1) * m) - max(start, group * m)
            kept += min(n, overlap)
        if kept > 2:
            return False
    return True


def _sparse_weights(model: keras.Model) -> list[_Sparse]:
    """In model order: the pruned weights of wrappers, the exactly-2:4 eligible kernels of plain
    layers."""
    layers = walk_layers(model)  # nested models and custom layers too; wrappers are not entered
    wrappers = [layer for layer in layers if isinstance(layer, Sparse24)]
    wrapped = {id(layer.layer) for layer in wrappers}
    # A weight is compressed once: a wrapped one as its masked value, a plain one where first
    # reached (MultiHeadAttention before its EinsumDense sublayers).
    claimed = {id(pw.variable) for layer in wrappers for pw in layer.pruned_weights}
    found: list[_Sparse] = []
    for layer in layers:
        if isinstance(layer, Sparse24):
            for pw in layer.pruned_weights:
                effective = functools.partial(layer.effective_weight, pw)
                value = _as_computed(layer.layer, pw.variable, effective())
                values, meta = _stored(*_compress(pw.variable.path, value, pw.axis, pw.pattern))
                found.append(_Sparse(pw.variable.path, layer.layer, pw.variable, pw.mask,
                                     pw.axis % value.ndim, pw.pattern, values, meta, effective))
        elif id(layer) not in wrapped and not isinstance(layer, keras.Model):
            for _, variable, axis in eligible_weights(layer):
                if id(variable) in claimed:
                    continue
                claimed.add(id(variable))
                value = _as_computed(layer, variable, variable.value)
                try:
                    values, meta = _stored(*fmt.compress(fmt.to_2d(value, axis)))
                except ValueError:  # not 2:4 (a dense kernel): stored as is
                    _warn_if_drifted(variable.path, fmt.to_2d(value, axis))
                    continue
                found.append(_Sparse(variable.path, layer, variable, None, axis % value.ndim,
                                     "2:4", values, meta, lambda v=variable: v.value))
    _dedupe_names(found)
    return found


def _stored(values: np.ndarray, meta: np.ndarray) -> tuple[tf.Variable, tf.Variable]:
    """The variables that store a compressed weight in the SavedModel."""
    return tf.Variable(values, trainable=False), tf.Variable(meta, trainable=False)


def host_array(value) -> np.ndarray:
    """A tensor's or variable's value as a read-only numpy array over TensorFlow's buffer (no copy
    on CPU): `.numpy()` would copy every weight and stored tensor once more while exporting, and
    every stored tensor while `load` checks its checksum."""
    value = tf.convert_to_tensor(value)
    try:
        return np.frombuffer(value, dtype=value.dtype.as_numpy_dtype).reshape(value.shape)
    except (BufferError, TypeError, ValueError):  # no buffer protocol for it: a copy
        return value.numpy()


def _warn_if_drifted(name: str, w: np.ndarray, tiny: float = 1e-3) -> None:
    """Warns when a plain kernel that is not exactly 2:4 is 2:4 up to tiny values in most groups:
    a pruned kernel trained on after `strip()` (no masks: its zeros drift away from zero). It is
    stored dense, which the user most likely did not mean; a dense kernel has almost no such
    group (two of four values below `tiny` of the largest)."""
    k, n = w.shape
    if k % 4 or not w.size:
        return
    big = np.abs(w) > tiny * np.abs(w).max()
    near = (big.reshape(k // 4, 4, n).sum(axis=1) <= 2).mean()
    if near >= 0.5:
        warnings.warn(
            f"export: weight {name!r} is stored dense: it is not exactly 2:4, but {near:.0%} of "
            f"its groups are 2:4 up to values below {tiny:g} of its largest (a pruned kernel "
            "trained after strip(), without masks?). prune() the model again (and fine-tune it "
            "with its masks) to store it compressed.",
            stacklevel=4,
        )


def _as_computed(layer: keras.layers.Layer, variable: keras.Variable, value) -> np.ndarray:
    """`value` in the dtype the layer multiplies `variable` in: a float32 weight of a layer (or
    sublayer) that computes in float16 / bfloat16 under mixed precision is cast to that dtype, as
    Keras autocasts it at every call. So it is stored at half the bytes, `Sparse24MatMul` reads it
    without a per-call cast, and the served results are the same as with the float32 weight. (A
    weight that something also uses at full precision is found when the serving function is
    traced, and stored in float32 again: `_used_uncast`.)"""
    owner = next(
        (sub for sub in layer._flatten_layers(include_self=True)
         if any(v is variable for v in own_variables(sub))),
        layer,
    )
    dtype = owner.compute_dtype
    value = tf.convert_to_tensor(value)
    if (
        variable.dtype == "float32"
        and dtype in ("float16", "bfloat16")
        and getattr(variable, "_autocast", True)
        and getattr(owner, "autocast", True)  # Dense(autocast=False) multiplies it in float32
    ):
        value = tf.cast(value, dtype)  # as Keras' autocast does
    return host_array(value)


def _dedupe_names(items: list) -> None:
    for item, name in zip(items, unique_names([item.name for item in items])):
        item.name = name


# --- Building and writing the SavedModel -----------------------------------------------------


class _DenseKernel(tf.saved_model.experimental.TrackableResource):
    """A pruned kernel rebuilt once, when the SavedModel loads, into a dense variable.

    Only `values` and `meta` hold the kernel: `variable` has the kernel's full shape (Keras'
    `TFSMLayer` copies a loaded model's variables by shape) but no value in the checkpoint
    (`_unsaved`: 0 bytes).
    Loading (`tf.saved_model.load`, or the init op that TensorFlow Serving and `saved_model_cli`
    run after restoring the variables) calls `_initialize`, which decompresses into it; serving
    then reads a plain dense kernel, so a layer runs at dense speed. The variable is an ordinary
    one of the loaded object, kept alive by the functions that read it and freed with them. (A
    variable shared by name, as this was until 2026-12-01, was never freed: TensorFlow gives each
    load its own name, so every load in a process added one dense copy for good.) This resource
    only carries the initializer; its own handle names a variable that is never assigned, so it
    holds no memory (`_create_resource` must make a handle in the graph being saved, where the
    variable's own handle is not available).
    """

    def __init__(self, values, meta, k: int, shape, dtype, decompress):
        self._values, self._meta, self._k, self._shape = values, meta, k, list(shape)
        self._dtype = tf.as_dtype(dtype)  # the Keras variable's (values may be stored narrower)
        self._decompress = decompress
        # Uninitialized (TensorFlow's class for variables restored later; private, pinned with
        # TF 2.21): a zero-filled one would hold a dense kernel's bytes while exporting.
        self.variable = _unsaved(
            UninitializedVariable(shape=self._shape, dtype=self._dtype, trainable=False)
        )
        self._unused_name = f"tf_sparse24_unused_{uuid.uuid4().hex}"
        super().__init__()
        self._track_trackable(self.variable, name="variable")

    def _create_resource(self):
        return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=self._unused_name)

    def _initialize(self):
        dense = tf.reshape(self._decompress(self._values, self._meta, self._k), self._shape)
        return self.variable.assign(tf.cast(dense, self._dtype))

    def read(self) -> tf.Tensor:
        return self.variable.value()


def _unsaved(variable: tf.Variable) -> tf.Variable:
    """`variable`, kept out of the SavedModel's checkpoint: both the object-based one
    (`tf.saved_model.load`) and the `saver_def` a session loader restores (TensorFlow Serving),
    which TensorFlow builds from the variable's copy in the exported graph. Its shape and dtype stay
    in the object graph; the value is left uninitialized until something assigns it.

    Uses TensorFlow's per-object hooks (`_serialize_to_tensors`, which TensorFlow looks up on the
    instance first, and `_export_to_saved_model_graph`), pinned with TensorFlow 2.21.
    """
    export_to_graph = variable._export_to_saved_model_graph

    def export_unsaved(object_map=None, tensor_map=None, options=None, **kwargs):
        handles = export_to_graph(object_map=object_map, tensor_map=tensor_map, options=options,
                                  **kwargs)
        object_map[variable]._serialize_to_tensors = dict
        return handles

    variable._serialize_to_tensors = dict
    variable._export_to_saved_model_graph = export_unsaved
    return variable


def einsum_matmul(equation: str) -> int | None:
    """How many leading kernel axes an EinsumDense equation contracts, if it is a plain matmul.

    A plain matmul after reshapes: the contracted kernel axes lead the kernel, the input ends with
    them in the same order, and the output is the input's free axes then the kernel's free axes
    ("abc,cde->abde", "abcd,cde->abe", "...b,bc->...c"). Then `y = reshape(reshape(x, [..., K])
    @ W[K, N], [..., *free kernel dims])`, with W the `format.to_2d` view. Other equations
    (transposed outputs, axes shared by input, kernel and output) return None.
    """
    match = re.fullmatch(r"((?:\.\.\.)?[a-zA-Z]*),([a-zA-Z]+)->((?:\.\.\.)?[a-zA-Z]*)",
                         equation.replace(" ", ""))
    if match is None:
        return None
    inputs, kernel, output = match.groups()
    contracted = next((i for i, c in enumerate(kernel) if c in output), len(kernel))
    lead, free = kernel[:contracted], kernel[contracted:]
    letters = inputs.replace(".", "")
    if (
        not lead
        or len(set(letters)) != len(letters)
        or len(set(kernel)) != len(kernel)
        or not inputs.endswith(lead)
        or output != inputs[: len(inputs) - len(lead)] + free
        or set(free) & set(letters)
    ):
        return None
    return len(lead)


@dataclasses.dataclass
class _SparseCall:
    """A replacement `call` for one Dense / EinsumDense layer: `Sparse24MatMul` on the stored
    `values` / `meta`, then the layer's own bias and activation (as Keras' `call` adds them)."""

    layer: keras.layers.Layer
    contracted: int  # leading kernel axes summed over (Dense: 1)
    values: tf.Variable
    meta: tf.Variable
    ops: Any

    def __call__(self, inputs, training=None):  # `training`: Keras passes it to every call
        layer, c = self.layer, self.contracted
        if isinstance(inputs, tf.SparseTensor):
            # Keras' own call (a sparse matmul) on the kernel: the export sees the kernel read,
            # and traces again with it decompressed at load.
            return type(layer).call(layer, inputs)
        kernel_shape = list(layer.kernel.shape)
        k, free = math.prod(kernel_shape[:c]), kernel_shape[c:]
        # Integer inputs (a lookup's one-hot) are promoted as Keras' matmul promotes them.
        x = inputs if inputs.dtype.is_floating else tf.cast(inputs, layer.compute_dtype)
        batch = tf.shape(x)[:-c]
        if c != 1:
            x = tf.reshape(x, tf.concat([batch, [k]], axis=0))
        if not getattr(layer, "autocast", True):
            # The layer multiplies its own (float32) kernel: Keras' matmul promotes x to it.
            x = tf.cast(x, keras.backend.result_type(x.dtype, self.values.dtype))
        y = self.ops.sparse24_matmul(x, tf.cast(self.values, x.dtype), self.meta)
        if len(free) != 1:
            y = tf.reshape(y, tf.concat([batch, free], axis=0))
            y.set_shape(inputs.shape[:-c] + free)
        if layer.bias is not None:
            y = keras.ops.add(y, layer.bias)
        return layer.activation(y) if layer.activation is not None else y


def _sparse_call(item: _Sparse, values: tf.Variable, meta: tf.Variable, ops) -> _SparseCall | None:
    """The `_SparseCall` that computes `item`'s layer from its stored form, or None if the kernel
    belongs to no plain Dense / EinsumDense (sub)layer that is a matmul (then: dense at load)."""
    for layer in [item.layer, *walk_layers(item.layer)]:
        if (
            type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)  # not subclasses
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
            and getattr(layer, "kernel", None) is item.variable
            and tf.as_dtype(layer.compute_dtype) in ops.DTYPES  # not float64
        ):
            if isinstance(layer, keras.layers.EinsumDense):
                contracted = einsum_matmul(layer.equation)
            else:
                contracted = 1 if item.variable.ndim == 2 else None
            if contracted is None or contracted != item.axis + 1:
                return None
            return _SparseCall(layer, contracted, values, meta, ops)
    return None


def _reachable_ops(tensors) -> set[str]:
    """Names of every op the `tensors` depend on (data and control inputs), in one graph."""
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            stack += [t.op for t in op.inputs] + list(op.control_inputs)
    return seen


def _serving_function(model, specs, keys, output_names, module, sparse, dense_vars, calls,
                      decompress):
    """`serving_default` over the module's variables: `calls[i]` runs sparse weight i with
    `Sparse24MatMul`, every other sparse weight is read from a `_DenseKernel` rebuilt at load.

    Returns `(tf.function, {i: _DenseKernel}, read, wide)`; once traced, `read` holds the `calls`
    whose dense kernel the outputs still depend on (read by something other than the replaced
    `call`), `wide` the weights stored in 16 bits that something uses at full precision.
    """
    caches = {
        i: _DenseKernel(module.sparse_values[i], module.sparse_meta[i], s.k,
                        s.variable.shape, s.variable.dtype, decompress)
        for i, s in enumerate(sparse)
        if i not in calls
    }  # fmt: skip
    read, wide = set(), set()

    def serve(*inputs):
        mapping, stand_ins, reads, ones = [], {}, {}, {}
        for i, s in enumerate(sparse):
            if i in calls:
                # Never read by a replaced call; mapped so that the Keras variable is not captured
                # (a wrapper still computes its masked value, which nothing uses).
                stand_ins[i] = tf.zeros(s.variable.shape, s.variable.dtype)
                mapping.append((s.variable, stand_ins[i]))
            else:
                reads[i] = caches[i].read()
                mapping.append((s.variable, reads[i]))
            if s.mask is not None:
                ones[i] = tf.ones(s.mask.shape, s.mask.dtype)
                mapping.append((s.mask, ones[i]))
        mapping += list(zip(dense_vars, (tf.identity(v) for v in module.dense)))
        replaced = [(call.layer, call) for call in calls.values()]
        with keras.StatelessScope(state_mapping=mapping), calls_replaced(replaced):
            outputs = model(*model_arguments(model, list(inputs), keys), training=False)
        flat, _ = flat_outputs(outputs)
        needed = _reachable_ops(flat)
        read.update(i for i, t in stand_ins.items() if t.op.name in needed)
        wide.update(
            i for i, t in reads.items()
            if sparse[i].values.dtype != t.dtype
            and _used_uncast(t, sparse[i].values.dtype, needed, ones.get(i))
        )  # fmt: skip
        return dict(zip(output_names, flat))

    return tf.function(serve, input_signature=specs, autograph=False), caches, read, wide


def _keras_serve(model, specs, keys, serving, output_names, output_structure) -> tf.function:
    """The `serve` endpoint, as Keras' `model.export` writes it: called as the model is (one input
    structure: a tensor, a list, a dict), returning the model's output structure, so
    `keras.layers.TFSMLayer` can call it. It runs `serving` (the flat, named signature)."""
    arguments = model_arguments(model, specs, keys)

    def serve(*args):
        flat = [args[0][k] for k in keys] if keys is not None else keras.tree.flatten(args)
        named = serving(*flat)
        return keras.tree.pack_sequence_as(output_structure, [named[n] for n in output_names])

    return tf.function(serve, input_signature=list(arguments), autograph=False)


def _used_uncast(
    tensor: tf.Tensor, dtype, needed: set[str] | None, mask: tf.Tensor | None
) -> bool:
    """Whether an op the outputs need uses a weight's `tensor` other than cast to `dtype` (how a
    16-bit layer uses it), looking through identities, the product with its mask of ones and into
    while loops (an RNN's body): then its values must not be stored in `dtype`."""

    def source(t):
        while t.op.type in ("Cast", "Identity"):
            t = t.op.inputs[0]
        return t.op.name

    for op in tensor.consumers():
        if (needed is not None and op.name not in needed) or (
            op.type == "Cast" and op.get_attr("DstT") == dtype
        ):
            continue
        if op.type in ("While", "StatelessWhile"):
            if _used_uncast_in_loop(op, tensor, dtype):
                return True
            continue
        by_mask = (op.type == "Mul" and mask is not None
                   and any(source(x) == mask.op.name for x in op.inputs))
        if not (op.type == "Identity" or by_mask):
            return True
        if any(_used_uncast(out, dtype, needed, mask) for out in op.outputs):
            return True
    return False


def _used_uncast_in_loop(loop: tf.Operation, tensor: tf.Tensor, dtype) -> bool:
    """`_used_uncast` for a loop variable: inside the body, and after the loop. Anything this
    cannot see into counts as a use at full precision."""
    try:
        body = loop.graph._get_function(loop.get_attr("body").name).graph
    except (AttributeError, KeyError, ValueError):  # private TF API: be safe
        return True
    for i, x in enumerate(loop.inputs):
        if x is tensor and (
            _used_uncast(body.inputs[i], dtype, None, None)
            or _used_uncast(loop.outputs[i], dtype, None, None)
        ):
            return True
    return False


def _write(model, directory, mode, specs, keys, sparse, ops) -> dict[str, Any]:
    module = tf.Module()
    module.sparse_values = [s.values for s in sparse]
    module.sparse_meta = [s.meta for s in sparse]
    replaced = {id(s.variable) for s in sparse} | {id(s.mask) for s in sparse if s.mask is not None}
    dense_vars = []
    for variable in model.variables:
        if id(variable) not in replaced and all(variable is not v for v in dense_vars):
            dense_vars.append(variable)
    # Not a copy in memory: TensorFlow assigns the Keras variable's tensor, sharing its buffer.
    module.dense = [tf.Variable(v.value, trainable=False) for v in dense_vars]
    # Lookup tables (StringLookup, IntegerLookup, TextVectorization): resources that are not
    # variables; the served function uses them, so the SavedModel must hold them (and their
    # vocabulary).
    module.tables = _table_resources(model)

    output_structure = _probe_outputs(model, specs, keys)
    output_names = signature_output_names(model, output_structure)
    calls = {}  # index in `sparse` -> its _SparseCall
    if mode == "accelerated":
        for i, s in enumerate(sparse):
            call = _sparse_call(s, module.sparse_values[i], module.sparse_meta[i], ops)
            if call is not None:
                calls[i] = call

    def decompress(values, meta, k):  # the op for its dtypes, stock ops for others (float64)
        if mode == "accelerated" and values.dtype in ops.DTYPES:
            return ops.sparse24_decompress(values, meta, k)
        return portable.decompress(values, meta, k)

    while True:
        serving, caches, read, wide = _serving_function(
            model, specs, keys, output_names, module, sparse, dense_vars, calls, decompress
        )
        with _time_steps_checked(model):
            serving.get_concrete_function()  # traces: fills `read` and `wide`
        if not read and not wide:
            break
        # Something besides the layer's call reads the dense kernel (a tied weight): such a
        # kernel is decompressed at load instead. Trace again without it.
        calls = {i: call for i, call in calls.items() if i not in read}
        for i in wide:  # ... and one a float32 layer reads is stored with its float32 values
            s = sparse[i]
            s.values, s.meta = _stored(*_compress(s.name, host_array(s.effective()), s.axis))
        # New lists: tracked lists are append-only.
        module.sparse_values = [s.values for s in sparse]
        module.sparse_meta = [s.meta for s in sparse]
    module.dense_kernels = list(caches.values())
    module.serve = _keras_serve(model, specs, keys, serving, output_names, output_structure)
    kernel = {
        id(s.variable): "sparse24_matmul" if i in calls else "dense_at_load"
        for i, s in enumerate(sparse)
    }

    metadata = _metadata(model, mode, specs, keys, serving, sparse, kernel, dense_vars,
                         module.dense)
    text = md.dumps(metadata)
    module.metadata = tf.function(lambda: tf.constant(text), input_signature=[])
    asset_dir = tempfile.mkdtemp(prefix=".sparse24-asset-", dir=os.path.dirname(directory))
    try:
        asset_path = os.path.join(asset_dir, md.FILENAME)
        with open(asset_path, "w", encoding="utf-8") as f:
            f.write(text)
        module.metadata_file = tf.saved_model.Asset(asset_path)
        tf.saved_model.save(module, directory, signatures={SIGNATURE: serving})
    finally:
        shutil.rmtree(asset_dir, ignore_errors=True)
    md.write_checksums(directory)
    return metadata


@functools.cache
def _time_distributed_maps_the_batch() -> bool:
    """Whether this Keras' TimeDistributed, traced with an unknown time axis, maps its layer over
    as many steps as the batch has rows (Keras 3.15: `ops.arange` of the input's first dimension,
    read before it is transposed to the time axis). Checked on a tiny layer, so a fixed Keras
    lifts the refusal below by itself."""
    layer = keras.layers.TimeDistributed(keras.layers.Identity())
    traced = tf.function(layer, input_signature=[tf.TensorSpec([None, None, 1])], autograph=False)
    return traced(tf.zeros([1, 2, 1])).shape[1] != 2


@contextlib.contextmanager
def _time_steps_checked(model: keras.Model):
    """Refuses (ValueError naming the layer and its input shape) a TimeDistributed layer that the
    serving function calls with an unknown number of time steps while Keras computes that wrongly
    (`_time_distributed_maps_the_batch`): the export would serve wrong outputs, silently."""
    layers = [layer for layer in model._flatten_layers()
              if isinstance(layer, keras.layers.TimeDistributed)]
    if not layers or not _time_distributed_maps_the_batch():
        yield
        return
    unknown = []

    def watched(layer):
        def call(inputs, *args, **kwargs):
            if inputs.shape.rank is not None and inputs.shape.rank > 1 and inputs.shape[1] is None:
                unknown.append((layer.name, tuple(inputs.shape)))
            return type(layer).call(layer, inputs, *args, **kwargs)
        return call

    with calls_replaced([(layer, watched(layer)) for layer in layers]):
        yield
    if unknown:
        name, shape = unknown[0]
        raise ValueError(
            f"layer {name!r} (TimeDistributed) is served with an unknown number of time steps "
            f"(input shape {shape}): Keras {keras.__version__} then applies its layer as many "
            "times as the batch has rows, not once per time step (a tf.function of the Keras "
            "model, and Keras' own model.export, give those wrong outputs too). Give the time "
            "axis a fixed size: keras.Input((steps, ...)), or export with input_signature="
            "[tf.TensorSpec([None, steps, ...], dtype, name=...)]."
        )


def _table_resources(model: keras.Model) -> list:
    """The non-variable TensorFlow resources the model's layers hold (lookup tables), each once."""
    found = {}
    for layer in model._flatten_layers():
        for value in vars(layer).values():
            if isinstance(value, tf.saved_model.experimental.TrackableResource):
                found[id(value)] = value
    return list(found.values())


def _probe_outputs(model: keras.Model, specs: list[tf.TensorSpec], keys: list[str] | None):
    """The model's output structure, from a symbolic call (no computation)."""
    try:
        return model.output
    except (AttributeError, ValueError):
        symbolic = [keras.KerasTensor([1, *s.shape[1:]], s.dtype.name) for s in specs]
        # Not `model(...)`: a symbolic call would give a subclassed model `input`s of its own.
        accepts = inspect.signature(model.call).parameters
        kwargs = {"training": False} if "training" in accepts else {}
        return model.compute_output_spec(*model_arguments(model, symbolic, keys), **kwargs)


def _metadata(model, mode, specs, keys, serving, sparse, kernel, dense_vars, stored) -> dict:
    """The export's metadata; `stored`: the variables holding `dense_vars`' values as saved."""
    import tf_sparse24  # noqa: PLC0415

    outputs = serving.get_concrete_function().structured_outputs
    entries = []
    for s in sparse:
        n = math.prod(s.variable.shape[s.axis + 1 :])
        entries.append({
            "name": s.name,
            "layer": s.layer.name,
            "shape": list(s.variable.shape),
            "dtype": s.values.dtype.name,
            "variable_dtype": keras.backend.standardize_dtype(s.variable.dtype),
            "axis": s.axis,
            "k": s.k,
            "n": n,
            "pattern": s.pattern,
            "kernel": kernel[id(s.variable)],
            "values": md.tensor_record(f"{s.name}:values", host_array(s.values)),
            "meta": md.tensor_record(f"{s.name}:meta", host_array(s.meta)),
        })
    return {
        "schema": md.SCHEMA,
        "format": md.FORMAT,
        "mode": mode,
        "package_version": tf_sparse24.__version__,
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        "model": model.name,
        "signature": {
            "name": SIGNATURE,
            "inputs": {s.name: _spec_record(s) for s in specs},
            "input_order": [s.name for s in specs],  # the JSON's keys are sorted
            "input_structure": "dict" if keys is not None else "model",
            "outputs": {name: _spec_record(t) for name, t in outputs.items()},
        },
        "sparse": entries,
        "dense": [
            md.tensor_record(v.path, host_array(copy)) for v, copy in zip(dense_vars, stored)
        ],
    }


def _spec_record(spec) -> dict[str, Any]:
    return {"shape": spec.shape.as_list(), "dtype": spec.dtype.name}
