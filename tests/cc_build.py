"""Compiling cc/ sources for the C++-level tests with exactly setup.py's per-file flags."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import subprocess
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


def compile_objects(sources: list[str], out_dir: str, flags: list[str], cxx: str = "g++") -> list[str]:
    """Compiles each source to out_dir/<name>.o in parallel, adding setup.py's ISA flags per file.

    Raises subprocess.CalledProcessError (with stderr) on the first failure.
    """
    isa_flags = load_setup_module().ISA_FLAGS

    def compile_one(src: str) -> str:
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        isa = next((f for suffix, f in isa_flags.items() if src.endswith(suffix)), [])
        cmd = [cxx, "-std=c++17", "-Wall", *flags, *isa, f"-I{ROOT}", "-c", src, "-o", obj]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, sources))
