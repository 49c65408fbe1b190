"""Packing quality of HBP against naive packing on the paper-shaped mix (docs/design.md section 4).

    python bench/plan_quality.py [--world 32] [--accumulate 1]

Workload paper_mix.npy (400K chat samples + 2K long-context samples), levels [16K sp1, 128K sp8]
(the paper's auto-selected pair). Rows: HBP with every packer, HBP without the attention-balance
sort (the paper's "hierarchical only" ablation, with bfd and with isf packs), naive single-level
ISF at 128K sp8 (the paper's baseline). Targets: HBP ABR <= 0.005, PR <= 0.002, CR <= 0.18.
"""

from __future__ import annotations

import argparse
import sys
import time

from workloads import load

from lit_hbp.packing import DEFAULT_PACKER, PACKERS, Level, plan_hbp, plan_single_level
from lit_hbp.report import METRIC_COLUMNS, format_table

TARGETS = {"abr": 0.005, "pr": 0.002, "cr": 0.18}
PAPER = {"naive ISF 128K sp8": (0.506, 1.0), "hierarchical only": (0.288, 0.173), "HBP": (0.002, 0.173)}


def timed(name, fn):
    t = time.perf_counter()
    plan = fn()
    return dict(name=name, seconds=time.perf_counter() - t, **plan.metrics())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lengths = load("paper_mix")
    levels = [Level(16384, 1), Level(131072, 8)]
    w, a, s = args.world, args.accumulate, args.seed

    naive = timed("naive isf 128K sp8", lambda: plan_single_level(lengths, levels[-1], w, a, s, "isf"))
    rows = [naive]
    rows.append(
        timed("hierarchical only (isf packs)", lambda: plan_hbp(lengths, levels, w, a, s, "isf", balance=False))
    )
    rows.append(
        timed("hierarchical only (bfd packs)", lambda: plan_hbp(lengths, levels, w, a, s, "bfd", balance=False))
    )
    for packer in PACKERS:
        rows.append(timed(f"HBP packer={packer}", lambda packer=packer: plan_hbp(lengths, levels, w, a, s, packer)))
    for r in rows:
        r["abr_vs_naive"] = r["abr"] / naive["abr"]
        r["cr_vs_naive"] = r["cr"] / naive["cr"]
    cols = METRIC_COLUMNS + [("abr_vs_naive", ".4f"), ("cr_vs_naive", ".3f")]
    print(f"paper_mix.npy: {len(lengths):,} samples, world {w}, accumulate {a}, levels 16K sp1 + 128K sp8\n")
    print(format_table(rows, cols))
    print(
        "\npaper (LLaMA3.1-8B, 32 GPUs, Tulu3 + LongCite): "
        + ", ".join(f"{k}: ABR {abr}, CR {cr}" for k, (abr, cr) in PAPER.items())
    )
    hbp = next(r for r in rows if r["name"] == f"HBP packer={DEFAULT_PACKER}")
    ok = all(hbp[k] <= v for k, v in TARGETS.items())
    print(
        f"\nHBP (default packer {DEFAULT_PACKER}) targets "
        + ", ".join(f"{k.upper()} {hbp[k]:.4f} <= {v}" for k, v in TARGETS.items())
        + f": {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
