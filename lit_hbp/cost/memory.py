"""Each level's predicted peak memory per GPU, before anything launches.

    python -m lit_hbp.cost.memory --config configs/llama3_8b_32gpu.yaml [--gpu h100] [--gpus 32]

Reads the training YAML (its model, with ``data.tokenizer``'s vocabulary where the model mapping names none, its
levels, precision, world, strategy's ZeRO stage and offloads, ``liger``, LoRA: ``run_settings.config_settings``; a
setting set-up would refuse is refused here, exit 2)
and prints, per level, the cost model's parts (``CostModel.memory_parts``: parameters, gradients and
Adam states as ZeRO partitions them, the activations of the layers run whole, the checkpointed inputs
on the device or on the host with ``offload``, a layer's recompute and backward working set, the LM
head) against the GPU's memory (as the device reports it) and the node's host memory; exit status 1
when a level does not fit, naming what set-up would accept that might make it fit.
``HBPLitModule`` runs the same check at ``fit`` start on a GPU and warns for each level that will not
fit. The model counts the tensors lit-hbp keeps (checked within 10% of measured bytes on CPU,
tests/test_memory_model.py); the allocator's fragmentation comes on top, within ``reserve``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from lit_hbp.cost.config import (
    check_levels,
    config_vocab,
    load_spec,
    model_config,
    positive_int,
    read_config,
    spec_of,
)
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import GIB, HARDWARE
from lit_hbp.cost.run_settings import (
    CONFIG,
    SWITCHES,
    check,
    check_deepspeed_precision,
    config_settings,
    config_strategy,
    cost_model,
    describe,
    local_hardware,
    problems,
    trainer_settings,
)
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.levels import Level, as_level
from lit_hbp.parallel.topology import resolve_layout

SHOWN = (
    *("params", "grads", "optimizer", "casts", "layers", "mixers", "checkpointed", "recompute", "working", "head"),
    "vision",
)


def level_memory(cost: CostModel, lv: Level) -> dict:
    """A level's predicted parts (GiB), ``total`` (GiB per GPU), ``host`` (GiB per GPU) and ``fits``."""
    cp = lv.layout[1]
    args = (lv.pack_len, lv.sp, lv.ckpt_layers, lv.packs_per_rank, lv.offload, lv.mlp_tiles, cp)
    parts = cost.memory_parts(*args)
    row = {k: parts[k] / GIB for k in SHOWN}
    row["total"] = cost.memory_bytes(*args) / GIB
    row["host"] = parts["host"] / GIB
    row["fits"] = cost.fits(*args)
    return row


def not_fitting(cost: CostModel, levels) -> list[str]:
    """One line per level that will not fit the device (or the node's host memory), saying by how much
    and what to change."""
    out = []
    hw = cost.hardware
    for i, lv in enumerate(levels):
        row = level_memory(cost, lv)
        if row["fits"]:
            continue
        top = max(SHOWN, key=row.get)
        if lv.ckpt_layers < cost.model.layers:
            hint = f"checkpoint more layers (ckpt_layers {lv.ckpt_layers} of {cost.model.layers})"
        elif not lv.offload:
            hint = "set offload: true"
        else:
            hint = beyond_offload(cost, lv)
        where = (
            f"{row['total']:.1f} GiB per GPU predicted, the device has {hw.memory_bytes / GIB:.1f} GiB"
            if row["total"] * GIB > hw.memory_bytes
            else f"{row['host'] * hw.gpus_per_node:.0f} GiB of offloaded inputs per node, the host has "
            f"{hw.host_memory_bytes / GIB:.0f} GiB"
        )
        out.append(
            f"level {i} ({lv.pack_len} tokens, sp {lv.sp}, ckpt {lv.ckpt_layers}{lv.memory_note}) will not fit: "
            f"{where} (largest part: {top} {row[top]:.1f} GiB); {hint}"
        )
    return out


def beyond_offload(cost: CostModel, lv: Level) -> str:
    """What is left to raise or set for a level already checkpointed and offloaded, of what set-up accepts
    beside the run's settings and the level's MLP tiles (``run_settings.problems``)."""
    raise_ = ["mlp_tiles"] if not problems(cost, tiles=2) else []
    raise_ += ["sp"]
    if any(not problems(replace(cost, zero_stage=z), tiles=lv.mlp_tiles) for z in range(cost.zero_stage + 1, 4)):
        raise_ += ["the ZeRO stage"]
    unset = [{s: True} for s in SWITCHES if not getattr(cost, s)]
    set_ = [CONFIG.spell_all(c) for c in unset if not problems(replace(cost, **c), tiles=lv.mlp_tiles)]
    hint = "raise " + ", ".join(raise_[:-1]) + (" or " if len(raise_) > 1 else "") + raise_[-1]
    return hint + "".join(f"; or set {s}" for s in set_)


def trainer_cost(
    trainer,
    spec: ModelSpec,
    liger: bool,
    ce_chunk: int,
    dtype_bytes: int,
    capacity: float,
    trainable: float = 1.0,
    vision_trained: bool = True,
    compiled: bool = False,
    added_params: float = 0.0,
) -> tuple[CostModel, list[Level]]:
    """The cost model of a run being set up on devices of ``capacity`` bytes, and its levels as laid out:
    world, precision, ZeRO stage and offloads read from the trainer (``run_settings.trainer_settings``), a
    vision-language run's tower with its data's images (the data module's ``vision_load``); ``trainable`` and
    ``added_params`` as the module counts them (LoRA's: ``HBPLitModule.cost_model``)."""
    hardware = local_hardware(trainer.strategy.root_device, capacity, trainer.num_devices)
    known = dict(liger=liger, ce_chunk=ce_chunk, dtype_bytes=dtype_bytes, trainable=trainable, compiled=compiled)
    known["added_params"] = added_params
    cost = cost_model(spec, trainer_settings(trainer, hardware, vision_trained=vision_trained, **known))
    dm = trainer.datamodule
    store = getattr(dm, "store", None)
    load = None
    if spec.vision is not None and store is not None and hasattr(dm, "vision_load"):  # a tower it can price
        load = dm.vision_load(store)
    if load is not None:
        cost = replace(cost, vision_patches_per_token=load.patches_per_token(store.lengths))
    levels = tuple(getattr(trainer.datamodule, "levels", None) or ())
    return cost, [resolve_layout(lv, spec.heads, spec.kv_heads, trainer.num_devices) for lv in levels]


def table(cost: CostModel, levels) -> str:
    head = ["level", "pack_len", "sp", "ckpt", "offload", "tiles", *SHOWN, "total", "host", "fits"]
    rows = [head]
    for i, lv in enumerate(levels):
        r = level_memory(cost, lv)
        rows.append(
            [
                str(i),
                str(lv.pack_len),
                f"{lv.sp}={lv.layout[0]}x{lv.layout[1]}" if lv.layout[1] > 1 else str(lv.sp),  # Ulysses x CP
                str(lv.ckpt_layers),
                "yes" if lv.offload else "no",
                str(lv.mlp_tiles),
            ]
            + [f"{r[k]:.1f}" for k in (*SHOWN, "total", "host")]
            + ["yes" if r["fits"] else "NO"]
        )
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def check_precision(trainer: dict) -> None:
    """Refuse a precision DeepSpeed does not train in under the config's DeepSpeed strategy, as fit does."""
    if config_strategy(trainer.get("strategy")) is not None:
        check_deepspeed_precision(str(trainer.get("precision") or "32-true"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.cost.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="a lit-hbp training YAML")
    p.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--gpus", type=positive_int, help="GPUs of the run (default: the config's devices x num_nodes)")
    p.add_argument("--model", help="a model preset or config.json instead of the config's model")
    args = p.parse_args(argv)
    try:
        config = read_config(args.config)
        spec = load_spec(args.model) if args.model else spec_of(model_config(config, config_vocab(config)))
        trainer = config.get("trainer") or {}
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        counted = isinstance(devices, int) and devices > 0 and isinstance(nodes, int) and nodes > 0
        world = args.gpus if args.gpus is not None else (devices * nodes if counted else None)
        if not world:
            raise ValueError(f"trainer.devices is {devices!r}: give the run's GPUs with --gpus")
        raw = (config.get("data") or {}).get("levels")
        if not isinstance(raw, list):
            raise ValueError("data.levels: the config chooses its levels at set-up; give them as a list to price them")
        hw = HARDWARE[args.gpu]
        node = devices if counted else hw.gpus_per_node  # training lays the levels out over its devices
        levels = [
            resolve_layout(as_level(x, f"data.levels[{i}]"), spec.heads, spec.kv_heads, node) for i, x in enumerate(raw)
        ]
        check_levels(levels, world, spec.layers)
        settings = config_settings(config, hw, world, spec)
        check(settings, CONFIG, max((lv.mlp_tiles for lv in levels), default=1))
        check_precision(trainer)
        cost = cost_model(spec, settings)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{spec.name} ({spec.params / 1e9:.1f}B) on {world} x {hw.name}, {describe(cost)}: predicted peak GiB "
        "per GPU (host: offloaded inputs, GiB per GPU)\n"
    )
    print(table(cost, levels))
    problems = not_fitting(cost, levels)
    print("\n" + ("\n".join(problems) if problems else "every level fits."))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
