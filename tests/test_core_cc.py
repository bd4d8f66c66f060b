"""Builds the C++ core test (cc/sparse24/core_test.cc) with ASan + UBSan and runs it: natively, and
with the AVX-512 kernels emulated by SIMDe on this AVX2 CPU (tests/emulated_avx512)."""

import glob
import importlib.util
import os
import shutil
import subprocess

import pytest
from cc_build import compile_objects, load_setup_module, require_avx512_emulation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "cc", "sparse24")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def core_sources() -> list[str]:
    """The core test plus the TF-free sources it drives: format, ISA detection, every spmm."""
    spmm = [
        path
        for path in glob.glob(os.path.join(CORE, "spmm*.cc"))
        if not path.endswith("_test.cc") and "bench" not in os.path.basename(path)
    ]
    names = ["core_test.cc", "format.cc", "cpu_features.cc"]
    return [os.path.join(CORE, name) for name in names] + sorted(spmm)


def library_sources() -> list[str]:
    """core_sources() without the test program: what the op library builds of the core."""
    return [p for p in core_sources() if not p.endswith("core_test.cc")]


def _build_core_test(out, emulate_avx512: bool = False) -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.fail(f"the C++ core test needs a C++ compiler; {cxx!r} is not on PATH")
    try:
        objects = compile_objects(core_sources(), str(out), ["-O0", "-g", *SANITIZE], cxx=cxx,
                                  emulate_avx512=emulate_avx512)  # fmt: skip
    except subprocess.CalledProcessError as e:
        pytest.fail(f"compiling the core test failed:\n{' '.join(e.cmd)}\n{e.stderr[-4000:]}")
    binary = str(out / "core_test")
    subprocess.run([cxx, *SANITIZE, *objects, "-o", binary], check=True)
    return binary


def _run_core_test(binary: str) -> str:
    """Runs it under the sanitizers; returns stdout after asserting a clean pass."""
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    env.pop("LD_PRELOAD", None)
    result = subprocess.run([binary], capture_output=True, text=True, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "ALL PASSED" in result.stdout and "FAIL" not in output, output[-6000:]
    assert "runtime error" not in output and "AddressSanitizer" not in output, output[-6000:]
    return result.stdout


@pytest.fixture(scope="module")
def core_test_binary(tmp_path_factory) -> str:
    return _build_core_test(tmp_path_factory.mktemp("core_test"))


def test_core_under_asan_and_ubsan(core_test_binary):
    stdout = _run_core_test(core_test_binary)
    assert "spmm scalar checked" in stdout
    if "avx2=1" in stdout:
        assert "spmm avx2 checked" in stdout
    if "avx512=1" in stdout:
        assert "spmm avx512 checked" in stdout
    if "avx512bf16=1" in stdout:
        assert "spmm avx512bf16 checked" in stdout


def test_core_with_avx512_emulated(tmp_path):
    """The AVX-512 kernels (avx512 and avx512bf16) through the whole core test on any AVX2 CPU,
    their intrinsics emulated by SIMDe: the same checks against the scalar reference, bad meta
    named from every work unit, NaN/Inf, tails; under ASan + UBSan."""
    require_avx512_emulation()
    stdout = _run_core_test(_build_core_test(tmp_path, emulate_avx512=True))
    for isa in ("avx512", "avx512bf16"):
        assert f"{isa}=1" in stdout and f"spmm {isa} checked" in stdout, stdout[-3000:]


def test_cpu_isa_check_script_builds_with_setup_py_flags():
    # scripts/cpu_isa_check.py (run on lent machines whose CPUs have AVX-512) reads setup.py's
    # ISA_FLAGS without importing it and builds the same core sources as the test above.
    spec = importlib.util.spec_from_file_location(
        "cpu_isa_check", os.path.join(ROOT, "scripts", "cpu_isa_check.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.isa_flags() == load_setup_module().ISA_FLAGS
    assert sorted(script.library_sources()) == sorted(library_sources())


def test_spmm_threads_under_tsan(tmp_path):
    """spmm on 2 and 3 real threads (cc/sparse24/spmm_threads_test.cc) gives the single-thread
    output bit for bit, with no data race ThreadSanitizer sees: units share a row block's panels,
    packed by whichever unit needs them first."""
    cxx = os.environ.get("CXX", "g++")
    tsan = ["-fsanitize=thread", "-fno-omit-frame-pointer"]
    tests = [os.path.join(CORE, f"spmm_{name}_test.cc") for name in ("ctypes", "threads")]
    sources = [*library_sources(), *tests]
    objects = compile_objects(sources, str(tmp_path), ["-O1", "-g", *tsan], cxx=cxx)
    binary = str(tmp_path / "spmm_threads_test")
    subprocess.run([cxx, *tsan, *objects, "-o", binary, "-lpthread"], check=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["TSAN_OPTIONS"] = "halt_on_error=1"
    result = subprocess.run(
        [binary], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "THREADS PASSED" in result.stdout, output[-6000:]
    assert "ThreadSanitizer" not in output, output[-6000:]


def test_spmm_out_of_memory_on_a_worker_thread_reaches_the_caller(tmp_path):
    """A kernel's scratch allocated on a worker thread (the AVX2 GEMV's reordered x) that cannot be
    had is std::bad_alloc on the calling thread, not std::terminate (cc/sparse24/spmm_oom_test.cc:
    a bounded global operator new, units run on std::threads); no sanitizers, which replace
    operator new themselves."""
    cxx = os.environ.get("CXX", "g++")
    tests = [os.path.join(CORE, f"spmm_{name}_test.cc") for name in ("ctypes", "oom")]
    objects = compile_objects([*library_sources(), *tests], str(tmp_path), ["-O1"], cxx=cxx)
    binary = str(tmp_path / "spmm_oom_test")
    subprocess.run([cxx, *objects, "-o", binary, "-lpthread"], check=True)
    result = subprocess.run([binary], capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "OOM PASSED" in result.stdout, output[-4000:]
