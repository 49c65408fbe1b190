"""The longest levels of LLaMA3.1-8B on one node of 8 H100s: what checkpointing, offload and MLP tiles hold.

    python bench/longest_levels.py [--gpu h100] [--figure docs/figures/longest_levels.png]

For levels of 128K, 1M and 4M tokens at sp 8 (Ulysses 8 inside the node, ZeRO-2), the cost model's
predicted peak memory per GPU (``CostModel.memory_parts``, checked within 10% of measured bytes on
CPU by tests/test_memory_model.py) under four settings: every layer checkpointed (the baseline: what
lit-hbp reached before offload), + offload of the checkpointed inputs, + MLP tiles (the fewest of
2, 4, ... 64 that fit, else 64), + Liger's RMSNorm/SwiGLU and the Adam states on the host. Each
row gives the parts, the total against the baseline's (ratio), the offloaded bytes per GPU and a
micro-step's seconds with the host copies' exposed part (``offload_seconds``). Analytic: no GPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from lit_hbp.autoselect.search import TILE_STEPS
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.model_spec import MODELS
from lit_hbp.report import format_table

GIB = 1024**3
PARTS = ("params", "grads", "optimizer", "checkpointed", "recompute", "working", "head", "layers", "reserve")
SETTINGS = ("checkpointing", "+ offload", "+ MLP tiles", "+ Liger, optimizer offload")


def rows(gpu: str) -> list[dict]:
    base = CostModel(MODELS["llama3.1-8b"], HARDWARE[gpu], 8, zero_stage=2)
    lean = replace(base, liger=True, optimizer_offload=True)
    out = []
    for pack_len in (128 * 1024, 1024**2, 4 * 1024**2):
        tokens, sum_sq = pack_len / 8, float(pack_len) ** 2  # one document filling the pack: the worst case
        baseline = None
        for name, cost, offload in zip(SETTINGS, (base, base, base, lean), (False, True, True, True)):
            tiles = 1
            if name in SETTINGS[2:]:
                tiles = next(
                    (t for t in TILE_STEPS if cost.fits(pack_len, 8, 32, 1, True, t)),
                    TILE_STEPS[-1],
                )
            parts = cost.memory_parts(pack_len, 8, 32, 1, offload, tiles)
            total = cost.memory_bytes(pack_len, 8, 32, 1, offload, tiles)
            baseline = baseline or total
            step = cost.micro_step(tokens, sum_sq, 8, 32, 1, offload, tiles)
            out.append(
                dict(
                    name=f"{pack_len // 1024}K {name}",
                    pack_len=f"{pack_len // 1024}K",
                    setting=name,
                    tiles=tiles,
                    **{k: parts[k] / GIB for k in PARTS},
                    total=total / GIB,
                    ratio=total / baseline,
                    fits="yes" if cost.fits(pack_len, 8, 32, 1, offload, tiles) else "NO",
                    host=parts["host"] / GIB,
                    step_s=float(step["total"]),
                    offload_s=float(step["offload"]),
                )
            )
    return out


def _counted(row: dict, part: str) -> float:
    """A part as the peak counts it (``CostModel.memory_bytes``): only the larger of the two phases."""
    head_phase = row["head"] >= row["recompute"] + row["working"]
    if part == "head":
        return row[part] if head_phase else 0.0
    if part in ("recompute", "working"):
        return 0.0 if head_phase else row[part]
    return row[part]


def figure(table: list[dict], path: str, capacity: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    colors = plt.get_cmap("tab10").colors
    labels = [r["pack_len"] + "\n" + r["setting"].replace(", ", ",\n") for r in table]
    bottom = [0.0] * len(table)
    for j, part in enumerate(PARTS):
        # the head's phase and the layers' backward (recompute + working) do not overlap: draw the larger
        values = [_counted(r, part) for r in table]
        ax.bar(range(len(table)), values, bottom=bottom, color=colors[j % 10], label=part, width=0.75)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(len(table) - 0.5, capacity, f" {capacity:.1f} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(table)), labels, fontsize=6.5)
    ax.set_ylabel("predicted peak GiB per GPU")
    ax.set_ylim(0, min(max(bottom) * 1.05, 4 * capacity))
    ax.set_title("LLaMA3.1-8B, sp 8 on 8 x H100-80GB, ZeRO-2, every layer checkpointed (the peak's parts)")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--figure", help="write a stacked bar chart of the parts to this PNG")
    args = p.parse_args()
    table = rows(args.gpu)
    cols = [("tiles", "d"), *((k, ".1f") for k in PARTS), ("total", ".1f"), ("ratio", ".2f"), ("fits", "s")]
    cols += [("host", ".1f"), ("step_s", ".2f"), ("offload_s", ".3f")]
    print(format_table(table, cols))
    print(
        "\nGiB per GPU (host: offloaded inputs per GPU in host memory); ratio: total over every layer checkpointed "
        "alone; step_s: one micro-step of a one-document pack, offload_s: the host copies' exposed part of it."
    )
    if args.figure:
        figure(table, args.figure, HARDWARE[args.gpu].memory_bytes / GIB)
        print(f"wrote {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
