"""The `assets/sparse24.json` metadata of an export: schema, checksums, reading and validation.

Schema `tf_sparse24.export/1` (a JSON object; docs/EXPORT.md lists every field):
`schema`, `format` ("sparse24/v1"), `mode` ("portable" | "accelerated"), `package_version`,
`tensorflow_version`, `keras_version`, `model`, `signature` (input/output names, shapes, dtypes),
`sparse` (one entry per compressed weight: `name`, `layer`, `shape`, `dtype` (of the stored
values), `variable_dtype` (of the Keras variable), `axis`, `k`, `n`,
`pattern`, `kernel` ("sparse24_matmul" | "dense_at_load"), `values` / `meta` tensor records) and
`dense` (tensor records of every other stored variable). A tensor record is `{"name", "shape",
"dtype", "sha256", "bytes"}`; the sha256 is over the tensor's C-order bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

SCHEMA = "tf_sparse24.export/1"
FORMAT = "sparse24/v1"
MODES = ("portable", "accelerated")
FILENAME = "sparse24.json"
KERNELS = ("sparse24_matmul", "dense_at_load")
TENSOR_FIELDS = ("name", "shape", "dtype", "sha256", "bytes")
SPARSE_FIELDS = ("name", "layer", "shape", "dtype", "axis", "k", "n", "pattern", "kernel",
                 "values", "meta")  # and, since mixed precision, "variable_dtype"


class ExportError(ValueError):
    """An export is missing, corrupted, edited, or of a version this package cannot read."""


def path_in(export_dir: str | os.PathLike) -> str:
    """Location of the metadata file inside an export directory."""
    return os.path.join(os.fspath(export_dir), "assets", FILENAME)


# sha256 of saved_model.pb, in `sha256sum` format (`cd DIR && sha256sum -c` this file). The graph
# embeds the metadata, so neither can hold the graph's checksum; assets.extra/ is where TensorFlow
# Serving keeps files that travel with a model but are not part of it.
GRAPH_CHECKSUM = os.path.join("assets.extra", "saved_model.pb.sha256")


def write_graph_checksum(export_dir: str | os.PathLike) -> None:
    """Writes the sha256 of the export's `saved_model.pb` to `GRAPH_CHECKSUM`."""
    export_dir = os.fspath(export_dir)
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    os.makedirs(os.path.join(export_dir, "assets.extra"), exist_ok=True)
    with open(os.path.join(export_dir, GRAPH_CHECKSUM), "w", encoding="utf-8") as f:
        f.write(f"{digest}  saved_model.pb\n")


def check_graph_checksum(export_dir: str | os.PathLike) -> bool:
    """Checks `saved_model.pb` against `GRAPH_CHECKSUM`; False if the export has none (written
    before 2026-12-01).

    Raises:
        ExportError: the graph's sha256 differs (its ops or constants were changed), or the
            checksum file is unreadable.
    """
    export_dir = os.fspath(export_dir)
    path = os.path.join(export_dir, GRAPH_CHECKSUM)
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        expected = f.read().split()
    graph = os.path.join(export_dir, "saved_model.pb")
    if not os.path.isfile(graph):
        raise ExportError(f"{graph} not found")
    with open(graph, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if expected[:2] != [digest, "saved_model.pb"]:
        raise ExportError(
            f"checksum mismatch for saved_model.pb: its sha256 is {digest}, {path} says "
            f"{' '.join(expected[:2])!r}; the graph was modified or corrupted"
        )
    return True


def sha256(array: np.ndarray) -> str:
    """Hex sha256 of an array's C-order bytes (the checksum stored for every tensor)."""
    return hashlib.sha256(np.ascontiguousarray(array)).hexdigest()  # the buffer: no copy


def tensor_record(name: str, array: np.ndarray) -> dict[str, Any]:
    """The metadata record of one stored tensor."""
    array = np.asarray(array)
    return {
        "name": name,
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "sha256": sha256(array),
        "bytes": int(array.nbytes),
    }


def dumps(metadata: dict[str, Any]) -> str:
    """Canonical JSON text of the metadata (sorted keys, so the embedded copy compares exactly)."""
    return json.dumps(metadata, indent=1, sort_keys=True) + "\n"


def loads(text: str, source: str) -> dict[str, Any]:
    """Parses and validates metadata text.

    Args:
        text: the JSON text.
        source: where it came from, for error messages.

    Raises:
        ExportError: on invalid JSON, a different schema or format version, or missing fields.
    """
    try:
        metadata = json.loads(text)
    except json.JSONDecodeError as e:
        raise ExportError(f"{source} is not valid JSON ({e}); the export is corrupted") from e
    if not isinstance(metadata, dict):
        raise ExportError(f"{source} must hold a JSON object. Received: {type(metadata).__name__}")
    if metadata.get("schema") != SCHEMA:
        raise ExportError(
            f"{source}: unsupported metadata schema {metadata.get('schema')!r}; this version of "
            f"tf_sparse24 reads {SCHEMA!r}"
        )
    if metadata.get("format") != FORMAT:
        raise ExportError(
            f"{source}: unsupported compressed format {metadata.get('format')!r}; this version of "
            f"tf_sparse24 reads {FORMAT!r}"
        )
    if metadata.get("mode") not in MODES:
        raise ExportError(
            f"{source}: mode must be one of {MODES}. Received: {metadata.get('mode')!r}"
        )
    for key in ("sparse", "dense", "signature"):
        if key not in metadata:
            raise ExportError(f"{source}: missing field {key!r}")
    for key in ("sparse", "dense"):
        if not isinstance(metadata[key], list):
            raise ExportError(f"{source}: {key!r} must be a list. Received: {metadata[key]!r}")
    records = [(f"sparse[{i}]", e, SPARSE_FIELDS) for i, e in enumerate(metadata["sparse"])]
    records += [(f"sparse[{i}].{part}", e.get(part), TENSOR_FIELDS)
                for i, e in enumerate(metadata["sparse"]) if isinstance(e, dict)
                for part in ("values", "meta")]
    records += [(f"dense[{i}]", e, TENSOR_FIELDS) for i, e in enumerate(metadata["dense"])]
    for where, record, fields in records:
        if not isinstance(record, dict):
            raise ExportError(f"{source}: {where} must be a JSON object. Received: {record!r}")
        if missing := [f for f in fields if f not in record]:
            raise ExportError(f"{source}: {where} ({record.get('name', '?')!r}) is missing "
                              f"the fields {missing}")
    return metadata


def read(export_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads and validates `assets/sparse24.json` of an export directory.

    Raises:
        ExportError: if the file is missing or invalid (see `loads`).
    """
    path = path_in(export_dir)
    if not os.path.isfile(path):
        raise ExportError(
            f"{path} not found: {os.fspath(export_dir)!r} is not a tf_sparse24 export "
            "(export it with tf_sparse24.export)"
        )
    with open(path, encoding="utf-8") as f:
        return loads(f.read(), path)
