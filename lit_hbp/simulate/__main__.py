"""Estimate what HBP saves on a cluster, from your sample lengths and the cost model.

    python -m lit_hbp.simulate LENGTHS.npy --model llama3.1-8b --gpus 32 --gpu h100 [--plot FILE.png]

--model is a preset (llama3.1-8b, llama3.1-70b, qwen2.5-32b, qwen2.5-72b), a Hugging Face
config.json or checkpoint folder, or a lit-hbp training YAML: its model, strategy and precision, and unless a
flag says otherwise its devices x num_nodes, data.levels, accumulation, packer and seed. Levels are
PACK_LEN:SP[:CKPT]; without CKPT the fewest checkpointed layers that fit are chosen (Algorithm 4).
A level's sp is laid out as Ulysses on the largest degree the model's heads allow and context
parallelism (CP) on the rest; the auto-selected levels (d) try every (ulysses, cp) layout. The
SP communication is reported as its two parts: ulysses_comm (all-to-alls) and cp_comm (K/V
all-gathers and dK/dV reduce-scatters). A CP group's micro-batch is split over its CP ranks by the
planner's split_pack and its attention priced at the busiest rank; cp_abr is that split's
imbalance, (max - mean) / max causal area over the CP ranks, averaged over the CP groups.
Prints the epoch time and GPU-hours of (a) naive single-level ISF at the largest level, (b) the
levels without the attention-balance sort, (c) full HBP, each with its speed-up over (a), and of
(d) HBP with auto-selected levels beside naive ISF at (d)'s largest level, with its speed-up over
that; and where each one's GPU time goes. Samples longer than the given largest level are dropped
from (a)-(c) (and zero-length ones never packed); it says how many, beside what (d) drops.

The auto-selected levels are the level search's (``search.select_levels``, the one
``python -m lit_hbp.autoselect --analytic`` runs): the largest holds the longest sample (up to
--max-len), trying every sp up to --gpus, checkpointing, offload and MLP tiles, with --liger and
--offload-optimizer when given; a longest sample that fits nothing is refused (exit 2) naming the
levers that would make it fit, each found by running the search with it. --no-auto skips (d).
Every time is simulated with the analytic cost model of --gpu, not measured.

A --model that is a config.json, a checkpoint folder or a training YAML brings its positions, as a fit
applies them: (d) chooses no level past them (a longrope model's levels past its original positions stay
at sp 1), and a given level the fit would refuse there is refused (exit 2) with the fit's words. A preset
names no positions.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from lit_hbp.autoselect.search import Selection, analytic_levels
from lit_hbp.autoselect.selector import positions_of
from lit_hbp.cost.config import check_levels, config_world, load_spec, nonnegative_float, positive_int, read_config
from lit_hbp.cost.hardware import GIB, HARDWARE
from lit_hbp.cost.memory import not_fitting
from lit_hbp.cost.run_settings import (
    SIMULATE,
    Settings,
    Tool,
    check,
    config_strategy,
    config_switches,
    cost_model,
    describe,
    settings_of,
    with_zero,
)
from lit_hbp.lightning.datamodule import data_seed
from lit_hbp.model.checks import check_positions
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import DEFAULT_PACKER, PACKERS, Level
from lit_hbp.packing.bins import load_lengths
from lit_hbp.packing.levels import as_level
from lit_hbp.parallel.topology import resolve_layout
from lit_hbp.report import format_table
from lit_hbp.simulate.simulator import COMM_PARTS, Simulation, compare, compare_auto, fill_checkpointing

COLUMNS = [("hours", ".2f"), ("gpu_hours", ".1f"), ("speedup", ".2f"), ("abr", ".3f"), ("cp_abr", ".3f"), ("cr", ".3f")]
COLUMNS += [(k, ".3f") for k in ("dense", "attention", "vision", *COMM_PARTS, "offload", "idle", "grad_sync")]


def parse_levels(specs: list[str]) -> tuple[list[Level], list[bool]]:
    """Levels, and for each whether its checkpointing is to be chosen (no CKPT field given)."""
    levels = [Level.parse(s) for s in specs]
    return levels, [len(s.split(":")) < 3 for s in specs]


def left_out(lengths: np.ndarray, max_len: int) -> str:
    """What every simulated plan leaves out of the epoch and why, or '' when nothing: samples
    longer than the largest level are dropped (the simulator plans with over_length drop) and
    zero-length ones are never packed, so the totals cover fewer samples than the file holds."""
    lengths = np.asarray(lengths)
    lines = []
    over = lengths[lengths > max_len]
    if over.size:
        lines.append(
            f"dropped {over.size:,} of {lengths.size:,} samples ({np.unique(over).size:,} distinct lengths; "
            f"{int(over.sum()):,} tokens, the longest {int(over.max()):,}): longer than the largest level "
            f"({max_len:,} tokens), so no plan below trains them. Add a larger level to --levels to keep them."
        )
    return "\n".join(lines + zero_note(lengths))


def zero_note(lengths: np.ndarray) -> list[str]:
    zero = int((np.asarray(lengths) == 0).sum())
    return [f"left out {zero:,} zero-length samples: they have no token to train."] if zero else []


def dropped(lengths: np.ndarray, max_len: int) -> str:
    """``56 of 20,056 samples (40,695,089 of 89,778,826 tokens, 45.3%; the longest 4,194,304)``."""
    lengths = np.asarray(lengths)
    over = lengths[lengths > max_len]
    if not over.size:
        return "no sample"
    share = over.sum() / max(lengths.sum(), 1)
    return (
        f"{over.size:,} of {lengths.size:,} samples ({int(over.sum()):,} of {int(lengths.sum()):,} tokens, "
        f"{share:.1%}; the longest {int(over.max()):,})"
    )


def left_out_beside_auto(lengths: np.ndarray, given: int, selection: Selection) -> str:
    """What the given levels (a)-(c) and the auto-selected ones (d) drop, side by side: (d) drops only
    samples above a --max-len cap, never one that fits."""
    top = selection.levels[-1].pack_len
    lines = [
        f"dropped by the given levels (a)-(c), largest {given:,}: {dropped(lengths, given)}",
        f"dropped by the auto-selected levels (d), largest {top:,}: {dropped(lengths, top)}",
    ]
    return "\n".join(lines + zero_note(lengths))


def rows_of(sims: list[Simulation]) -> list[dict]:
    """A table row per simulation, its speed-up over the first (a naive ISF plan)."""
    base = sims[0].seconds
    rows = []
    for s in sims:
        m = s.plan.metrics()
        rows.append(
            dict(
                name=s.name,
                hours=s.seconds / 3600,
                gpu_hours=s.gpu_hours,
                speedup=base / s.seconds,
                abr=m["abr"],
                cp_abr=s.cp_abr(),
                cr=m["cr"],
                **s.breakdown(),
            )
        )
    return rows


def layouts_tried(selection, pack_len: int) -> str:
    """The (ulysses x cp, checkpointing) settings the search priced for the largest level, fastest
    first: why it took the layout it took."""
    rows = [c for c in selection.candidates if c.pack_len == pack_len and c.note != "memory probe"]
    rows.sort(key=lambda c: -c.tokens_per_second)
    lines = [f"layouts the search priced for the {pack_len:,}-token level (sp=ulysses x cp, tokens/s per GPU):"]
    for c in rows:
        ckpt = "OOM" if c.ckpt_layers is None else f"ckpt {c.ckpt_layers}{c.memory_note}"
        lines.append(f"  sp {c.layout:>8}  {ckpt:>16}  {c.tokens_per_second:>10,.0f}  {c.note}".rstrip())
    return "\n".join(lines)


def layout_note(level: Level) -> str:
    u, cp = level.layout
    return f"={u}x{cp}" if cp > 1 else ""


def describe_levels(levels) -> str:
    """``16384 sp1 ckpt0, 131072 sp8=2x4 ckpt20 offload``: levels on one line."""
    return ", ".join(f"{lv.pack_len} sp{lv.sp}{layout_note(lv)} ckpt{lv.ckpt_layers}{lv.memory_note}" for lv in levels)


RUN_DEFAULTS = {"gpus": 32, "levels": ["16384:1", "131072:8"], "accumulate": 1, "seed": 0, "packer": DEFAULT_PACKER}


def run_shape(args: argparse.Namespace) -> list[bool]:
    """``--gpus``, ``--levels``, ``--accumulate``, ``--seed`` and ``--packer`` as the flags give them, else as a
    training YAML's fit runs them (``trainer.devices`` x ``num_nodes``, ``data.levels``, ``accumulate_grad_batches``,
    ``data.seed``, ``data.packer``; its nodes of ``trainer.devices``, flag or not), else the defaults. Sets them
    on ``args``; returns, per level, whether its checkpointing is to be chosen (a ``--levels`` spec without CKPT; a
    YAML's levels train as written)."""
    config = read_config(Path(args.model)) if Path(args.model).suffix in (".yaml", ".yml") else {}
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    given = {}
    if config:
        world = config_world(config)
        if world is not None:
            given["gpus"], args.node = world  # its nodes of trainer.devices, as the fit lays levels out
        elif args.gpus is None:
            raise ValueError(f"{args.model}: trainer.devices x num_nodes names no count of GPUs to price: give --gpus")
        if "accumulate_grad_batches" in trainer:
            given["accumulate"] = accumulate = trainer["accumulate_grad_batches"]
            if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
                raise ValueError(f"trainer.accumulate_grad_batches must be a whole number >= 1, got {accumulate!r}")
        given["seed"] = data_seed(data.get("seed"), config.get("seed_everything"))
        if "packer" in data:
            given["packer"] = data["packer"]
        levels = data.get("levels")
        if isinstance(levels, list):
            given["levels"] = [as_level(spec, f"data.levels[{i}]") for i, spec in enumerate(levels)]
        elif levels is not None and args.levels is None:
            raise ValueError(
                f"{args.model}: data.levels is a selector, which chooses the fit's levels as (d) does: give --levels "
                "for (a)-(c)"
            )
    for name, default in RUN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, given.get(name, default))
    if args.packer not in PACKERS:
        raise ValueError(f"data.packer: unknown packer {args.packer!r}; choose one of {sorted(PACKERS)}")
    if all(isinstance(lv, Level) for lv in args.levels):
        return [False] * len(args.levels)
    args.levels, auto = parse_levels(args.levels)
    return auto


def run_of(args: argparse.Namespace, spec: ModelSpec) -> tuple[Settings, Tool]:
    """The run priced, as the level search reads it (``RunSetting.with_flags``): a training YAML's ``--model`` brings
    its own (strategy, LoRA counted on ``spec``, liger, loss chunk, precision), else HBPStrategy's ZeRO-2 in bf16;
    the levers given (``--zero-stage``, ``--offload-optimizer``, ``--liger``) set theirs over it. With the words its
    refusals speak: a switch the YAML turned on is named as the YAML names it."""
    path = Path(args.model)
    config = read_config(path) if path.suffix in (".yaml", ".yml") else {}
    trainer, model = config.get("trainer") or {}, dict(config.get("model") or {})
    strategy = config_strategy(trainer.get("strategy")) if config else {}
    precision = trainer.get("precision", "32-true") if config else None
    flags = {"liger": args.liger, "optimizer_offload": args.offload_optimizer}
    tool = SIMULATE.with_config_words(config_switches(strategy, model, flags) if config else [])
    model["liger"] = bool(model.get("liger")) or args.liger
    strategy = with_zero(strategy, args.zero_stage, args.offload_optimizer)
    hardware = HARDWARE[args.gpu]
    if getattr(args, "node", None):  # a YAML's nodes of trainer.devices GPUs (Ulysses within one), as its fit's
        hardware = replace(hardware, gpus_per_node=args.node)
    return settings_of(hardware, args.gpus, strategy, model, precision, spec), tool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("lengths", help=".npy array of sample lengths, or a text file with one per line")
    p.add_argument("--model", default="llama3.1-8b", help="preset, HF config/checkpoint, or training YAML")
    p.add_argument("--gpus", type=positive_int, help="default: a YAML's devices x num_nodes, else 32")
    p.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    p.add_argument(
        "--levels",
        nargs="+",
        help="HBP levels PACK_LEN:SP[:CKPT] (default: a YAML's data.levels, else 16K:1 128K:8)",
    )
    p.add_argument("--accumulate", type=positive_int, help="default: a YAML's accumulate_grad_batches, else 1")
    p.add_argument(
        "--packer",
        choices=sorted(PACKERS),
        help=f"the packer (default: a YAML's data.packer, else {DEFAULT_PACKER})",
    )
    p.add_argument(
        "--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed's ZeRO stage (default: a YAML's, else 2)"
    )
    p.add_argument("--liger", action="store_true", help="the model runs Liger's RMSNorm and SwiGLU (liger: true)")
    p.add_argument(
        "--offload-optimizer", action="store_true", help="DeepSpeed offload_optimizer: Adam states on the host"
    )
    p.add_argument("--seed", type=int, help="the plan's seed (default: a YAML's data.seed or seed_everything, else 0)")
    p.add_argument("--no-auto", action="store_true", help="skip (d), the auto-selected levels")
    p.add_argument(
        "--max-len", type=positive_int, help="(d): the longest level the search may choose (default: no cap)"
    )
    p.add_argument(
        "--margin-gib", type=nonnegative_float, default=0.0, help="memory left free per GPU beyond the 2 GB reserve"
    )
    p.add_argument(
        "--plot",
        help="write the rank timelines to this picture (.png added to a name without a suffix; any suffix matplotlib "
        "writes) and a length histogram beside it (STEM_lengths.SUFFIX)",
    )
    args = p.parse_args(argv)
    if args.no_auto and (args.max_len is not None or args.margin_gib):
        p.error("--max-len and --margin-gib steer (d), the auto-selected levels, which --no-auto skips")
    if args.plot:  # before the simulation: savefig would refuse a bad path only after it
        from lit_hbp.simulate.plots import figure_paths

        try:
            figure_paths(args.plot)
        except ValueError as e:
            p.error(f"--plot: {e}")
    try:
        lengths = load_lengths(args.lengths)
        auto_ckpt = run_shape(args)
        spec = load_spec(args.model)
        settings, tool = run_of(args, spec)
        check(settings, tool)
        cost = cost_model(spec, settings)
        margin = args.margin_gib * GIB
        config, covered, past = positions_of(args.model)
        max_len = min((n for n in (args.max_len, covered) if n is not None), default=None)
        # the search first: a longest sample that fits nothing is refused before anything is priced
        selection = (
            None
            if args.no_auto
            else analytic_levels(cost, lengths, args.seed, max_len, margin=margin, tool=tool, whole_past=past)
        )
        levels = [resolve_layout(lv, spec.heads, spec.kv_heads, cost.hardware.gpus_per_node) for lv in args.levels]
        if config is not None:
            check_positions(config, levels)  # the fit's gate: a level it refuses is priced for nothing
        chosen = fill_checkpointing([lv for lv, a in zip(levels, auto_ckpt) if a], cost, lengths, margin)
        levels = [chosen.pop(0) if a else lv for lv, a in zip(levels, auto_ckpt)]
        check_levels(levels, args.gpus, spec.layers)
        unfit = not_fitting(cost, levels)  # a given level priced as if it fit would say nothing true
        if unfit:
            raise ValueError(unfit[0])
        sims = compare(lengths, cost, levels, args.accumulate, args.seed, args.packer)
        auto = (
            [] if selection is None else compare_auto(lengths, cost, selection, args.accumulate, args.seed, args.packer)
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens; {spec.name} ({spec.params / 1e9:.1f}B) on "
        f"{args.gpus} x {cost.hardware.name} (simulated with the cost model), {describe(cost)}; accumulate "
        f"{args.accumulate}, packer {args.packer}, seed {args.seed}; levels " + describe_levels(levels) + "\n"
    )
    top = levels[-1].pack_len
    notice = left_out(lengths, top) if selection is None else left_out_beside_auto(lengths, top, selection)
    if notice:
        print(notice + "\n")
    rows = rows_of(sims) + (rows_of(auto) if auto else [])
    print(format_table(rows, COLUMNS))
    print(
        "\n(speedup: over naive ISF at the same largest level, the first row for the given levels, "
        "'naive ISF at N' for the auto-selected ones; cp_abr: attention imbalance over the CP ranks of a group; "
        "dense ... grad_sync: share of all GPU "
        "time; ulysses_comm: all-to-alls, on the critical path; cp_comm: what context parallelism's K/V "
        "all-gathers and dK/dV reduce-scatters add beyond the attention of the slices they overlap; idle = "
        "waiting for the slowest SP group of a micro-step)"
    )
    hbp = rows[2]
    print(f"HBP over naive ISF: {hbp['speedup']:.2f}x (the paper measured 1.40x for LLaMA3.1-8B on 32 H100s).")
    if selection is not None:
        auto_top = selection.levels[-1].pack_len
        print(
            f"HBP with the auto-selected levels over naive ISF at the same largest level ({auto_top:,} tokens): "
            f"{rows[-1]['speedup']:.2f}x"
        )
        print("\nauto-selected levels (d), " + describe_levels(selection.levels) + ":\n" + selection.yaml())
        for note in selection.notes:
            print(note + "\n")
        print(layouts_tried(selection, auto_top))
    if args.plot:
        from lit_hbp.simulate.plots import save_figures  # the paths it wrote (.png added to a name without a suffix)

        for path in save_figures(args.plot, [sims[0], sims[2]], sims[2].plan):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
