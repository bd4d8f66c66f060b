"""Writing a directory atomically: an export appears whole at its path, or not at all.

`write_atomically` writes into a temporary directory next to the target (a dot-name that is not a
number, so TensorFlow Serving ignores it meanwhile), flushes it to disk and renames it into place;
`check_replaceable` says which existing paths `overwrite=True` may replace.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def write_atomically(path: str, write: Callable[[str], T]) -> T:
    """Calls `write(tmp)` on a new, empty directory next to `path`, then renames it to `path`
    (replacing what is there: see `_move_into_place`) and returns what `write` returned.

    Missing parent directories are made. If anything fails, the temporary directory and the
    parents this call made are removed: nothing of a failed write stays behind.
    """
    parent = os.path.dirname(path)
    created, missing = [], parent  # the parent directories this call makes, deepest first
    while not os.path.exists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(parent, exist_ok=True)
    # A dot-name that is not a number: TF Serving ignores it while it is being written.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a server user must read it
        result = write(tmp)
        sync_tree(tmp)  # on disk before the rename: after a crash, the export is whole or absent
        _move_into_place(tmp, path)
        sync_tree(parent, recursive=False)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in created:
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise
    return result


def sync_tree(path: str, recursive: bool = True) -> None:
    """fsyncs `path` (a file or a directory) and, with `recursive`, every file and directory under
    it, deepest first. A rename is atomic, but without this a crash soon after it can leave the
    renamed directory with empty or short files (the data was still in the page cache)."""
    if recursive and os.path.isdir(path) and not os.path.islink(path):
        for root, directories, files in os.walk(path, topdown=False):
            for name in files + directories:
                if not os.path.islink(os.path.join(root, name)):
                    _fsync(os.path.join(root, name))
    _fsync(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too (POSIX; how its entries reach the disk)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(export_dir: str) -> None:
    """Refuses a directory at `export_dir` that `overwrite=True` must not replace.

    Replaced are a previous export (a SavedModel directory), an empty directory, a file or a
    link. Anything else may be the user's own: a model directory holding its version directories
    (`export(m, "models/m", overwrite=True)`, the version forgotten, deleted every version).
    """
    if not os.path.isdir(export_dir) or os.path.islink(export_dir):
        return
    entries = sorted(os.listdir(export_dir))
    if not entries or {"saved_model.pb", "saved_model.pbtxt"} & set(entries):
        return
    versions = sorted(int(e) for e in entries
                      if e.isdigit() and os.path.isdir(os.path.join(export_dir, e)))
    hint = (f" It holds the version directories {versions}: export to "
            f"{os.path.join(export_dir, str(versions[-1] + 1))}?" if versions else "")
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    raise FileExistsError(
        f"{export_dir} is not a SavedModel (it holds {shown}): overwrite=True replaces only a "
        f"previous export, an empty directory or a file, never other data.{hint}"
    )


def _move_into_place(tmp: str, export_dir: str) -> None:
    """Renames `tmp` to `export_dir`. Something already there is renamed away first, put back if
    the rename fails, and deleted once the new one is in place. (A dangling link counts as
    something: a directory cannot be renamed onto it.)"""
    if not os.path.lexists(export_dir):
        os.rename(tmp, export_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(export_dir)}.old-", dir=os.path.dirname(tmp))
    os.rmdir(old)
    os.rename(export_dir, old)
    try:
        os.rename(tmp, export_dir)
    except BaseException:
        os.rename(old, export_dir)  # put the previous export back
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:  # overwrite=True replaced a file (or a link) at export_dir
        os.remove(old)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
