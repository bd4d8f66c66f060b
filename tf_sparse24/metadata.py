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


# sha256 of saved_model.pb and of every file under assets/, in `sha256sum` format (`cd DIR &&
# sha256sum -c` this file). The graph embeds the metadata, so neither can hold the graph's
# checksum; assets.extra/ is where TensorFlow Serving keeps files that travel with a model but are
# not part of it. Exports of 2026-12-01 to 12-03 wrote the graph's line only, under LEGACY_CHECKSUMS.
CHECKSUMS = os.path.join("assets.extra", "SHA256SUMS")
LEGACY_CHECKSUMS = os.path.join("assets.extra", "saved_model.pb.sha256")


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _checksummed_files(export_dir: str) -> list[str]:
    """saved_model.pb and every file under assets/ (the metadata, a lookup table's vocabulary),
    as paths relative to the export directory with "/" separators, in sorted order."""
    assets = []
    for root, _, files in os.walk(os.path.join(export_dir, "assets")):
        rel = os.path.relpath(root, export_dir).replace(os.sep, "/")
        assets += [f"{rel}/{name}" for name in files]
    return ["saved_model.pb", *sorted(assets)]


def write_checksums(export_dir: str | os.PathLike) -> None:
    """Writes the sha256 of `saved_model.pb` and of every asset file to `CHECKSUMS`."""
    export_dir = os.fspath(export_dir)
    lines = [f"{_file_sha256(os.path.join(export_dir, rel))}  {rel}\n"
             for rel in _checksummed_files(export_dir)]
    os.makedirs(os.path.join(export_dir, "assets.extra"), exist_ok=True)
    with open(os.path.join(export_dir, CHECKSUMS), "w", encoding="utf-8") as f:
        f.writelines(lines)


def check_checksums(export_dir: str | os.PathLike) -> bool:
    """Checks `saved_model.pb` and the asset files against `CHECKSUMS` (or an older export's
    `LEGACY_CHECKSUMS`, the graph's line only); False if the export has neither (written before
    2026-12-01).

    Raises:
        ExportError: a listed file is missing or its sha256 differs (the graph's ops or constants,
            a vocabulary file were changed), or the checksum file is unreadable.
    """
    export_dir = os.fspath(export_dir)
    path = next((os.path.join(export_dir, name) for name in (CHECKSUMS, LEGACY_CHECKSUMS)
                 if os.path.exists(os.path.join(export_dir, name))), None)
    if path is None:
        return False
    with open(path, encoding="utf-8") as f:
        entries = [line.split(maxsplit=1) for line in f.read().splitlines() if line.strip()]
    if not entries or any(len(e) != 2 for e in entries) or entries[0][1] != "saved_model.pb":
        raise ExportError(f"{path} is not a sha256sum list starting with saved_model.pb")
    for expected, rel in entries:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ExportError(f"{path} lists {rel!r}, a file outside the export")
        target = os.path.join(export_dir, *rel.split("/"))
        if not os.path.isfile(target):
            raise ExportError(f"{target} not found (it is listed in {path})")
        digest = _file_sha256(target)
        if digest != expected:
            raise ExportError(
                f"checksum mismatch for {rel}: its sha256 is {digest}, {path} says "
                f"{expected!r}; the file was modified or corrupted"
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
