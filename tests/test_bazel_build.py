"""cc/BUILD builds with Bazel, and the op library it makes runs.

TensorFlow Serving links the ops through `//cc:sparse24_ops` (docs/EXPORT.md), a path nothing else
exercises. This builds it with Bazel 4 (Debian's `bazel-bootstrap`; `.ci/run` installs it) in a
small workspace under build/bazel_check whose external repositories are stand-ins:
`@org_tensorflow//tensorflow/core:framework` is the installed TensorFlow's headers and
libtensorflow_framework.so.2 (what setup.py compiles against), `@com_google_absl` its bundled absl,
rules_cc / rules_java / rules_proto forward to Bazel's native rules and remote_coverage_tools is
empty (Bazel 4 would download them; this machine reaches no GitHub). Then:

* the sources Bazel compiles for `//cc:sparse24_ops` and `//cc:sparse24_ops_gpu`, and the per-ISA
  copts, are setup.py's;
* `//cc:core_test` passes under `bazel test`;
* a shared library linked from `//cc:sparse24_ops` loads into TensorFlow in a fresh process and
  its ops match the numpy format reference and a float64 matmul.

The GPU targets are analysed only (`--nobuild`: file lists and labels resolve); compiling them
needs TensorFlow's CUDA toolchain configuration, which a pip install does not carry.
Without Bazel the tests fail under CI=true and are skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from cc_build import load_setup_module, tool_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "build", "bazel_check")
LIBRARY = "sparse24_ops_bazel.so"

# Stand-in repositories: {repository: {path: content}}.
STUBS = {
    "org_tensorflow": {
        "BUILD": """
            package(default_visibility = ["//visibility:public"])

            # The pip package's headers and framework library (links `include`, `lib`).
            cc_library(
                name = "framework_impl",
                srcs = ["lib/libtensorflow_framework.so.2"],
                hdrs = glob(["include/**"], exclude_directories = 1),
                includes = ["include"],
                defines = {defines},
            )
            """,
        "tensorflow/BUILD": "",
        "tensorflow/tensorflow.bzl": """
            def tf_gpu_kernel_library(name, **kwargs):
                native.cc_library(name = name, **kwargs)
            """,
        "tensorflow/core/BUILD": """
            package(default_visibility = ["//visibility:public"])

            alias(name = "framework", actual = "//:framework_impl")
            """,
    },
    "com_google_absl": {
        "absl/strings/BUILD": """
            package(default_visibility = ["//visibility:public"])

            alias(name = "strings", actual = "@org_tensorflow//:framework_impl")
            """,
    },
    "local_config_cuda": {
        "cuda/BUILD": """
            package(default_visibility = ["//visibility:public"])

            cc_library(name = "cuda_headers")
            """,
    },
    "remote_coverage_tools": {  # cc_test's implicit coverage tools (never run: no coverage)
        "BUILD": """
            package(default_visibility = ["//visibility:public"])

            filegroup(name = "coverage_report_generator")

            filegroup(name = "lcov_merger")
            """,
    },
    "rules_cc": {"cc/BUILD": "", "cc/defs.bzl": "cc_binary cc_library cc_test cc_toolchain "
                                                "cc_toolchain_suite"},
    "rules_java": {"java/BUILD": "", "java/defs.bzl": "java_binary java_import java_library "
                                                      "java_runtime java_toolchain"},
    "rules_proto": {"proto/BUILD": "", "proto/defs.bzl": "proto_library"},
}

RUN_OPS = """
import importlib.util, json, sys
import numpy as np, tensorflow as tf

library = tf.load_op_library(sys.argv[1])
spec = importlib.util.spec_from_file_location("fmt", sys.argv[2])  # not the package: no 2nd library
fmt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fmt)
rng = np.random.default_rng(7)
k, n, m = 72, 40, 9
w = rng.standard_normal((k, n)).astype(np.float32)
drop = np.argsort(rng.random((k // 4, 4, n)), axis=1)[:, :2]
np.put_along_axis(w.reshape(k // 4, 4, n), drop, 0.0, axis=1)
x = rng.standard_normal((m, k)).astype(np.float32)
values, meta = library.sparse24_compress(w)
want_values, want_meta = fmt.compress(w)
y = library.sparse24_mat_mul(x, values, meta).numpy()
bad = w.copy()
bad[4:8, 3] = 1.0
try:
    library.sparse24_compress(bad)
    error = ""
except tf.errors.InvalidArgumentError as e:
    error = e.message
print(json.dumps({
    "values_equal": bool(np.array_equal(values.numpy(), want_values)),
    "meta_equal": bool(np.array_equal(meta.numpy(), want_meta)),
    "dense_equal": bool(np.array_equal(library.sparse24_decompress(values, meta, k).numpy(), w)),
    "matmul_error": float(np.abs(y - x.astype(np.float64) @ w.astype(np.float64)).max()),
    "bad_input_error": error,
}))
"""


@pytest.fixture(scope="module")
def bazel() -> list[str]:
    """The bazel command with this check's startup options (Debian's bazel-bootstrap 4.x)."""
    path = shutil.which("bazel")
    if path is None:
        tool_missing("bazel", "apt-get install bazel-bootstrap")
    # One Bazel server for the module's commands (it keeps the digests of TensorFlow's 18k headers
    # between them), gone 30 s after the last; its own output root, so nothing lands outside build/.
    return [path, f"--output_user_root={os.path.join(ROOT, 'build', 'bazel_root')}",
            "--max_idle_secs=30"]


def _platforms_repository(bazel_path: str) -> str:
    """Debian's bazel-bootstrap ships @platforms beside its install (Bazel 4 would download it)."""
    share = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(bazel_path))),
                         "share", "bazel", "platforms")  # fmt: skip
    if not os.path.isdir(share):  # another Bazel: this offline set-up is written for Debian's 4.x
        tool_missing(f"Debian's bazel-bootstrap (no {share})", "apt-get install bazel-bootstrap")
    return share


def _write(path: str, content: str) -> None:
    """Writes `content` unless the file already holds it (another pytest worker may be running
    Bazel on the same workspace: what it reads must not change under it)."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == content:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(content)
    os.replace(path + ".tmp", path)


def _link(target: str, path: str) -> None:
    if os.path.realpath(path) != os.path.realpath(target):
        if os.path.lexists(path):
            os.remove(path)
        os.symlink(target, path)


def _write_workspace(bazel: list[str]) -> None:
    import tensorflow as tf

    tf_dir = os.path.dirname(tf.__file__)
    defines = [flag[2:] for flag in tf.sysconfig.get_compile_flags() if flag.startswith("-D")]
    repositories = {"tf_sparse24": ROOT, "platforms": _platforms_repository(bazel[0])}
    for name, files in STUBS.items():
        repo = os.path.join(WORK, "stubs", name)
        repositories[name] = repo
        for path, content in {"WORKSPACE": "", **files}.items():
            if path.endswith("defs.bzl"):  # rules_* stand-ins: forward each rule to Bazel's own
                content = "\n".join(f"{rule} = native.{rule}" for rule in content.split())
            _write(os.path.join(repo, path),
                   textwrap.dedent(content).lstrip().replace("{defines}", json.dumps(defines)))
    tf_stub = repositories["org_tensorflow"]
    _link(tf.sysconfig.get_include(), os.path.join(tf_stub, "include"))
    _link(tf_dir, os.path.join(tf_stub, "lib"))
    _write(os.path.join(WORK, "WORKSPACE"),
           "".join(f'local_repository(name = "{name}", path = "{path}")\n'
                   for name, path in repositories.items()))  # fmt: skip
    _write(os.path.join(WORK, "BUILD"),
           f'cc_binary(name = "{LIBRARY}", linkshared = 1, '
           'deps = ["@tf_sparse24//cc:sparse24_ops"])\n')  # fmt: skip
    # What TensorFlow's own .bazelrc gives a TF Serving build; no sandbox (18k TF headers).
    _write(os.path.join(WORK, ".bazelrc"),
           "build -c opt --cxxopt=-std=c++17 --spawn_strategy=standalone --jobs=2\n")


def _bazel(bazel: list[str], *args: str, timeout: int = 480) -> subprocess.CompletedProcess:
    proc = subprocess.run([*bazel, *args], cwd=WORK, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip
    assert proc.returncode == 0, f"bazel {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def workspace(bazel) -> list[str]:
    """The check workspace, with `//:sparse24_ops_bazel.so` and `//cc:core_test` built."""
    os.makedirs(WORK, exist_ok=True)
    _write_workspace(bazel)
    _bazel(bazel, "build", f"//:{LIBRARY}", "@tf_sparse24//cc:core_test")
    return bazel


def _sources(bazel: list[str], target: str) -> set[str]:
    out = _bazel(bazel, "query", f'kind("source file", deps({target}))').stdout
    prefix = "@tf_sparse24//cc:"
    return {"cc/" + line[len(prefix):] for line in out.split()
            if line.startswith(prefix) and line.endswith((".cc", ".cu"))}  # fmt: skip


def test_bazel_compiles_setup_py_sources_and_flags(workspace) -> None:
    setup = load_setup_module()
    cpu = {os.path.relpath(s, ROOT) for s in setup._cpu_sources()}
    assert _sources(workspace, "@tf_sparse24//cc:sparse24_ops") == cpu
    gpu = {os.path.relpath(s, ROOT) for s in setup.gpu_sources()}
    _bazel(workspace, "build", "--nobuild", "@tf_sparse24//cc:sparse24_ops_gpu")
    assert _sources(workspace, "@tf_sparse24//cc:sparse24_ops_gpu") == cpu | gpu
    for suffix, flags in setup.ISA_FLAGS.items():
        target = f"@tf_sparse24//cc:sparse24_core_{suffix[1:-3]}"
        rule = _bazel(workspace, "query", "--output=build", target).stdout
        copts = re.search(r"copts = (\[.*?\])", rule, re.S)
        assert copts is not None and json.loads(copts.group(1)) == flags, rule


def test_bazel_core_test_passes(workspace) -> None:
    proc = _bazel(workspace, "test", "--test_output=errors", "@tf_sparse24//cc:core_test")
    assert "1 test passes" in proc.stderr + proc.stdout


def test_bazel_built_library_runs_the_ops(workspace) -> None:
    library = os.path.join(WORK, "bazel-bin", LIBRARY)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_OPS, library, os.path.join(ROOT, "tf_sparse24", "format.py")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["values_equal"] and got["meta_equal"] and got["dense_equal"], got
    assert got["matmul_error"] < 1e-4, got
    assert "group g=1 (rows k=4..7) of column n=3" in got["bad_input_error"], got
