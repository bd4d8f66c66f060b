"""tf_sparse24.atomic_dir: a directory appears whole at its path or not at all (checked with os)."""

import os
import stat

import pytest

from tf_sparse24 import atomic_dir


def _write_files(files):
    def write(tmp):
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        return sorted(files)

    return write


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_the_directory_gets_the_umask_permissions_not_mkdtemps_0700(tmp_path):
    old = os.umask(0o027)
    try:
        result = atomic_dir.write_atomically(str(tmp_path / "m" / "1"), _write_files({"a": "x"}))
    finally:
        os.umask(old)
    assert result == ["a"]
    assert stat.S_IMODE(os.stat(tmp_path / "m" / "1").st_mode) == 0o750  # 0o777 & ~0o027
    assert _tree(tmp_path) == ["m", "m/1", "m/1/a"]


def test_a_failed_final_rename_puts_the_previous_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "1"
    target.mkdir()
    (target / "saved_model.pb").write_text("previous export")
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".1.tmp-"):
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(atomic_dir.os, "rename", rename)
    with pytest.raises(OSError, match="disk full"):
        atomic_dir.write_atomically(str(target), _write_files({"saved_model.pb": "new"}))
    assert _tree(tmp_path) == ["1", "1/saved_model.pb"]  # no temporary or .old- left either
    assert (target / "saved_model.pb").read_text() == "previous export"


def test_a_link_to_a_directory_is_replaced_and_its_target_kept(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("mine")
    (tmp_path / "m").mkdir()
    link = tmp_path / "m" / "1"
    link.symlink_to(data, target_is_directory=True)
    atomic_dir.check_replaceable(str(link))  # a link is replaced, never followed
    atomic_dir.write_atomically(str(link), _write_files({"saved_model.pb": "new"}))
    assert not link.is_symlink() and (link / "saved_model.pb").read_text() == "new"
    assert sorted(os.listdir(tmp_path / "m")) == ["1"]  # the link renamed away is removed
    assert (data / "keep.txt").read_text() == "mine"


def test_a_failed_write_leaves_nothing_not_even_the_parents_it_made(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "other").write_text("x")

    def fail(tmp):
        with open(os.path.join(tmp, "half"), "w") as f:
            f.write("half-written")
        raise RuntimeError("write failed")

    with pytest.raises(RuntimeError, match="write failed"):
        atomic_dir.write_atomically(str(tmp_path / "models" / "a" / "b" / "1"), fail)
    assert _tree(tmp_path) == ["models", "models/other"]


def test_everything_written_is_flushed_to_disk_before_the_rename_and_the_rename_after(
        tmp_path, monkeypatch):
    """A rename is atomic, but a crash soon after it could leave the new directory with empty
    files still in the page cache: every file and directory is fsynced before it, the parent after."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(atomic_dir.os, "fsync", fsync)
    monkeypatch.setattr(atomic_dir.os, "rename", rename)

    def write(tmp):
        os.mkdir(os.path.join(tmp, "variables"))
        for name in ("saved_model.pb", "variables/variables.index"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("data")

    atomic_dir.write_atomically(str(tmp_path / "m" / "1"), write)
    (_, tmp), = [e for e in events if e[0] == "rename"]
    before = {os.path.relpath(p, tmp) for kind, p in events[:events.index(("rename", tmp))]}
    assert before == {".", "saved_model.pb", "variables", "variables/variables.index"}
    assert events[-1] == ("fsync", str(tmp_path / "m"))  # the directory entry of the rename
