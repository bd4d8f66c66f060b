#!/usr/bin/env python3
"""Runs the CPU kernel variants this machine has on the framework-free core: no TensorFlow.

Made for the machines this project is lent only now and then (the GPU machine's host CPU), since
the development machine has no AVX-512: builds cc/sparse24/core_test.cc (every kernel variant the
CPU runs against a float64 reference, under ASan + UBSan when the compiler has them) and
bench/spmm_core_bench.cc, runs the test, then times each variant single-threaded on the issue-5
shapes and prints a float32 and a bfloat16 table. Standard library only; the per-file ISA flags are
read from setup.py.

    python3 scripts/cpu_isa_check.py [--out DIR]      # about a minute on 16 cores
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import glob
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "cc", "sparse24")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ISAS = {"avx2": 2, "avx512": 3, "avx512bf16": 4}  # sparse24::Isa values
SHAPES = ["1x4096x4096", "16x4096x4096", "256x4096x4096", "32x768x3072", "32x3072x768"]


def isa_flags() -> dict[str, list[str]]:
    """setup.py's ISA_FLAGS, read without importing setup.py (no setuptools needed)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ISA_FLAGS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise SystemExit("setup.py has no ISA_FLAGS")


def build(sources: list[str], binary: str, flags: list[str], cxx: str) -> None:
    table = isa_flags()

    def compile_one(src: str) -> str:
        obj = os.path.join(os.path.dirname(binary), os.path.basename(src) + ".o")
        isa = next((f for suffix, f in table.items() if src.endswith(suffix)), [])
        subprocess.run(
            [cxx, "-std=c++17", *flags, *isa, f"-I{ROOT}", "-c", src, "-o", obj], check=True
        )
        return obj

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, sources))
    subprocess.run([cxx, *flags, *objects, "-o", binary, "-lpthread"], check=True)


def library_sources() -> list[str]:
    """The core's CPU sources: format, ISA detection, dispatch and every SpMM kernel."""
    spmm = [p for p in glob.glob(os.path.join(CORE, "spmm*.cc")) if not p.endswith("_test.cc")]
    return [os.path.join(CORE, n) for n in ("format.cc", "cpu_features.cc")] + sorted(spmm)


def sanitizers_work(cxx: str, tmp: str) -> bool:
    probe = os.path.join(tmp, "probe.cc")
    with open(probe, "w") as f:
        f.write("int main() { return 0; }\n")
    result = subprocess.run(
        [cxx, *SANITIZE, probe, "-o", os.path.join(tmp, "probe")], capture_output=True
    )
    return result.returncode == 0


def bench_table(binary: str, supported: list[str], dtype: int, repeats: int) -> list[str]:
    """Median single-thread ms per variant and shape (dtype: 0 float32, 1 bfloat16), variants
    interleaved run by run; the last column: first variant's time / last one's."""
    times = {(isa, s): [] for isa in supported for s in SHAPES}
    for _ in range(repeats):
        for shape in SHAPES:
            for isa in supported:
                out = subprocess.run(
                    [binary, *shape.split("x"), str(ISAS[isa]), str(dtype), "20"],
                    capture_output=True, text=True, check=True,
                ).stdout
                times[(isa, shape)].append(float(out.split(": ")[1].split(" ms")[0]))
    ratio = f"{supported[0]}/{supported[-1]}" if len(supported) > 1 else ""
    lines = [f"{'M x K x N':>14} " + " ".join(f"{isa + ' ms':>14}" for isa in supported)
             + f"   {ratio}"]
    for shape in SHAPES:
        med = [statistics.median(times[(isa, shape)]) for isa in supported]
        row = f"{shape:>14} " + " ".join(f"{m:14.3f}" for m in med)
        if len(med) > 1:
            row += f"   {med[0] / med[-1]:{len(ratio)}.2f}"
        lines.append(row)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cxx = os.environ.get("CXX", "g++")
    tmp = tempfile.mkdtemp(prefix="cpu_isa_check_")
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"],
                         capture_output=True, text=True).stdout.strip()
    print(f"== cpu_isa_check: {cpu or 'unknown CPU'}", flush=True)

    sanitize = SANITIZE if sanitizers_work(cxx, tmp) else []
    test = os.path.join(tmp, "core_test")
    build([os.path.join(CORE, "core_test.cc"), *library_sources()], test,
          ["-O1", "-g", *sanitize], cxx)
    result = subprocess.run([test], capture_output=True, text=True)
    log = result.stdout + result.stderr
    checked = [isa for isa in ("scalar", *ISAS) if f"spmm {isa} checked" in result.stdout]
    passed = result.returncode == 0 and "ALL PASSED" in result.stdout
    print(f"core_test ({'ASan+UBSan' if sanitize else 'no sanitizers'}): "
          f"{'PASSED' if passed else 'FAILED'}; kernel variants checked: {', '.join(checked)}")
    if not passed:
        print(log[-4000:])

    bench = os.path.join(tmp, "spmm_core_bench")
    build([os.path.join(ROOT, "bench", "spmm_core_bench.cc"), *library_sources()], bench,
          ["-O3"], cxx)
    table = []
    for dtype, name, variants in ((0, "float32", ("avx2", "avx512")),
                                  (1, "bfloat16", tuple(ISAS))):
        supported = [isa for isa in variants if isa in checked]
        if supported:
            table += [f"single-thread Sparse24 SpMM, {name}, median ms (thread CPU time):",
                      *bench_table(bench, supported, dtype, args.repeats)]
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_isa_check.log"), "w") as f:
            f.write(log + "\n" + "\n".join(table) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
