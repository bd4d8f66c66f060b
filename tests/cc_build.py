"""Compiling cc/ sources for the C++-level tests with exactly setup.py's per-file flags."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_setup_module():
    """setup.py as a module (its setup() call neutralised): ISA_FLAGS, the GPU build commands."""
    import setuptools

    spec = importlib.util.spec_from_file_location("tf_sparse24_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(setuptools, "setup", lambda **kwargs: None):
        spec.loader.exec_module(module)
    return module


EMULATION = os.path.join(ROOT, "tests", "emulated_avx512")


def tool_missing(what: str, install: str) -> None:
    """A check needs a tool this machine lacks: fails under CI=true (CI must run it: .ci/run
    installs it), skips elsewhere."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} not found: CI must run this check ({install})")
    pytest.skip(f"{what} not found ({install}); CI=true makes this fail")


def require_nvcc() -> str:
    """nvcc's path as setup.py finds it ($NVCC, PATH, $CUDA_HOME/bin); a missing one is a missing
    tool (tool_missing)."""
    path = load_setup_module().find_nvcc()
    if not os.path.exists(path):
        tool_missing("nvcc", "install the CUDA toolkit")
    return path


def require_avx512_emulation(cxx: str = "g++") -> None:
    """Skips unless this CPU runs the AVX2 variant (the emulation is built on it), and needs
    SIMDe's AVX-512 header (Debian's libsimde-dev) on the compiler's include path."""
    import pytest

    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    if not {"avx2", "fma", "f16c"} <= set(flags):
        pytest.skip("the AVX-512 emulation runs on AVX2, FMA and F16C; this CPU lacks them")
    probe = subprocess.run([cxx, "-std=c++17", "-x", "c++", "-E", "-o", os.devnull, "-"],
                           input="#include <simde/x86/avx512.h>\n", capture_output=True,
                           text=True, check=False)  # fmt: skip
    if probe.returncode != 0:
        tool_missing("SIMDe", "apt-get install libsimde-dev")


def compile_objects(sources: list[str], out_dir: str, flags: list[str], cxx: str = "g++",
                    emulate_avx512: bool = False) -> list[str]:
    """Compiles each source to out_dir/<name>.o in parallel, adding setup.py's ISA flags per file.

    emulate_avx512: the *_avx512*.cc files are compiled with the AVX2 flags and SIMDe standing in
    for the AVX-512 intrinsics (tests/emulated_avx512/simde_avx512.h), and every ISA is reported
    supported (cpu_features.cc's isa_supported made weak, all_isas_supported.cc linked instead),
    so the AVX-512 kernels run, emulated, on an AVX2 CPU.

    Raises subprocess.CalledProcessError (with stderr) on the first failure.
    """
    isa_flags = dict(load_setup_module().ISA_FLAGS)
    if emulate_avx512:
        for suffix in ("_avx512.cc", "_avx512bf16.cc"):
            isa_flags[suffix] = [*isa_flags["_avx2.cc"], "-Wno-psabi",
                                 "-include", os.path.join(EMULATION, "simde_avx512.h")]
        sources = [*sources, os.path.join(EMULATION, "all_isas_supported.cc")]

    def compile_one(src: str) -> str:
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        isa = next((f for suffix, f in isa_flags.items() if src.endswith(suffix)), [])
        cmd = [cxx, "-std=c++17", "-Wall", *flags, *isa, f"-I{ROOT}", "-c", src, "-o", obj]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        if emulate_avx512 and os.path.basename(src) == "cpu_features.cc":
            symbols = subprocess.run(["nm", obj], check=True, capture_output=True, text=True)
            name = next(line.split()[-1] for line in symbols.stdout.splitlines()
                        if line.split()[-1].startswith("_ZN8sparse2413isa_supported"))  # fmt: skip
            subprocess.run(["objcopy", f"--weaken-symbol={name}", obj], check=True,
                           capture_output=True, text=True)  # fmt: skip
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, sources))


OP_DTYPES = ("float32", "float16", "bfloat16")
GPU_KERNELS = {f"GPU:{dtype}" for dtype in OP_DTYPES}


def check_op_library(path: str) -> dict:
    """Loads a built op library into TensorFlow in a fresh process (tests/helpers/
    op_library_worker.py), asserts its CPU ops match the numpy format reference and a float64
    matmul, and returns the worker's report (with the kernels TensorFlow registered)."""
    worker = os.path.join(ROOT, "tests", "helpers", "op_library_worker.py")
    proc = subprocess.run([sys.executable, worker, path], capture_output=True, text=True,
                          timeout=300, check=False,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})  # fmt: skip
    assert proc.returncode == 0, f"loading {path} failed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["values_equal"] and report["meta_equal"] and report["dense_equal"], report
    assert report["matmul_error"] < 1e-4, report
    assert "group g=1 (rows k=4..7) of column n=3" in report["bad_input_error"], report
    for op, found in report["kernels"].items():
        assert {f"CPU:{dtype}" for dtype in OP_DTYPES} <= set(found), (op, found)
    return report
