"""Choose HBP levels for a training config: Algorithm 1 over the model, the data and the hardware.

    python -m lit_hbp.autoselect --config configs/llama3_8b_32gpu.yaml --analytic --gpus 32 --gpu h100
    python -m lit_hbp.autoselect --config configs/tiny_cpu.yaml --measured --devices 2

The sample lengths come from the config's data section (tokenized and cached like training does),
or from --lengths. ``--analytic`` (default) prices candidates with the cost model for --gpus GPUs of
kind --gpu (default: the config's trainer.devices x num_nodes, on nodes of trainer.devices);
``--measured`` trains a few real steps of the config's model per candidate through HBPStrategy (the
config's precision, accumulation and ZeRO settings) on --devices local processes (CUDA when available,
else CPU with gloo). Prints every candidate measured and the chosen ``levels:``
block (also written to --out when given).

The search is the one ``python -m lit_hbp.simulate`` auto-selects with (``search.select_levels``): its
largest level holds the longest sample (up to --max-len and the model's positions), trying every sp
up to --gpus, checkpointing, offload and MLP tiles. The run is the config's (its precision, strategy's
ZeRO stage and offloads, model.liger, LoRA, ce_chunk_size); --liger, --offload-optimizer and --zero-stage
change it as the config's model.liger, HBPStrategy offload_optimizer and stage would. When the longest
sample fits nothing, it exits 2 naming the levers that would make it fit, each found by running the
search with it and spelled as this command's flags.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from lit_hbp.autoselect.selector import AnalyticSelector, MeasuredSelector, RunSetting, positions_of
from lit_hbp.cost.config import config_vocab, config_world, load_spec, nonnegative_float, positive_int, read_config
from lit_hbp.cost.hardware import GIB, HARDWARE
from lit_hbp.cost.run_settings import ANALYTIC, MEASURED
from lit_hbp.lightning.config_data import config_samples

ANALYTIC_ONLY = ("gpus", "gpu", "model")  # the cluster the cost model prices
MEASURED_ONLY = ("devices", "memory_gib")  # the local processes the probes run on


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.autoselect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="a lit-hbp training YAML")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--analytic", action="store_true", help="price candidates with the cost model (default)")
    mode.add_argument("--measured", action="store_true", help="run real micro-steps on --devices local processes")
    p.add_argument(
        "--gpus", type=positive_int, help="analytic: GPUs of the cluster (default: the config's devices x num_nodes)"
    )
    p.add_argument("--gpu", choices=sorted(HARDWARE), help="analytic: GPU kind (default h100)")
    p.add_argument("--devices", type=positive_int, help="measured: local processes (GPUs, or CPU processes; default 1)")
    p.add_argument(
        "--memory-gib", type=nonnegative_float, help="measured: memory per device (default: the GPU's, else 16)"
    )
    p.add_argument("--lengths", help="sample lengths (.npy or text) instead of tokenizing the config's data")
    p.add_argument("--model", help="analytic: a model preset or config.json instead of the config's model")
    p.add_argument("--candidates", nargs="+", type=positive_int, help="pack lengths to try (default: powers of two)")
    p.add_argument(
        "--margin-gib",
        type=nonnegative_float,
        help="memory left free per device (default: 0 analytic, the cost model keeps a 2 GB reserve; 2 measured)",
    )
    p.add_argument(
        "--max-len", type=positive_int, help="the longest level to choose (longer samples follow data.over_length)"
    )
    p.add_argument("--liger", action="store_true", help="the model runs Liger's RMSNorm and SwiGLU (model.liger: true)")
    p.add_argument(
        "--offload-optimizer", action="store_true", help="DeepSpeed offload_optimizer: the Adam states on the host"
    )
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="the ZeRO stage (default: the config's)")
    p.add_argument("--out", help="also write the chosen levels block to this file (it is always printed)")
    args = p.parse_args(argv)
    other = MEASURED_ONLY if not args.measured else ANALYTIC_ONLY
    given = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if given:
        mode = "--measured" if args.measured else "--analytic (the default)"
        p.error(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} the other mode's, which {mode} does not read")
    if args.measured and args.memory_gib == 0:
        p.error("--memory-gib must be more than 0 (GiB per device)")
    capacity = args.memory_gib if args.measured else HARDWARE[args.gpu or "h100"].memory_bytes / GIB
    if args.margin_gib is not None and capacity is not None and args.margin_gib >= capacity:
        said = "--memory-gib" if args.measured else f"a {args.gpu or 'h100'}'s"
        p.error(f"--margin-gib {args.margin_gib} leaves nothing of the {capacity:.1f} GiB per device ({said})")
    if args.out and not Path(args.out).parent.is_dir():  # found now, not after the search
        p.error(f"--out {args.out}: its folder {Path(args.out).parent} does not exist")
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder: give the file to write the levels block into")
    try:
        config = read_config(args.config)
        if args.lengths:
            from lit_hbp.packing.bins import load_lengths

            # a mapping's model priced as fit builds it: the tokenizer's vocabulary, not its family's default
            lengths, vision, samples = load_lengths(args.lengths), None, None
            vocab = config_vocab(config) if args.model is None else None
        else:
            lengths, vocab, vision, samples = config_samples(config)
        spec = load_spec(args.model) if args.model else None
        measured, settings = selector_settings(config, args)
        if measured:
            selector = MeasuredSelector(**settings)
            run = replace(RunSetting.from_config(config, vocab, args.devices or 1), tool=MEASURED)
        else:
            selector = AnalyticSelector(**settings)
            world = config_world(config)
            if args.gpus is None and world is None:
                raise ValueError(
                    f"{args.config}: trainer.devices x num_nodes names no count of GPUs to price: give --gpus"
                )
            gpus, node = world or (None, None)  # priced on the config's nodes of trainer.devices, --gpus or not
            gpus = args.gpus if args.gpus is not None else gpus
            run = replace(RunSetting.from_config(config, vocab, gpus, spec), tool=ANALYTIC, node_size=node)
            if args.model:  # the positions of the model priced, not of the config's
                _, covered, past = positions_of(args.model)
                run = replace(run, max_len=covered, whole_past=past)
        run = run.with_flags(args.liger, args.offload_optimizer, args.zero_stage)
        extra = {"samples": samples} if measured else {}  # measured probes pack a run's images (None: text)
        selection = selector.select(lengths, run, vision, **extra)
    except (ValueError, TypeError, OSError, KeyError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = selector.where(run)
    print(f"{run.spec.name}: {len(lengths):,} samples, longest {int(np.max(lengths)):,} tokens ({where})\n")
    print(selection.table())
    print(
        f"\nfastest: {selection.best.pack_len} tokens at sp {selection.best.sp} with {selection.best.ckpt_layers} "
        f"checkpointed layers; largest: {selection.largest.pack_len} at sp {selection.largest.sp}\n"
    )
    for note in selection.notes:
        print(note + "\n")
    block = levers_said(args) + selection.yaml()
    print(block)
    if args.out:  # nothing is written where the command runs unless asked
        Path(args.out).write_text(block)
        print(f"wrote {args.out}")
    return 0


SELECTORS = {"AnalyticSelector": False, "MeasuredSelector": True}  # class -> measured


def selector_settings(config: dict, args: argparse.Namespace) -> tuple[bool, dict]:
    """The search to run (measured or not) and its selector's arguments: the flags given, else the config's own
    ``data.levels`` selector block (its class and ``init_args``), so the tool chooses what that fit would choose; the
    block's arguments apply where it names the mode run. A selector of one's own is run by its fit only."""
    block = (config.get("data") or {}).get("levels")
    kind = str(block.get("class_path", "")).rsplit(".", 1)[-1] if isinstance(block, dict) else None
    if kind is not None and kind not in SELECTORS and not (args.analytic or args.measured):
        raise ValueError(
            f"data.levels: {kind} is a selector of your own, which this tool does not run (its fit does): give "
            "--analytic or --measured to search with lit-hbp's"
        )
    measured = args.measured or (not args.analytic and SELECTORS.get(kind, False))
    given = dict(block.get("init_args") or {}) if kind is not None and SELECTORS.get(kind) == measured else {}
    flags = {"candidates": args.candidates, "margin_gib": args.margin_gib, "max_len": args.max_len}
    flags.update({"memory_gib": args.memory_gib} if measured else {"gpu": args.gpu})
    settings = {**given, **{k: v for k, v in flags.items() if v is not None}}
    if not measured:
        settings.setdefault("gpu", "h100")
    return measured, settings


def levers_said(args: argparse.Namespace) -> str:
    """The levers the levels were chosen under (``--liger``, ``--zero-stage``, ``--offload-optimizer``), as a comment
    heading the levels block: pasted without them into the config, the levels may not fit the run it trains."""
    levers = [
        *(["model.liger: true"] if args.liger else []),
        *([f"HBPStrategy stage: {args.zero_stage}"] if args.zero_stage is not None else []),
        *(["HBPStrategy offload_optimizer: true"] if args.offload_optimizer else []),
    ]
    if not levers:
        return ""
    return f"# chosen with {', '.join(levers)}: set them in the config too, or these levels may not fit\n"


if __name__ == "__main__":
    sys.exit(main())
