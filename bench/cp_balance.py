"""Per-rank causal attention area of context-parallel splits on the paper-mix long-level packs.

    python bench/cp_balance.py [--world 32] [--seed 0] [--figure docs/figures/cp_balance.png]

Workload paper_mix.npy (400K chat samples + 2K long-context samples), planned by HBP with levels
[32K sp1, 128K sp{cp}] for cp 2 and 4, and [32K sp1, 256K sp8] and [32K sp1, 128K sp8] for cp 8.
With --figure, also draws the per-rank area of two 128K packs at cp 4 and 8, contiguous against
split_pack (``lit_hbp.simulate.plots.cp_balance_figure``; the figure of docs/levels.md). Every pack of the
long level is padded as collate pads it (to a multiple of lcm(8, cp), the
padding a segment of its own) and split over cp ranks two ways: contiguously (rank r holds tokens
[r T / cp, (r + 1) T / cp)) and by ``lit_hbp.packing.context_split.split_pack``. Imbalance is
max / mean causal area over the ranks of a pack (the bar: <= 1.05 on every pack at cp 4 and 8).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from workloads import load

from lit_hbp.packing import Level, plan_hbp
from lit_hbp.packing.context_split import contiguous_split, split_pack

K = 1024
BAR = 1.05


def long_level_packs(lengths: np.ndarray, levels: list[Level], world: int, seed: int, cp: int) -> list[np.ndarray]:
    """Document lengths of every non-empty pack of the last level, padded like collate pads them."""
    plan = plan_hbp(lengths, levels, world, seed=seed)
    multiple = 8 * cp // math.gcd(8, cp)
    out = []
    for p in np.flatnonzero(plan.pack_level == len(levels) - 1):
        docs = plan.lengths[plan.pack(p)]
        if docs.size == 0:
            continue
        pad = -int(docs.sum()) % multiple
        out.append(np.r_[docs, pad] if pad else docs)
    return out


def measure(packs: list[np.ndarray], cp: int) -> dict:
    naive = np.array([contiguous_split(d, cp).imbalance() for d in packs])
    t = time.perf_counter()
    splits = [split_pack(d, cp) for d in packs]
    seconds = (time.perf_counter() - t) / len(packs)
    imb = np.array([s.imbalance() for s in splits])
    ranges = np.concatenate([s.ranges_per_rank() for s in splits])
    assert all((s.tokens_per_rank() == s.shard_len).all() for s in splits)
    return dict(
        packs=len(packs),
        docs=float(np.mean([d.size for d in packs])),
        naive_mean=naive.mean(),
        naive_max=naive.max(),
        ours_mean=imb.mean(),
        ours_max=imb.max(),
        ratio=imb.max() / naive.max(),
        ranges_mean=ranges.mean(),
        ranges_max=int(ranges.max()),
        ms=seconds * 1e3,
    )


def example_packs() -> dict[str, np.ndarray]:
    """One 128K document, and a 128K pack of one long document among chats (as the long level holds)."""
    chats = np.random.default_rng(0).integers(300, 2500, 12)
    mixed = np.r_[chats[:6], 100 * K, chats[6:], 28 * K - chats.sum()]
    return {"one 128K document": np.array([128 * K]), f"a 100K document and {mixed.size - 1} chats": mixed}


def write_figure(path: str) -> None:
    from pathlib import Path

    from lit_hbp.simulate.plots import cp_balance_figure

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    cp_balance_figure(example_packs()).savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--figure", help="write the per-rank area figure of two example packs to this PNG")
    args = p.parse_args()
    if args.figure:
        write_figure(args.figure)
    lengths = load("paper_mix")
    setups = [
        (2, [Level(32 * K, 1), Level(128 * K, 2)]),
        (4, [Level(32 * K, 1), Level(128 * K, 4)]),
        (8, [Level(32 * K, 1), Level(128 * K, 8)]),
        (8, [Level(32 * K, 1), Level(256 * K, 8)]),
    ]
    header = (
        "| cp | long level | packs | docs/pack | contiguous mean | contiguous worst | split_pack mean "
        "| split_pack worst | worst vs contiguous | ranges/rank mean | ranges/rank max | ms/pack |"
    )
    print(f"paper_mix.npy: {len(lengths):,} samples, world {args.world}, seed {args.seed}; imbalance = max/mean area\n")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    ok = True
    for cp, levels in setups:
        r = measure(long_level_packs(lengths, levels, args.world, args.seed, cp), cp)
        print(
            f"| {cp} | {levels[-1].pack_len // K}K sp{cp} | {r['packs']} | {r['docs']:.1f} | {r['naive_mean']:.3f} "
            f"| {r['naive_max']:.3f} | {r['ours_mean']:.4f} | {r['ours_max']:.4f} | {r['ratio']:.3f} "
            f"| {r['ranges_mean']:.2f} | {r['ranges_max']} | {r['ms']:.2f} |"
        )
        if cp >= 4:
            ok &= r["ours_max"] <= BAR
    for cp in (2, 4, 8):
        one = contiguous_split([cp * 64 * K], cp).imbalance()
        print(f"\none document of {cp * 64}K at cp {cp}: contiguous {one:.4f} (2 - 1/cp = {2 - 1 / cp:.4f})", end="")
    print(f"\n\nbar: split_pack worst <= {BAR} at cp 4 and 8: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
