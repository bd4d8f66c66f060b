"""The source distribution carries what a build from it needs (a practitioner's `pip install`
of the sdist compiles the op library from cc/)."""

import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_files(*paths: str) -> list[str]:
    """Tracked and new (not ignored) files: what a clean clone of this tree holds."""
    return subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *paths], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.split()


def test_sdist_carries_the_cpp_sources_and_bazel_files(tmp_path):
    # From a copy: setuptools would otherwise reuse the file list of an earlier build's egg-info.
    tree = tmp_path / "tree"
    for name in git_files():
        os.makedirs((tree / name).parent, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), tree / name)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
        cwd=tree, check=True, capture_output=True,
    )
    (archive,) = tmp_path.glob("tf_sparse24-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = set(git_files("cc", "tf_sparse24"))
    assert needed and not needed - names, sorted(needed - names)
    assert {"setup.py", "BUILD", "WORKSPACE", "README.md"} <= names
