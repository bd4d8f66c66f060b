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
  its ops match the numpy format reference and a float64 matmul;
* one linked from `//cc:sparse24_ops_gpu` in a stand-in `--config=cuda` build does the same and
  registers the GPU kernels of every op and dtype. The build has `--define=using_cuda=true`
  (what `if_cuda` selects on), a `@local_config_cuda` made of nvcc's own toolkit, and a compiler
  driver that sends `-x cuda` compiles to nvcc (tests/helpers/cuda_cc_wrapper.py), as TensorFlow's
  CUDA toolchain does. It is not TensorFlow's CUDA configuration (a pip install does not carry it).

Without Bazel (or, for the GPU build, nvcc) the tests fail under CI=true and are skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
from cc_build import (
    GPU_KERNELS,
    check_op_library,
    load_setup_module,
    require_nvcc,
    tool_missing,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "build", "bazel_check")
LIBRARY = "sparse24_ops_bazel.so"
GPU_LIBRARY = "sparse24_ops_gpu_bazel.so"
CC_WRAPPER = os.path.join(ROOT, "tests", "helpers", "cuda_cc_wrapper.py")

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
        # TF's tf_gpu_kernel_library under --config=cuda: -DGOOGLE_CUDA=1 (tf_copts), -x cuda
        # (cuda_library's copts: nvcc through the compiler driver), the CUDA runtime.
        "tensorflow/tensorflow.bzl": """
            load("@local_config_cuda//cuda:build_defs.bzl", "if_cuda")

            def tf_gpu_kernel_library(name, srcs, hdrs = [], copts = [], deps = [], **kwargs):
                native.cc_library(
                    name = name,
                    srcs = srcs,
                    hdrs = hdrs,
                    copts = copts + if_cuda(["-x", "cuda", "-DGOOGLE_CUDA=1"]),
                    deps = deps + if_cuda([
                        "@local_config_cuda//cuda:cuda_headers",
                        "@local_config_cuda//cuda:cudart_static",
                    ]),
                    alwayslink = 1,
                    **kwargs
                )
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
    "local_config_cuda": {  # the CUDA toolkit nvcc belongs to (links `cuda/include`, `cuda/lib`)
        "cuda/BUILD": """
            package(default_visibility = ["//visibility:public"])

            config_setting(name = "using_nvcc", define_values = {"using_cuda": "true"})

            cc_library(
                name = "cuda_headers",
                hdrs = glob(["include/**"], exclude_directories = 1),
                includes = ["include"],
            )

            cc_library(
                name = "cudart_static",
                srcs = ["lib/libcudart_static.a"],
                linkopts = ["-ldl", "-lrt", "-lpthread"],
            )
            """,
        "cuda/build_defs.bzl": """
            def if_cuda(if_true, if_false = []):
                return select({
                    "@local_config_cuda//cuda:using_nvcc": if_true,
                    "//conditions:default": if_false,
                })
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
            if name.startswith("rules_") and path.endswith("defs.bzl"):
                # rules_* stand-ins: forward each rule to Bazel's own
                content = "\n".join(f"{rule} = native.{rule}" for rule in content.split())
            _write(os.path.join(repo, path),
                   textwrap.dedent(content).lstrip().replace("{defines}", json.dumps(defines)))
    tf_stub = repositories["org_tensorflow"]
    _link(tf.sysconfig.get_include(), os.path.join(tf_stub, "include"))
    _link(tf_dir, os.path.join(tf_stub, "lib"))
    setup = load_setup_module()
    cuda_stub = os.path.join(repositories["local_config_cuda"], "cuda")
    _link(os.path.join(setup.cuda_home(), "include"), os.path.join(cuda_stub, "include"))
    _link(os.path.join(setup.cuda_home(), "lib64"), os.path.join(cuda_stub, "lib"))
    # The compiler driver of a --config=cuda toolchain (tests/helpers/cuda_cc_wrapper.py).
    compiler = os.path.join(WORK, "cuda_cc")
    _write(compiler, textwrap.dedent(f"""\
        #!/bin/sh
        export HOST_CC={shlex.quote(shutil.which("gcc") or "gcc")}
        export NVCC={shlex.quote(setup.find_nvcc())}
        export CUDA_ARCH_FLAGS={shlex.quote(" ".join(setup.CUDA_ARCH_FLAGS))}
        exec {shlex.quote(sys.executable)} {shlex.quote(CC_WRAPPER)} "$@"
        """))
    os.chmod(compiler, 0o755)
    _write(os.path.join(WORK, "WORKSPACE"),
           "".join(f'local_repository(name = "{name}", path = "{path}")\n'
                   for name, path in repositories.items()))  # fmt: skip
    # The GPU library keeps its CUDA runtime private, as setup.py's (gpu_link_flags) does.
    _write(os.path.join(WORK, "BUILD"), textwrap.dedent(f"""\
        cc_binary(name = "{LIBRARY}", linkshared = 1, deps = ["@tf_sparse24//cc:sparse24_ops"])

        cc_binary(
            name = "{GPU_LIBRARY}",
            linkshared = 1,
            linkopts = ["-Wl,--exclude-libs,libcudart_static.a"],
            deps = ["@tf_sparse24//cc:sparse24_ops_gpu"],
        )
        """))
    # What TensorFlow's own .bazelrc gives a TF Serving build with --config=cuda (using_cuda and a
    # compiler driver that sends `-x cuda` to nvcc); no sandbox (18k TF headers).
    _write(os.path.join(WORK, ".bazelrc"),
           "build -c opt --cxxopt=-std=c++17 --spawn_strategy=standalone --jobs=2 "
           f"--define=using_cuda=true --repo_env=CC={compiler}\n")


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
    report = check_op_library(os.path.join(WORK, "bazel-bin", LIBRARY))
    assert not [k for found in report["kernels"].values() for k in found if k.startswith("GPU")]


@pytest.fixture(scope="module")
def gpu_library(workspace) -> str:
    """`//cc:sparse24_ops_gpu` linked into a library by the stand-in --config=cuda build."""
    require_nvcc()
    _bazel(workspace, "build", f"//:{GPU_LIBRARY}")
    return os.path.join(WORK, "bazel-bin", GPU_LIBRARY)


def test_bazel_built_gpu_library_registers_gpu_kernels(gpu_library: str) -> None:
    """The GPU targets compile (nvcc for the CUDA sources), link, and load into TensorFlow: the
    CPU ops still answer correctly and every op has its GPU kernels for float32/16, bfloat16."""
    report = check_op_library(gpu_library)
    for op, found in report["kernels"].items():
        assert GPU_KERNELS <= set(found), (op, found)
    def tool(*args: str) -> str:
        return subprocess.run([*args, gpu_library], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip

    assert ".nv_fatbin" in tool("readelf", "-SW"), "no device code: nvcc never compiled the .cu"
    dynamic = tool("nm", "-D").splitlines()
    assert not [line for line in dynamic if " cuda" in line], "cuda* symbols left to the loader"
