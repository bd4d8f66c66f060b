"""Checking and describing exports: `verify` (checksums, 2:4 validity, ops, outputs) and `describe`.

Used by `python -m tf_sparse24 verify DIR` / `inspect DIR`; both work on either mode.

Example:
    >>> report = tf_sparse24.verify_export("models/mnist/1", against="mnist_pruned.keras")
    >>> print(tf_sparse24.describe_export("models/mnist/1"))
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_sparse24 import format as fmt
from tf_sparse24 import metadata as md
from tf_sparse24.export import (
    ACCELERATED_OPS,
    SIGNATURE,
    graph_ops,
    host_array,
    load,
    nonstock_ops,
)
from tf_sparse24.metadata import ExportError
from tf_sparse24.signature import (
    flat_outputs,
    functional_view,
    input_specs,
    model_arguments,
    model_input_names,
    positional_inputs,
    signature_output_names,
)


def verify(
    export_dir: str | os.PathLike,
    against: str | os.PathLike | keras.Model | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Checks an export end to end and returns what was checked.

    Checks: the metadata, the graph's and every tensor's sha256 (`tf_sparse24.load`), that every
    stored `meta` is valid `sparse24/v1` (each group's two positions strictly ascending, so the
    rebuilt weights are exactly 2:4), that a `portable` export uses only stock TensorFlow ops (an
    `accelerated` one only stock ops plus the two `Sparse24*` ops), and, with `against`, that
    `serving_default` matches the Keras model on random inputs within the dtype's tolerance.

    Args:
        export_dir: the version directory written by `tf_sparse24.export`.
        against: a Keras model or a `.keras` file to compare outputs with.
        seed: seed of the random comparison inputs.

    Returns:
        A dict: `mode`, `tensors` (checksums checked), `sparse_weights`, `nonstock_ops`, and with
        `against` also `max_abs_diff` per output and the `input_shapes` compared on.

    Raises:
        ExportError: naming the tensor, op or output that failed.
    """
    loaded = load(export_dir)
    metadata = loaded.sparse24_metadata
    for entry, meta in zip(metadata["sparse"], loaded.sparse_meta):
        try:
            fmt.check_meta(host_array(meta), entry["k"])  # a view: no copy
        except ValueError as e:
            raise ExportError(f"weight {entry['name']!r}: {e}") from e
    extra = nonstock_ops(graph_ops(export_dir))
    allowed = set() if metadata["mode"] == "portable" else set(ACCELERATED_OPS)
    if extra - allowed:
        raise ExportError(
            f"the {metadata['mode']} export uses ops that stock TensorFlow does not register: "
            f"{sorted(extra - allowed)}"
        )
    report = {
        "mode": metadata["mode"],
        "tensors": 2 * len(metadata["sparse"]) + len(metadata["dense"]),
        "sparse_weights": len(metadata["sparse"]),
        "nonstock_ops": sorted(extra),
    }
    if against is not None:
        report["max_abs_diff"], report["input_shapes"] = _compare(loaded, metadata, against, seed)
    return report


# Sizes tried, in order, for the unknown non-batch dimensions of the inputs in `verify --against`.
UNKNOWN_SIZES = (8, 32, 96)


def _compare_strings(name: str, got: np.ndarray, want) -> float:
    """0.0 if a string output is served exactly as the model gives it; else ExportError."""
    want = np.asarray(keras.ops.convert_to_numpy(want))
    if got.shape != want.shape:
        raise ExportError(f"output {name!r}: served shape {got.shape}, model gives {want.shape}")
    if (wrong := np.flatnonzero(got != want)).size:
        first = np.unravel_index(wrong[0], got.shape)
        raise ExportError(
            f"output {name!r}: {wrong.size} of {got.size} strings differ from the Keras model "
            f"(first at index {tuple(map(int, first))}: served {got[first]!r}, model "
            f"{want[first]!r})")
    return 0.0


def _compare(loaded, metadata, against, seed: int) -> tuple[dict[str, float], dict]:
    """Max |served - model| per output, and the input shapes they were compared on."""
    model = against
    if not isinstance(model, keras.Model):
        model = keras.saving.load_model(os.fspath(against), compile=False)
    model = functional_view(model)
    specs = metadata["signature"]["inputs"]
    unknown = any(d is None for spec in specs.values() for d in spec["shape"][1:])
    sizes = UNKNOWN_SIZES if unknown else UNKNOWN_SIZES[:1]
    for size in sizes:
        # Unknown dimensions (a sequence length, a fully convolutional model's height and width)
        # get `size`; a larger one where the model cannot take it (4 'valid' 3x3 convolutions
        # need 9) or gives empty outputs, which would match trivially.
        try:
            inputs, served, names, flat, low_precision = _run_both(
                loaded, metadata, model, size, seed)
        except Exception as e:  # TF and Keras raise many types on a bad shape
            if size == sizes[-1]:
                tried = (f" with the unknown input dimensions set to any of {list(sizes)}"
                         if unknown else "")
                raise ExportError(f"the model and export could not be compared{tried}: "
                                  f"{type(e).__name__}: {e}") from e
            continue
        if size == sizes[-1] or all(np.size(t) for t in flat):
            break
    diffs = {}
    for name, want in zip(names, flat):
        if served[name].dtype == tf.string:  # labels (StringLookup(invert=True)): equal or not
            diffs[name] = _compare_strings(name, served[name].numpy(), want)
            continue
        want = np.asarray(keras.ops.convert_to_numpy(want), np.float64)
        got = np.asarray(served[name].numpy(), np.float64)
        if got.shape != want.shape:
            raise ExportError(
                f"output {name!r}: served shape {got.shape}, model gives {want.shape}"
            )
        precise = served[name].dtype.size >= 4 and not low_precision
        finite = np.isfinite(want)
        tol = (1e-4 if precise else 2e-2) * max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
        # NaN/Inf where the model gives them too (e.g. a fully masked sequence) are a match.
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        diffs[name] = float(np.abs(np.where(same, 0.0, got - want)).max()) if want.size else 0.0
        if not diffs[name] <= tol:
            raise ExportError(
                f"output {name!r} differs from the Keras model by {diffs[name]:.3g} (> {tol:.3g})"
            )
    return diffs, {name: list(t.shape) for name, t in inputs.items()}


def _run_both(loaded, metadata: dict, model: keras.Model, size: int, seed: int):
    """One random batch of 2 (unknown dimensions set to `size`), the served outputs and the
    model's (names, flat list), and whether the model computes in 16 bits."""
    rng = np.random.default_rng(seed)
    specs = metadata["signature"]["inputs"]
    inputs = {}
    for name in _input_order(model, metadata["signature"]):
        shape = [d if d is not None else (2 if i == 0 else size)
                 for i, d in enumerate(specs[name]["shape"])]
        inputs[name] = _random_input(rng, shape, tf.as_dtype(specs[name]["dtype"]))
    served = loaded.signatures[SIGNATURE](**inputs)
    keys = list(inputs) if metadata["signature"].get("input_structure") == "dict" else None
    own = model_input_names(model)
    if own is not None and len(own) > 1 and sorted(own) == sorted(inputs):
        # By name, not through the binding the export made, so a served input bound to the wrong
        # model input shows: each named input in its place in the model's own structure (a
        # nested one takes no flat dict of names; and Keras binds a dict's values in flattened
        # order, a plain dict's (sorted) not an OrderedDict's (as inserted)).
        by_name = [inputs[name] for name in own]
        if positional_inputs(model):
            args = tuple(by_name)
        else:
            args = (keras.tree.pack_sequence_as(model.input, by_name),)
    else:
        args = model_arguments(model, list(inputs.values()), keys)
    # In graph mode, as the export runs: TensorFlow's graph rewrites (fused swish, batch norm
    # folded into a convolution) round differently from eager execution, and in a chaotic
    # untrained network (EfficientNetV2 from random weights) those roundings grow past any
    # tolerance, while the export matches the graph-mode model exactly.
    expected = tf.function(lambda *a: model(*a, training=False))(*args)
    # A model computing in 16 bits (mixed precision) is compared at 16-bit precision, whatever the
    # dtype of its output layer: the export's kernels round differently from Keras' own.
    low_precision = any(
        getattr(layer, "compute_dtype", None) in ("float16", "bfloat16")
        for layer in model._flatten_layers()  # wrapped layers too
    )
    flat, _ = flat_outputs(expected)
    return inputs, served, signature_output_names(model, expected), flat, low_precision


def _random_input(rng: np.random.Generator, shape: list[int], dtype: tf.DType) -> tf.Tensor:
    """Random values of `dtype`: normal floats; integers 1 or 2 (valid token ids for any vocabulary,
    never the padding id 0); short strings; booleans."""
    if dtype.is_floating:
        return tf.constant(rng.standard_normal(shape), dtype)
    if dtype == tf.string:
        return tf.constant(rng.choice(["a", "b", "c"], size=shape).astype(object), tf.string)
    if dtype == tf.bool:
        return tf.constant(rng.integers(0, 2, shape).astype(bool))
    return tf.constant(rng.integers(1, 3, shape), dtype)


def _input_order(model: keras.Model, signature: dict) -> list[str]:
    """The signature's input names in the order the model takes them. Exports before
    `input_order` was recorded have only the JSON's sorted keys: then the model's own names."""
    if "input_order" in signature:
        return signature["input_order"]
    try:
        names = [spec.name for spec in input_specs(model, None)]
    except ValueError:  # a subclassed model: no names of its own
        names = []
    return names if sorted(names) == sorted(signature["inputs"]) else sorted(signature["inputs"])


def describe(export_dir: str | os.PathLike) -> str:
    """A readable summary of an export: versions, signature, per-weight table and sizes on disk.

    Reads only the metadata and file sizes (no TensorFlow load), so it is quick.
    """
    metadata = md.read(export_dir)
    lines = [
        f"{os.fspath(export_dir)}: {metadata['format']} export, mode {metadata['mode']}, "
        f"model {metadata['model']!r}",
        f"written by tf_sparse24 {metadata['package_version']}, TensorFlow "
        f"{metadata['tensorflow_version']}, Keras {metadata['keras_version']}",
        f"signature {metadata['signature']['name']!r}:",
    ]
    for kind in ("inputs", "outputs"):
        for name, spec in metadata["signature"][kind].items():
            lines.append(f"  {kind[:-1]:6s} {name}: {spec['dtype']} {spec['shape']}")
    header = ("weight", "layer", "shape", "dtype", "kernel", "stored B", "dense B", "ratio")
    rows = []
    stored_total = dense_total = 0
    for e in metadata["sparse"]:
        stored = e["values"]["bytes"] + e["meta"]["bytes"]
        # Dense bytes of the Keras variable (float32 under mixed precision, whose 16-bit compute
        # dtype the values are stored in: shown as "bfloat16<-float32").
        variable_dtype = e.get("variable_dtype", e["dtype"])
        dense = int(np.prod(e["shape"])) * np.dtype(variable_dtype).itemsize
        stored_total, dense_total = stored_total + stored, dense_total + dense
        dtype = e["dtype"] if variable_dtype == e["dtype"] else f"{e['dtype']}<-{variable_dtype}"
        rows.append((e["name"], e["layer"], "x".join(map(str, e["shape"])), dtype, e["kernel"],
                     str(stored), str(dense), f"{stored / dense:.3f}" if dense else "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("compressed weights:")
    for row in [header, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    other = sum(r["bytes"] for r in metadata["dense"])
    lines.append(
        f"{len(metadata['sparse'])} compressed weights: {stored_total} B stored for "
        f"{dense_total} B dense ({stored_total / max(dense_total, 1):.3f}x); "
        f"{len(metadata['dense'])} other tensors: {other} B"
    )
    for name, size in _disk_sizes(export_dir).items():
        lines.append(f"on disk: {name} {size} B")
    return "\n".join(lines)


def _disk_sizes(export_dir: str | os.PathLike) -> dict[str, int]:
    export_dir = os.fspath(export_dir)
    sizes = {}
    for part in ("saved_model.pb", "variables", "assets"):
        path = os.path.join(export_dir, part)
        if os.path.isdir(path):
            sizes[part + "/"] = sum(
                os.path.getsize(os.path.join(root, f))
                for root, _, files in os.walk(path)
                for f in files
            )
        elif os.path.exists(path):
            sizes[part] = os.path.getsize(path)
    return sizes
