#!/usr/bin/env bash
# Builds the framework-free GPU harness (cc/sparse24/gpu_check.cu) with nvcc, runs its checks and
# its cuSPARSELt-vs-cuBLAS timings, then the PyTorch peer (bench/gpu_peer_torch.py) on the same
# shapes, then (since the GPU machine's host CPU likely has the AVX-512 this project's development
# machine lacks) scripts/cpu_isa_check.py: the CPU core test and a short single-thread bench of
# every CPU kernel variant there (about a minute, at most 2). The GPU tables print before the
# CPU check; every stage has a time limit (see the end). Needs an
# NVIDIA GPU (sm_80+), nvcc, and the cuSPARSELt and cuBLAS libraries, found in the Python
# environment's nvidia-* wheels (nvidia/*/lib), $CUDA_HOME/lib64 or the loader path; no
# TensorFlow. Logs and CSV go to $OUT when it is set.
#
#   bash scripts/gpu_check.sh                 # everything (about 2-4 minutes on an H200)
#   bash scripts/gpu_check.sh --find-only     # just report which nvcc/libraries would be used
#   bash scripts/gpu_check.sh --dry-run       # build, load the libraries, parse flags; no GPU work
#   bash scripts/gpu_check.sh --sizes 8192 --batches 1 --dtypes bf16   # other flags: gpu_check --help
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python3, else python3), NVCC, CUDA_HOME,
# CUSPARSELT_LIB / CUBLAS_LIB (full paths, skip the search), GPU_CHECK_BUILD (build directory).
set -euo pipefail
cd "$(dirname "$0")/.."

find_only=0
no_gpu_work=0  # --dry-run / --help: the harness parses flags and returns; nothing is measured
args=()
for a in "$@"; do
  if [[ "$a" == "--find-only" ]]; then find_only=1; else args+=("$a"); fi
  [[ "$a" == "--dry-run" || "$a" == "--help" || "$a" == "-h" ]] && no_gpu_work=1
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x /opt/torch/.venv/bin/python3 ]]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
BUILD=${GPU_CHECK_BUILD:-build/gpu_check}
LOG_DIR=${OUT:-$BUILD}

# First file matching one of the names: nvidia wheels on the Python path and in the project's
# .venv, then CUDA_HOME, then the loader cache. Prints nothing if none is found.
find_file() {
  "$PYTHON" - "$CUDA_HOME" "$@" <<'EOF' 2>/dev/null || true
import glob, os, site, subprocess, sys, sysconfig
cuda_home, names = sys.argv[1], sys.argv[2:]
# Python's own import order first (PYTHONPATH before site-packages), then site dirs it may lack.
roots = [p for p in sys.path if p]
for getter in (site.getsitepackages, lambda: [site.getusersitepackages()],
               lambda: [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
    try:
        roots += [r for r in getter() if r not in roots]
    except Exception:
        pass
roots += sorted(map(os.path.abspath, glob.glob(".venv/lib/python3*/site-packages")))  # make test
for name in names:
    for root in roots:
        for sub in ("nvidia/*/lib", "nvidia/*/include", "nvidia/lib", "nvidia/include"):
            hits = sorted(glob.glob(os.path.join(root, sub, name)))
            if hits:
                print(hits[0]); sys.exit(0)
    for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "include")):
        if os.path.exists(os.path.join(d, name)):
            print(os.path.join(d, name)); sys.exit(0)
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        cache = ""
    for line in cache.splitlines():
        if line.strip().startswith(name + " ") and "=>" in line:
            print(line.split("=>")[-1].strip()); sys.exit(0)
sys.exit(1)
EOF
}

LT_LIB=${CUSPARSELT_LIB:-$(find_file libcusparseLt.so.0)}
CUBLAS=${CUBLAS_LIB:-$(find_file libcublas.so.13 libcublas.so.12 libcublas.so)}
LT_HEADER=$(find_file cusparseLt.h)
echo "== gpu_check: python $PYTHON; nvcc $NVCC"
echo "cusparselt: ${LT_LIB:-NOT FOUND (pip install nvidia-cusparselt-cu12 or -cu13, or set CUSPARSELT_LIB)}"
echo "cublas: ${CUBLAS:-NOT FOUND (pip install nvidia-cublas, or set CUBLAS_LIB)}"
echo "cusparseLt.h: ${LT_HEADER:-not found (ABI check skipped)}"
if [[ $find_only == 1 ]]; then
  [[ -n "$LT_LIB" && -n "$CUBLAS" ]] && exit 0 || exit 3
fi
if [[ -z "${GPU_CHECK_BIN:-}" && ! -x "$NVCC" ]]; then echo "gpu_check: nvcc not found (set NVCC or CUDA_HOME)"; exit 3; fi

mkdir -p "$BUILD" "$LOG_DIR"
# cuBLAS and cuSPARSELt find their companions (libcublasLt, ...) beside them.
for lib in "$CUBLAS" "$LT_LIB"; do
  [[ -n "$lib" ]] && LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export LD_LIBRARY_PATH
if [[ -n "$LT_HEADER" && -x "$NVCC" ]]; then
  # Our own declarations of the cuSPARSELt API (cc/sparse24/cusparselt.h) against the real header;
  # a mismatch (a failed static_assert) stops here, before anything calls the library through
  # wrong declarations. Any other compile error (a header the wheel's cusparseLt.h includes is
  # missing, say) only skips the check. nvcc compiles it as host C++ so its own CUDA include
  # directories come after ours.
  abi_log="$LOG_DIR/cusparselt_abi_check.out"
  if "$NVCC" -std=c++17 -x c++ -c -o /dev/null -I. -I"$(dirname "$LT_HEADER")" \
      -I"$CUDA_HOME/include" cc/sparse24/cusparselt_abi_check.cc >"$abi_log" 2>&1; then
    echo "cusparselt ABI check: ok (cc/sparse24/cusparselt.h matches $LT_HEADER)"
  elif grep -q "static assert\|static_assert" "$abi_log"; then
    cat "$abi_log"; echo "cusparselt ABI check: MISMATCH with $LT_HEADER"; exit 1
  else
    cat "$abi_log"; echo "cusparselt ABI check: could not compile (see above); skipped"
  fi
fi
HARNESS=${GPU_CHECK_BIN:-$BUILD/gpu_check}  # GPU_CHECK_BIN: a prebuilt harness (tests use it)
if [[ -z "${GPU_CHECK_BIN:-}" ]]; then
  echo "building $HARNESS ..."
  "$NVCC" -std=c++17 -O3 --threads 0 -gencode=arch=compute_90,code=sm_90 \
      -gencode=arch=compute_80,code="[sm_80,compute_80]" -I. cc/sparse24/gpu_check.cu \
      cc/sparse24/gpu_blas.cu cc/sparse24/gpu_dlopen.cu cc/sparse24/gpu_kernels.cu \
      cc/sparse24/gpu_matmul.cu cc/sparse24/gpu_spmm.cu cc/sparse24/cusparselt.cc \
      -o "$HARNESS" -ldl -lpthread
fi

# Each stage is bounded, so a hang cannot eat the machine's time and lose the tables: the GPU
# summaries print as soon as the GPU stages end, then the CPU kernel variants on this host run
# (also when the GPU part could not). Override the limits (seconds) with HARNESS_TIMEOUT,
# PEER_TIMEOUT, CPU_TIMEOUT. The defaults (240 + 90 + 90 s, plus the nvcc build) keep even a run
# where every stage hangs inside one 10-minute call on a lent GPU machine; the harness and the peer
# print and log each table row as it is measured, so a stage cut short keeps its rows.
cpu_check() {
  timeout "${CPU_TIMEOUT:-90}" "$PYTHON" scripts/cpu_isa_check.py --out "$LOG_DIR" 2>&1 |
    tee "$LOG_DIR/cpu_isa_check.out"
  local cpu_rc=${PIPESTATUS[0]}
  [[ $cpu_rc == 0 ]] || echo "cpu_isa_check: FAILED or timed out (exit $cpu_rc)"
  echo
  echo "== summary: CPU kernel variants on this host (scripts/cpu_isa_check.py)"
  grep -E '^(== cpu_isa_check|core_test|single-thread| +M x K|[ 0-9x]+ +[0-9.])' \
      "$LOG_DIR/cpu_isa_check.out" 2>/dev/null || echo "(no CPU check log)"
}

set +e
timeout "${HARNESS_TIMEOUT:-240}" "$HARNESS" ${LT_LIB:+--cusparselt "$LT_LIB"} \
    ${CUBLAS:+--cublas "$CUBLAS"} --out "$LOG_DIR" ${args[@]+"${args[@]}"}
rc=$?
[[ $rc == 124 ]] && echo "gpu_check: harness TIMED OUT after ${HARNESS_TIMEOUT:-240} s (log so far: $LOG_DIR/gpu_check.log)"
[[ $no_gpu_work == 1 ]] && exit $rc
if [[ $rc == 2 || $rc == 3 ]]; then cpu_check; exit $rc; fi
PYTHONUNBUFFERED=1 timeout "${PEER_TIMEOUT:-90}" "$PYTHON" bench/gpu_peer_torch.py \
    --out "$LOG_DIR" ${args[@]+"${args[@]}"}
peer_rc=$?
[[ $peer_rc == 124 ]] && echo "gpu_peer_torch: TIMED OUT after ${PEER_TIMEOUT:-90} s"

echo
echo "== summary: tf_sparse24 harness (cuSPARSELt 2:4 vs cuBLAS dense)"
if grep -q '^== benchmark table' "$LOG_DIR/gpu_check.log" 2>/dev/null; then
  sed -n '/^== benchmark table/,/launch-bound/p' "$LOG_DIR/gpu_check.log"
else  # stopped early (a failure, or the time limit): the rows measured so far
  sed -n '/^== benchmark:/,$p' "$LOG_DIR/gpu_check.log" 2>/dev/null | grep -v '^ *\[ok\]'
fi
grep -E '^\s+\[FAIL\]|^gpu_check: ' "$LOG_DIR/gpu_check.log" | tail -n 20
echo "== summary: PyTorch peer (torch semi-structured 2:4 vs dense F.linear)"
sed -n '/^dtype /,$p' "$LOG_DIR/gpu_peer_torch.log" 2>/dev/null || echo "(no peer log)"
echo "harness exit $rc, peer exit $peer_rc; logs in $LOG_DIR"
cpu_check
set -e
exit $(( rc != 0 ? rc : peer_rc ))
