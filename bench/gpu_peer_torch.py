"""PyTorch peer for scripts/gpu_check.sh: torch's 2:4 semi-structured sparsity vs dense F.linear.

Same shapes as cc/sparse24/gpu_check (M=N=K sizes, transformer-FFN K x N at several batch sizes),
y = x @ W with W [K, N] 2:4 along K, in torch's layout F.linear(x, W^T). Times, side by side in one
process with CUDA events (median of timed batches after warm-up, inputs rotated past L2):
  dense   F.linear(x, Wt)                                     (cuBLAS)
  semi    F.linear(x, to_sparse_semi_structured(Wt))          (cuSPARSELt backend when available)
  cslt    torch._cslt_sparse_mm(compressed Wt, x.t(), transpose_result=True), x padded to a
          multiple of 16 rows (cuSPARSELt without the wrapper; the exact layout tf_sparse24's
          GPU op uses)
and checks each result against float64 (never on zeros). Prints a ratio table, one row as each
shape is measured; writes $OUT/gpu_peer_torch.log and .csv with --out, row by row too (a run cut
short by its time limit keeps what it measured). Unknown flags (the harness's) are ignored.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

# What torch raises for an unsupported shape, dtype, GPU or missing API.
PEER_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError, AttributeError, ImportError)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,8192,16384")
    p.add_argument("--ffn", default="768x3072,3072x768,4096x11008,11008x4096", help="KxN pairs")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    args, _ = p.parse_known_args(argv)
    return args


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def random_24(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Wt [N, K] with exactly 2 non-zeros (magnitudes in [0.25, 1)) in every 4 along K."""
    values = torch.rand(n, k, generator=gen, device="cuda") * 0.75 + 0.25
    values *= torch.where(torch.rand(n, k, generator=gen, device="cuda") < 0.5, -1.0, 1.0)
    scores = torch.rand(n, k // 4, 4, generator=gen, device="cuda")
    keep = scores.argsort(dim=-1)[..., :2]
    mask = torch.zeros(n, k // 4, 4, device="cuda").scatter_(-1, keep, 1.0).reshape(n, k)
    return (values * mask).to(dtype)


def time_ms(fn, copies: int, warmup: int, reps: int) -> float:
    for i in range(warmup):
        fn(i % copies)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    end.synchronize()
    per = max(1, min(200, int(0.5 / max(start.elapsed_time(end), 1e-4))))
    samples, i = [], 0
    for _ in range(reps):
        start.record()
        for _ in range(per):
            fn(i % copies)
            i += 1
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / per)
    return statistics.median(samples)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y.double() - ref).norm() / ref.norm())


def run_shape(dtype, m, k, n, args, gen, l2_bytes) -> dict:
    es = torch.finfo(dtype).bits // 8
    # Operand sets used in turn so that the timed calls read from memory, not L2 (as gpu_check).
    copies = max(1, min(64, 3 * l2_bytes // ((k * n + m * k + m * n) * es) + 1))
    wts = [random_24(n, k, dtype, gen) for _ in range(copies)]
    xs = [(torch.rand(m, k, generator=gen, device="cuda") * 2 - 1).to(dtype) for _ in range(copies)]
    ref = xs[0].double() @ wts[0].double().t()
    row = {"dtype": str(dtype).split(".")[-1], "M": m, "K": k, "N": n}
    row["dense_ms"] = time_ms(lambda i: F.linear(xs[i], wts[i]), copies, args.warmup, args.reps)
    row["dense_err"] = rel_err(F.linear(xs[0], wts[0]), ref)
    try:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        SparseSemiStructuredTensor._FORCE_CUTLASS = False  # prefer cuSPARSELt where built in
        sws = [to_sparse_semi_structured(w) for w in wts]
        row["semi_ms"] = time_ms(lambda i: F.linear(xs[i], sws[i]), copies, args.warmup, args.reps)
        row["semi_err"] = rel_err(F.linear(xs[0], sws[0]), ref)
        row["semi_backend"] = type(sws[0]).__name__
    except PEER_ERRORS as e:  # a peer limitation is a result to report, not a crash
        row["semi_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
    try:
        cws = [torch._cslt_compress(w) for w in wts]
        # x padded to a multiple of 16 rows, as tf_sparse24's op does: x.t() of a [1, K] x would
        # be a [K, 1] operand with leading dimension 1, which cuSPARSELt refuses.
        m_pad = -(-m // 16) * 16
        xts = [F.pad(x, (0, 0, 0, m_pad - m)).t() for x in xs]

        def cslt(i: int) -> torch.Tensor:
            return torch._cslt_sparse_mm(cws[i], xts[i], transpose_result=True)[:m]  # [M, N]

        row["cslt_ms"] = time_ms(cslt, copies, args.warmup, args.reps)
        row["cslt_err"] = rel_err(cslt(0), ref)
    except PEER_ERRORS as e:
        row["cslt_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return row


HEADER = (
    f"{'dtype':<8} {'M':>6} {'K':>6} {'N':>6} | {'dense ms':>9} {'semi ms':>9} {'cslt ms':>9} "
    f"| {'semi/dns':>8} {'cslt/dns':>8} | {'err dns':>8} {'err semi':>8} {'err cslt':>8}"
)


CSV_KEYS = ("dtype", "M", "K", "N", "dense_ms", "semi_ms", "cslt_ms", "dense_err", "semi_err",
            "cslt_err")


def format_row(r: dict) -> str:
    def cell(key: str, spec: str) -> str:
        return format(r[key], spec) if key in r else "n/a"

    def ratio(key: str) -> str:
        return f"{r['dense_ms'] / r[key]:.2f}x" if key in r else "n/a"

    return (
        f"{r['dtype']:<8} {r['M']:>6} {r['K']:>6} {r['N']:>6} | {r['dense_ms']:>9.4f} "
        f"{cell('semi_ms', '>9.4f'):>9} {cell('cslt_ms', '>9.4f'):>9} | {ratio('semi_ms'):>8} "
        f"{ratio('cslt_ms'):>8} | {r['dense_err']:>8.1e} {cell('semi_err', '>8.1e'):>8} "
        f"{cell('cslt_err', '>8.1e'):>8}"
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_peer_torch: no CUDA device visible to torch", file=sys.stderr)
        return 3
    log = csv = None
    if args.out:  # written row by row: a run cut short by its time limit keeps what it measured
        log = open(os.path.join(args.out, "gpu_peer_torch.log"), "w")  # noqa: SIM115
        csv = open(os.path.join(args.out, "gpu_peer_torch.csv"), "w")  # noqa: SIM115
        csv.write(",".join(CSV_KEYS) + "\n")

    def out(line: str = "") -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    props = torch.cuda.get_device_properties(0)
    lt_version = getattr(getattr(torch.backends, "cusparselt", None), "version", lambda: None)()
    out(f"gpu_peer_torch: torch {torch.__version__}, {props.name}, cuSPARSELt {lt_version}")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    shapes = [(s, s, s) for s in ints(args.sizes)]
    for pair in args.ffn.split(","):
        if pair:
            k, n = (int(v) for v in pair.split("x"))
            shapes += [(b, k, n) for b in ints(args.batches)]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
    backends, failures = set(), 0
    out()
    out(HEADER)
    for name in args.dtypes.split(","):
        for m, k, n in shapes:
            r = run_shape(dtypes[name], m, k, n, args, gen, l2_bytes)
            torch.cuda.empty_cache()
            out(format_row(r))
            if csv:
                csv.write(",".join(str(r.get(key, "")) for key in CSV_KEYS) + "\n")
                csv.flush()
            backends |= {r["semi_backend"]} if "semi_backend" in r else set()
            tol = 1e-2 if r["dtype"] == "bfloat16" else 2e-3
            for key in ("dense_err", "semi_err", "cslt_err"):
                if key in r and not r[key] < tol:
                    failures += 1
                    out(f"  FAIL {key} = {r[key]:.2e} > {tol} at M={m} K={k} N={n}")
            for key in ("semi_error", "cslt_error"):
                if key in r:
                    out(f"  {key.split('_')[0]} n/a at M={m} K={k} N={n}: {r[key]}")
    out(f"ratios > 1: 2:4 faster than dense. semi backend: {', '.join(sorted(backends)) or 'n/a'}")
    for f in (log, csv):
        if f:
            f.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
