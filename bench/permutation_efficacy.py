"""Channel-permutation efficacy on apex ASP's random test matrix (its `permutation_tests`).

ASP's generator: `np.random.seed(seed); np.random.rand(filters, channels)` with 128 filters x 64
channels, groups of 4 along channels. Efficacy = (lost_plain - lost_permuted) /
(lost_plain - lost_rows50), in percent. ASP reports, for seed 1: 36.6% for its best strategy
(optimize_stripe_groups,12,0) in 0.86 s on a V100, and 32-36% in 56-61 s on CPU.

    .venv/bin/python bench/permutation_efficacy.py            # 25 seeds, default budget
    .venv/bin/python bench/permutation_efficacy.py --seeds 5 --kicks 0
    .venv/bin/python bench/permutation_efficacy.py --seeds 1 --filters 1024 --channels 2048 \
        --block-channels none                       # wide layers: one search vs blocks (default)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tf_sparse24.permute_search import permutation_efficacy, search_permutation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=25, help="seeds 1..N (ASP's default seed is 1)")
    parser.add_argument("--filters", type=int, default=128)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--kicks", type=int, default=None,
                        help="escape rounds per block (default: default_kicks of the block)")
    parser.add_argument("--block-channels", default="512",
                        help="search_permutation's block_channels ('none': one search)")
    args = parser.parse_args()
    block = None if args.block_channels.lower() == "none" else int(args.block_channels)
    print(f"matrix {args.filters}x{args.channels} (ASP: rows=filters, groups of 4 along channels), "
          f"kicks={'default' if args.kicks is None else args.kicks}, block_channels={block}")
    print(f"{'seed':>4} {'efficacy %':>11} {'wall s':>7} {'cpu s':>6}")
    effs, secs, cpu = [], [], []
    for seed in range(1, args.seeds + 1):
        np.random.seed(seed)
        matrix = np.random.rand(args.filters, args.channels)  # ASP's generator, [filters, channels]
        start, cpu_start = time.perf_counter(), time.process_time()
        perm = search_permutation(matrix, axis=1, kicks=args.kicks, seed=0,  # channels = axis 1
                                  block_channels=block)
        secs.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        assert sorted(perm.tolist()) == list(range(args.channels))
        effs.append(permutation_efficacy(matrix, perm))
        print(f"{seed:>4} {effs[-1]:>11.2f} {secs[-1]:>7.2f} {cpu[-1]:>6.2f}", flush=True)
    effs, secs, cpu = np.array(effs), np.array(secs), np.array(cpu)
    print(f"efficacy %: mean {effs.mean():.2f}  min {effs.min():.2f}  max {effs.max():.2f}  "
          f"(ASP best on seed 1: 36.6)")
    print(f"seconds per matrix: wall median {np.median(secs):.2f} max {secs.max():.2f}; "
          f"cpu median {np.median(cpu):.2f} max {cpu.max():.2f}  (goal < 10 at 64 channels)")


if __name__ == "__main__":
    main()
