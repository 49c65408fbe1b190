"""Compare HBP with naive packing on your own sample lengths.

    python -m lit_hbp.packing LENGTHS.npy --levels 16384:1 131072:8 --world 32

LENGTHS is a .npy array of token counts or a text file with one count per line. Levels are
PACK_LEN[:SP[:CKPT_LAYERS[:PACKS_PER_RANK]]]. Prints DBR/ABR/PR/CR/Ave-T of HBP, of HBP without
the attention-balance sort, and of naive single-level packing at the largest level.
"""

from __future__ import annotations

import argparse
import sys
import time

from lit_hbp.packing.bins import load_lengths
from lit_hbp.packing.levels import Level
from lit_hbp.packing.packers import DEFAULT_PACKER, PACKERS
from lit_hbp.packing.plan import plan_hbp, plan_single_level
from lit_hbp.report import METRIC_COLUMNS, format_table


def compare(
    lengths, levels, world, accumulate=1, seed=0, packer=DEFAULT_PACKER, naive_packer="isf", over_length="error"
) -> tuple[list[dict], object]:
    """Metrics rows for HBP, HBP without balance sort, and naive packing at the largest level."""
    rows = []
    hbp = None
    runs = [
        ("HBP", lambda: plan_hbp(lengths, levels, world, accumulate, seed, packer, over_length=over_length)),
        (
            "hierarchical, no balance sort",
            lambda: plan_hbp(lengths, levels, world, accumulate, seed, packer, over_length=over_length, balance=False),
        ),
        (
            f"naive {naive_packer} {levels[-1].pack_len} sp{levels[-1].sp}",
            lambda: plan_single_level(
                lengths, levels[-1], world, accumulate, seed, naive_packer, over_length=over_length
            ),
        ),
    ]
    for name, run in runs:
        t = time.perf_counter()
        plan = run()
        seconds = time.perf_counter() - t
        hbp = hbp or plan
        rows.append(dict(name=name, seconds=seconds, **plan.metrics()))
    return rows, hbp


def level_arg(spec: str) -> Level:
    """``Level.parse`` for argparse, which keeps a ``type``'s message only from an ArgumentTypeError (for a
    ValueError it prints "invalid parse value", dropping which field is wrong and why)."""
    try:
        return Level.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.packing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("lengths", help=".npy array of sample lengths, or a text file with one per line")
    p.add_argument("--levels", nargs="+", required=True, type=level_arg, help="e.g. 16384:1 131072:8")
    p.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packer", default=DEFAULT_PACKER, choices=sorted(PACKERS))
    p.add_argument("--naive-packer", default="isf", choices=sorted(PACKERS))
    p.add_argument("--over-length", default="error", choices=["error", "drop", "truncate"])
    args = p.parse_args(argv)
    try:
        lengths = load_lengths(args.lengths)
        rows, hbp = compare(
            lengths,
            args.levels,
            args.world,
            args.accumulate,
            args.seed,
            args.packer,
            args.naive_packer,
            args.over_length,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(hbp.summary())
    print()
    print(format_table(rows, METRIC_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
