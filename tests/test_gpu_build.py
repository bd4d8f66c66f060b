"""The GPU path compiles (compile only: CI has no GPU) and its host-side parts behave.

* `TF_SPARSE24_CUDA=1 setup.py build_ext` builds the op library with every GPU source, the GPU
  kernels really are in the objects, and the library loads into TensorFlow here (no GPU): its CPU
  kernels still answer correctly and TensorFlow has its GPU kernels registered for every op and
  dtype (what a GPU machine would dispatch to; running them needs the GPU, docs/GPU.md).
* The gpu_check harness links, parses its flags, and finds / loads cuSPARSELt and cuBLAS (stand-in
  libraries exporting the same symbols), or says what to install when they are missing.
* cc/sparse24/cusparselt.h (our declarations of the cuSPARSELt API) matches a real cusparseLt.h,
  when the nvidia-cusparselt wheel is installed (it is 170-240 MB, so it is not a test dependency;
  scripts/gpu_check.sh runs the same check on the GPU machine).

Without nvcc the tests fail under CI=true and are skipped elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from cc_build import GPU_KERNELS, check_op_library, load_setup_module, require_nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUSPARSELT_SYMBOLS = [
    "cusparseLtInit",
    "cusparseLtDestroy",
    "cusparseLtGetVersion",
    "cusparseLtDenseDescriptorInit",
    "cusparseLtStructuredDescriptorInit",
    "cusparseLtMatDescriptorDestroy",
    "cusparseLtMatmulDescriptorInit",
    "cusparseLtMatmulAlgSelectionInit",
    "cusparseLtMatmulAlgSelectionDestroy",
    "cusparseLtMatmulAlgGetAttribute",
    "cusparseLtMatmulGetWorkspace",
    "cusparseLtMatmulPlanInit",
    "cusparseLtMatmulPlanDestroy",
    "cusparseLtMatmul",
    "cusparseLtMatmulSearch",
    "cusparseLtSpMMACompressedSize2",
    "cusparseLtSpMMACompress2",
]
CUBLAS_SYMBOLS = ["cublasCreate_v2", "cublasSetStream_v2", "cublasSetMathMode", "cublasGemmEx"]


@pytest.fixture(scope="module")
def nvcc() -> str:
    return require_nvcc()


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, **kwargs)


def _source_key(nvcc: str) -> str:
    """Hash of setup.py, of every C++/CUDA file under cc/ and of the nvcc used."""
    digest = hashlib.sha256(nvcc.encode())
    paths = sorted(glob.glob(os.path.join(ROOT, "cc", "**", "*"), recursive=True))
    for path in [os.path.join(ROOT, "setup.py"), *paths]:
        if path.endswith((".h", ".cc", ".cu", ".py")):
            digest.update(path.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def build(nvcc: str) -> dict:
    """The op library as `TF_SPARSE24_CUDA=1` builds it (setup.py build_ext, CPU and GPU sources),
    and the gpu_check harness linked from the same GPU objects.

    Built once per source state under build/test_gpu_build/<hash> (a file lock makes parallel
    pytest workers share one build instead of compiling twice).
    """
    setup = load_setup_module()
    cache = os.path.join(ROOT, "build", "test_gpu_build")
    os.makedirs(cache, exist_ok=True)
    out = os.path.join(cache, _source_key(nvcc))
    obj_dir = os.path.join(out, "temp", "sparse24_objs")  # where build_ext puts its objects
    gpu_objects = [obj for _, obj in setup.gpu_compile_jobs([], obj_dir, nvcc=nvcc)]
    harness_obj = os.path.join(out, "gpu_check.o")
    harness = os.path.join(out, "gpu_check")
    commands = [
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", os.path.join(out, "lib"),
         "--build-temp", os.path.join(out, "temp")],
        [nvcc, *setup.NVCC_FLAGS, f"-I{ROOT}", "-c",
         os.path.join(ROOT, "cc", "sparse24", "gpu_check.cu"), "-o", harness_obj],
    ]  # fmt: skip
    env = {**os.environ, "TF_SPARSE24_CUDA": "1", "NVCC": nvcc}
    with open(os.path.join(cache, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(out, "done")):
            for old in os.listdir(cache):
                if old != "lock":
                    shutil.rmtree(os.path.join(cache, old), ignore_errors=True)
            os.makedirs(out)
            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                results = list(pool.map(lambda cmd: (cmd, _run(cmd, env=env)), commands))
            failures = [f"{' '.join(c)}\n{r.stderr[-3000:]}" for c, r in results if r.returncode]
            assert not failures, "the GPU build failed:\n" + "\n\n".join(failures)
            harness_objs = [o for o in gpu_objects if "cc_sparse24_" in os.path.basename(o)]
            link = _run([nvcc, *setup.CUDA_ARCH_FLAGS, harness_obj, *harness_objs, "-o", harness,
                         "-ldl", "-lpthread"])  # fmt: skip
            assert link.returncode == 0, link.stderr[-3000:]
            open(os.path.join(out, "done"), "w").close()
    (library,) = glob.glob(os.path.join(out, "lib", "tf_sparse24", "_sparse24_ops*.so"))
    return {"setup": setup, "objects": {os.path.basename(o): o for o in gpu_objects},
            "library": library, "harness": harness}  # fmt: skip


def test_every_gpu_source_is_built_by_setup(build: dict) -> None:
    setup = build["setup"]
    sources = {os.path.relpath(s, ROOT) for s in setup.gpu_sources()}
    on_disk = {
        os.path.relpath(s, ROOT) for s in glob.glob(os.path.join(ROOT, "cc", "tf", "*.cu.cc"))
    }
    on_disk |= {
        os.path.relpath(s, ROOT)
        for s in glob.glob(os.path.join(ROOT, "cc", "sparse24", "gpu_*.cu"))
    }
    on_disk.discard("cc/sparse24/gpu_check.cu")
    assert on_disk <= sources
    # The CPU build leaves the GPU-only glue out.
    assert not any("cusparselt" in s for s in setup._cpu_sources())


def test_gpu_objects_hold_the_kernels(build: dict) -> None:
    """GOOGLE_CUDA took effect: the TF GPU kernels and the CUDA kernels are in the objects."""
    objects = build["objects"]
    tf_obj = next(o for name, o in objects.items() if name.startswith("cc_tf_"))
    symbols = _run(["nm", "-C", tf_obj]).stdout
    for op in ("Sparse24MatMulGpuOp", "Sparse24CompressGpuOp", "Sparse24DecompressGpuOp"):
        assert op in symbols, f"{op} missing from {tf_obj}"
    kernels = next(o for name, o in objects.items() if name.endswith("gpu_kernels.cu.o"))
    sass = _run(["cuobjdump", "--list-elf", kernels]) if shutil.which("cuobjdump") else None
    if sass is not None and sass.returncode == 0:
        assert "sm_80" in sass.stdout and "sm_90" in sass.stdout, sass.stdout
    assert "compress_kernel" in _run(["nm", "-C", kernels]).stdout


def test_gpu_library_keeps_its_cuda_runtime_private(build: dict) -> None:
    """setup.py's GPU link flags leave no cuda* symbol to TensorFlow's CUDA 12 runtime stub."""
    dynamic = _run(["nm", "-D", build["library"]]).stdout.splitlines()
    assert not [line for line in dynamic if " cuda" in line], "cuda* symbols left to the loader"
    assert "Sparse24MatMulGpuOp" in _run(["nm", "-C", build["library"]]).stdout


def test_gpu_library_loads_into_tensorflow(build: dict) -> None:
    """The TF_SPARSE24_CUDA=1 library loads into TensorFlow on a machine without a GPU, its CPU
    kernels still answer correctly, and TensorFlow has its GPU kernels for every op and dtype."""
    report = check_op_library(build["library"])
    for op, found in report["kernels"].items():
        assert GPU_KERNELS <= set(found), (op, found)


def _stub_library(directory, soname: str, symbols: list[str]) -> str:
    """A shared library exporting `symbols` (each a function returning 0)."""
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, soname + ".c")
    with open(src, "w") as f:
        f.writelines(f"int {name}(void) {{ return 0; }}\n" for name in symbols)
    path = os.path.join(directory, soname)
    result = _run(["gcc", "-shared", "-fPIC", src, "-o", path])
    assert result.returncode == 0, result.stderr
    return path


def _harness(build: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "LD_LIBRARY_PATH": "", **(env or {})}
    full_env.pop("TF_SPARSE24_CUSPARSELT", None)
    return _run([build["harness"], *args], env=full_env, timeout=60)


def test_harness_loads_libraries_found_by_the_script(build: dict, tmp_path) -> None:
    site = tmp_path / "site"  # laid out like the nvidia-cusparselt-cu13 / nvidia-cublas wheels
    lt = _stub_library(site / "nvidia" / "cu13" / "lib", "libcusparseLt.so.0", CUSPARSELT_SYMBOLS)
    cublas = _stub_library(site / "nvidia" / "cu13" / "lib", "libcublas.so.13", CUBLAS_SYMBOLS)
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PYTHON": sys.executable,
        "GPU_CHECK_BIN": build["harness"],
        "OUT": str(tmp_path / "out"),
        # headers only (cusparse.h for the script's ABI check when cusparseLt.h is installed), no
        # libraries, so the stand-ins above are what the script finds
        "CUDA_HOME": os.path.dirname(_tf_cuda_include()),
    }
    found = _run(["bash", "scripts/gpu_check.sh", "--find-only"], env=env, timeout=60)
    assert found.returncode == 0, found.stdout + found.stderr
    assert f"cusparselt: {lt}" in found.stdout and f"cublas: {cublas}" in found.stdout
    dry = _run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--sizes", "8192", "--batches", "1,8"],
        env=env,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "sizes 8192;" in dry.stdout and "batches 1 8;" in dry.stdout
    assert f"cuBLAS: loaded {cublas}" in dry.stdout and "no GPU work done" in dry.stdout
    if _installed_cusparselt_header():  # the script's own ABI check ran against the real header
        assert "cusparselt ABI check: ok" in dry.stdout
    with open(tmp_path / "out" / "gpu_check.log") as f:  # the log mirrors stdout
        assert "no GPU work done" in f.read()


def test_missing_cusparselt_says_what_to_install(build: dict, tmp_path) -> None:
    result = _harness(build, "--dry-run", "--cusparselt", str(tmp_path / "absent.so"))
    assert result.returncode == 3
    assert "pip install tf_sparse24[gpu]" in result.stdout
    assert (
        "nvidia-cusparselt-cu12" in result.stdout and str(tmp_path / "absent.so") in result.stdout
    )


def test_old_cusparselt_is_named(build: dict, tmp_path) -> None:
    lt = _stub_library(tmp_path, "libcusparseLt.so.0", CUSPARSELT_SYMBOLS[:-1])
    result = _harness(build, "--dry-run", "--cusparselt", lt)
    assert result.returncode == 3
    assert "lacks cusparseLtSpMMACompress2" in result.stdout and ">= 0.6" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "4096,100"], "multiple of 16. Received: 100"),
        (["--ffn", "768by3072"], "expected KxN pairs like 768x3072. Received: '768by3072'"),
        (["--dtypes", "fp8"], "bf16 or fp16. Received: 'fp8'"),
        (["--reps", "0"], "--reps: expected an integer in [1, 10000]. Received: '0'"),
        (["--bogus"], "unknown argument '--bogus'"),
    ],
)
def test_harness_rejects_bad_flags(build: dict, args: list[str], message: str) -> None:
    result = _harness(build, "--dry-run", *args)
    assert result.returncode == 2 and message in result.stdout, result.stdout


def _installed_cusparselt_header() -> str | None:
    for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        hits = glob.glob(os.path.join(root, "nvidia", "*", "include", "cusparseLt.h"))
        if hits:
            return hits[0]
    return None


def _tf_cuda_include() -> str:
    import tensorflow as tf

    return os.path.join(tf.sysconfig.get_include(), "third_party", "gpus", "cuda", "include")


def test_cusparselt_declarations_match_the_real_header(nvcc: str) -> None:
    header = _installed_cusparselt_header()
    if header is None:
        pytest.skip(
            "nvidia-cusparselt-cu12/-cu13 not installed (170-240 MB); "
            "scripts/gpu_check.sh runs this check where it is"
        )
    cuda_include = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
    result = _run(
        [
            "g++",
            "-std=c++17",
            "-fsyntax-only",
            f"-I{ROOT}",
            f"-I{os.path.dirname(header)}",
            f"-I{cuda_include}",
            "-I/usr/local/cuda/include",
            # cusparseLt.h includes cusparse.h: a toolkit with only nvcc lacks it, the full
            # tensorflow package ships it with its bundled CUDA headers.
            f"-I{_tf_cuda_include()}",
            "cc/sparse24/cusparselt_abi_check.cc",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
