"""The source distribution carries what a build from it needs (a practitioner's `pip install`
of the sdist compiles the op library from cc/), `make ops` rebuilds the library when needed, and the
package refuses to import on a Keras backend other than TensorFlow."""

import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

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


FAKE_PYTHON = """#!/bin/sh
# The venv's python for the Makefile: answers the TensorFlow version, logs builds.
if [ "$1" = "-c" ]; then echo "$FAKE_TF_VERSION"; exit 0; fi
echo "TF_SPARSE24_CUDA=$TF_SPARSE24_CUDA $*" >> "$BUILD_LOG"
"""


def test_make_ops_rebuilds_for_another_tensorflow_or_a_gpu_build(tmp_path):
    """`make ops` is what the op library's load error (another TensorFlow) and docs/GPU.md
    (`TF_SPARSE24_CUDA=1 make ops`) tell one to run: it rebuilds then, not only when a C++
    source changed, and a GPU build stays one. Run on the Makefile with a stand-in venv."""
    if not shutil.which("make"):
        pytest.skip("no make")
    tree, log = tmp_path / "tree", tmp_path / "build.log"
    (tree / "cc").mkdir(parents=True)
    (tree / "tf_sparse24").mkdir()
    (tree / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "Makefile"), tree / "Makefile")
    python = tree / ".venv" / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    # An installed tree (`make demo` ran): sources, then the install, then the library.
    for age, name in ((300, "setup.py"), (300, "cc/a.cc"), (200, ".venv/.tf_sparse24-installed"),
                      (100, "tf_sparse24/.ops-built")):
        (tree / name).write_text("")
        os.utime(tree / name, (time.time() - age,) * 2)

    def make(tf_version="2.21.0", **env) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        subprocess.run(
            ["make", "-s", "-C", str(tree), "ops"], check=True, capture_output=True,
            env={"PATH": os.environ["PATH"], "FAKE_TF_VERSION": tf_version,
                 "BUILD_LOG": str(log), **env},
        )
        return (log.read_text().splitlines() if log.exists() else [])[len(before):]

    build = "TF_SPARSE24_CUDA={} setup.py --quiet build_ext --inplace"
    assert make() == [build.format("")]  # built before the library's flavour was recorded
    assert make() == []
    assert make(TF_SPARSE24_CUDA="1") == [build.format("1")]
    assert make() == []  # the GPU build stays one
    assert make(tf_version="2.22.0") == [build.format("1")]  # another TensorFlow installed
    assert make(tf_version="2.22.0", TF_SPARSE24_CUDA="0") == [build.format("")]
    assert make(tf_version="2.22.0") == []
    os.utime(tree / "cc" / "a.cc")
    assert make(tf_version="2.22.0") == [build.format("")]  # a changed source, as before


def test_import_on_another_keras_backend_says_how_to_switch():
    """JAX/torch are not installed here, so Keras is made to report another backend in a fresh
    process; the import must fail at once with the fix, before any module of the package loads."""
    code = (
        "import sys, keras\n"
        "keras.backend.backend = lambda: 'jax'\n"
        "try:\n"
        "    import tf_sparse24\n"
        "except ImportError as e:\n"
        "    print('ERROR', e)\n"
        "print(sorted(m for m in sys.modules if m.startswith('tf_sparse24.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    assert "ERROR tf_sparse24 needs Keras' TensorFlow backend" in out
    assert "'jax' backend" in out and "KERAS_BACKEND=tensorflow" in out
    assert out.strip().endswith("[]"), out
