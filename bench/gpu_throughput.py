"""End-to-end training speed per level: lit-hbp beside Hugging Face Trainer on the same packs.

    python bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml [--steps 40] [--warmup 8]
    python bench/gpu_throughput.py --config configs/tiny_cpu.yaml --steps 4 --warmup 2   # a CPU smoke run
    Other arguments are LightningCLI overrides of the config, e.g. --model.compile=false

Modes, each timed over the same optimizer steps of each level of the config's epoch plan (the
packs HBP trains, curriculum off, one device):

- hbp: ``Trainer.fit`` of the config (model, strategy, precision, compile, logger, callbacks, ...)
  as ``python train.py fit`` runs it, checkpointing and curriculum off; every optimizer step's wall
  time, from the previous step's end to its own (the device synchronized there, data loading and
  the optimizer included), goes to its level;
- hf_sdpa / hf_flash_attention_2: Hugging Face ``Trainer`` with ``DataCollatorWithFlattening``
  (one micro-batch's samples per batch: the same tokens per optimizer step as hbp, position_ids
  restarting per sample, bf16 autocast on a GPU), the same initial weights, AdamW, ``torch_compile``
  when the config compiles; flash_attention_2 only when flash-attn is installed;
- fwd_bwd: HBPLitModule forward and backward only (weights in the compute dtype, no optimizer), its
  decoder layers compiled as the run's are when the config compiles.

Every mode is timed alike: the device synchronized at the end of every optimizer step, each step's
wall time (from the previous step's end) added to its level's after the level's ``--warmup`` steps.
hbp trains the levels mixed as HBP runs them (the plan's order); the others run each level's packs
alone. Each mode's ``all`` row is its levels together: their tokens over their summed seconds.

Tokens are real sample tokens; MFU is ``ModelSpec.train_flops`` (the module's definition: dense
layers on real tokens, causal attention per document, LM head on supervised tokens, no
recomputation) over the device's dense peak. A mode that runs out of memory is reported as OOM
and the others still run. Bars (one H100): hbp MFU >= 0.45 at 16K and >= 0.35 at 4K, hbp >= 3x
hf_sdpa in tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_hbp.callbacks import HBPCurriculum
from lit_hbp.cli.app import main as cli_main
from lit_hbp.cost.costmodel import MEMORY_RESERVE_BYTES
from lit_hbp.cost.gpu_peaks import peak_flops as gpu_peak_flops
from lit_hbp.cost.memory import GIB, level_memory
from lit_hbp.data.collate import collate_packs
from lit_hbp.model import attention
from lit_hbp.report import format_table

OOM = (torch.OutOfMemoryError,)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Dense bf16 peak of the device (``lit_hbp.cost.gpu_peaks``, by GPU variant), or --peak-tflops."""
    if override:
        return override * 1e12
    return gpu_peak_flops(device, torch.bfloat16)


class StepClock(L.Callback):
    """Wall time of every optimizer step (device synchronized at step ends), its level, its real
    tokens and model FLOPs; on a GPU each level's peak of allocated bytes over its micro-steps (the
    optimizer step included: Lightning runs it inside the training step)."""

    def __init__(self):
        self.rows: list[tuple[int, float, float, float]] = []
        self.peak: dict[int, int] = {}
        self._tokens = self._flops = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_start(self, trainer, pl_module):
        sync(pl_module.device)
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._tokens += batch.n_tokens / batch.sp
        self._flops += pl_module.flops_per_batch
        if pl_module.device.type == "cuda":
            level = int(batch.level)
            self.peak[level] = max(self.peak.get(level, 0), torch.cuda.max_memory_allocated(pl_module.device))
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        sync(pl_module.device)
        now = time.perf_counter()
        self.rows.append((int(batch.level), now - self._last, self._tokens, self._flops))
        self._last, self._tokens, self._flops = now, 0.0, 0.0


def build(config: str, overrides: list[str], steps: int):
    """The config's trainer, module and data for ``steps`` optimizer steps, as ``train.py fit`` builds
    them: its logger and callbacks (their per-step costs are the run's) and the CLI's own, with no
    progress bar, no checkpoint written and the curriculum off (the timed steps are the plan's)."""
    args = ["--config", config, "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false"]
    cli = cli_main(args + overrides, run=False)
    dropped = (HBPCurriculum, ModelCheckpoint)  # a 1B model's checkpoint is gigabytes of disk, not speed
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, dropped)]
    return cli


def level_packs(dm, level: int, count: int) -> list[list[np.ndarray]]:
    """The first ``count`` optimizer steps of ``level`` in the epoch-0 plan, rank 0's packs of each."""
    plan = dm.plan_for_epoch(0)
    out = []
    for k in range(plan.n_micro_steps):
        mb = plan.micro_batch(0, k)
        if mb.level == level and len(out) < count * plan.accumulate:
            out.append(mb.packs)
    return out


def run_hbp(cli, device, warmup: int, memory: dict) -> dict[int, tuple[float, float, float]]:
    """Each level's (seconds, tokens, FLOPs) after ``warmup`` steps; ``memory`` gets each level's
    predicted bytes (the memory model of this run, without its CUDA reserve) and the measured peak."""
    clock = StepClock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, cli.datamodule)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0.0
    cost, layouts = cli.model.cost_model(capacity)
    for level, lv in enumerate(layouts):
        predicted = level_memory(cost, lv)["total"] - MEMORY_RESERVE_BYTES / GIB
        measured = clock.peak[level] / GIB if level in clock.peak else None
        memory[level] = {"predicted_gib": predicted, "measured_gib": measured}
    per_level: dict[int, list] = {}
    seen: dict[int, int] = {}
    for level, seconds, tokens, flops in clock.rows:
        seen[level] = seen.get(level, 0) + 1
        if seen[level] > warmup:
            row = per_level.setdefault(level, [0.0, 0.0, 0.0])
            row[0] += seconds
            row[1] += tokens
            row[2] += flops
    return {level: tuple(r) for level, r in per_level.items()}


def pack_flops(module, store, packs) -> tuple[float, float]:
    """(real tokens, model FLOPs) of one micro-batch of ``packs``, by the module's definition."""
    batch = collate_packs(packs, store.tokens)
    return batch.n_tokens, module.micro_batch_flops(batch)


def run_hf(
    base_model, attn: str, store, micro, device, warmup: int, module, compiled: bool
) -> tuple[float, float, float]:
    """HF Trainer + DataCollatorWithFlattening over the same micro-batches (one micro-batch's samples a
    step), ``torch_compile`` when ``compiled``."""
    from train_throughput import hf_training_args  # the same baseline settings as the other bench
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback

    cuda = device.type == "cuda"
    net = copy.deepcopy(base_model).to(device=device, dtype=torch.float32).train()
    net.set_attn_implementation(attn)
    net.config.use_cache = False  # with a cache, transformers does not split a padding-free row into its samples
    flatten = DataCollatorWithFlattening(return_position_ids=True)
    items = []
    for packs in micro:
        feats = []
        for i in np.concatenate(packs):
            ids, target = store.tokens(int(i))
            ids = ids.astype(np.int64)  # the store keeps small vocabularies in uint16: -100 would wrap
            feats.append({"input_ids": ids.tolist(), "labels": np.where(target, ids, -100).tolist()})
        items.append(feats)
    stats = [pack_flops(module, store, packs) for packs in micro]
    seconds: list[float] = []  # each optimizer step's, as StepClock times hbp's

    class Clock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            sync(device)
            seconds.append(time.perf_counter())

        def on_step_end(self, targs, state, control, **kw):
            sync(device)
            seconds.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        targs = hf_training_args(out, 1, len(items), cuda, torch_compile=compiled)
        trainer = Trainer(
            model=net, args=targs, train_dataset=items, data_collator=lambda b: flatten(b[0]), callbacks=[Clock()]
        )
        trainer.train()
    tokens = sum(t for t, _ in stats[warmup:])
    flops = sum(f for _, f in stats[warmup:])
    return float(np.diff(seconds)[warmup:].sum()), tokens, flops


def run_fwd_bwd(module, store, micro, device, dtype, warmup: int) -> tuple[float, float, float]:
    """Forward and backward of the module only, weights in ``dtype``, no optimizer; its decoder layers
    compiled as the run compiles them (a deep copy keeps no compiled layer)."""
    net = copy.deepcopy(module).to(device=device, dtype=dtype).train()
    if module.hparams.compile:
        for layer in net._layers:
            layer.compile(dynamic=True)
    batches = []
    for packs in micro:
        b = collate_packs(packs, store.tokens, loss_norm=1.0, level=0)
        batches.append(b.to(device))
    tokens = flops = 0.0
    sync(device)
    last, seconds = time.perf_counter(), 0.0
    for i, b in enumerate(batches):
        net(b)[0].backward()
        net.zero_grad(set_to_none=True)
        sync(device)  # each step timed as StepClock times hbp's
        now = time.perf_counter()
        if i >= warmup:
            seconds += now - last
            tokens += b.n_tokens
            flops += net.micro_batch_flops(b)
        last = now
    return seconds, tokens, flops


def guarded(name: str, fn, device):
    """Run one mode; an out-of-memory error is reported, not raised."""
    try:
        return fn()
    except OOM:
        print(f"{name}: out of memory", file=sys.stderr)
        return "OOM"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b_1gpu.yaml")
    p.add_argument("--steps", type=int, default=40, help="timed optimizer steps per level (plus --warmup)")
    p.add_argument("--warmup", type=int, default=8, help="steps per level left out of the timing (compilation)")
    p.add_argument("--modes", default="hbp,hf_sdpa,hf_flash_attention_2,fwd_bwd")
    p.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (GPUs: looked up)")
    p.add_argument("--json", help="write the table, the memory per level and the attention backends here")
    args, overrides = p.parse_known_args()  # the rest are LightningCLI overrides, e.g. --model.compile=false
    modes = args.modes.split(",")
    per_level = args.steps + args.warmup
    cli = build(args.config, overrides, 1)
    dm, module = cli.datamodule, cli.model
    dm.setup("fit")
    levels = dm.levels
    n_levels = len(levels)
    plan = dm.plan_for_epoch(0)
    counts = np.bincount(plan.step_level, minlength=n_levels)
    take = int(min(per_level, counts.min()))
    # Steps enough that every level trains ``take`` of its steps (levels are shuffled in the plan).
    order = plan.step_level
    need = max(int(np.flatnonzero(order == lv)[take - 1]) + 1 for lv in range(n_levels))
    device = cli.trainer.strategy.root_device
    peak = peak_flops(device, args.peak_tflops)
    module.configure_model()
    base_model = copy.deepcopy(module.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    memory: dict[int, dict] = {}
    results: dict[str, dict[int, object]] = {}  # mode -> level -> (seconds, tokens, flops) | "OOM"
    chosen = []  # the attention backends lit-hbp's packed calls ran on, per kind of call
    if "hbp" in modes:
        fit = build(args.config, overrides, need)
        fit.model.configure_model()
        fit.model.model.load_state_dict(base_model.state_dict())
        out = guarded("hbp", lambda: run_hbp(fit, device, args.warmup, memory), device)
        results["hbp"] = {lv: "OOM" for lv in range(n_levels)} if out == "OOM" else out
        chosen += attention.choices(fit.model.model)
        del fit
    micro = {lv: level_packs(dm, lv, take) for lv in range(n_levels)}
    for attn in ("sdpa", "flash_attention_2"):
        name = f"hf_{attn}"
        if name not in modes:
            continue
        if attn == "flash_attention_2" and not _has_flash_attn():
            print(f"{name}: skipped, flash-attn is not installed", file=sys.stderr)
            continue
        results[name] = {
            lv: guarded(
                name,
                lambda lv=lv, attn=attn: run_hf(
                    base_model, attn, dm.store, micro[lv], device, args.warmup, module, bool(module.hparams.compile)
                ),
                device,
            )
            for lv in range(n_levels)
        }
    if "fwd_bwd" in modes:
        results["fwd_bwd"] = {
            lv: guarded(
                "fwd_bwd", lambda lv=lv: run_fwd_bwd(module, dm.store, micro[lv], device, dtype, args.warmup), device
            )
            for lv in range(n_levels)
        }
        chosen += [c for c in attention.choices(module.model) if c not in chosen]
    params = sum(x.numel() for x in base_model.parameters())
    print(
        f"{args.config}: {params / 1e9:.2f}B parameters, {device.type} "
        f"({device_name(device)}), "
        f"{args.steps} timed steps per level after {args.warmup} warm-up steps"
    )
    for lv in range(n_levels):
        base = results.get("hf_sdpa", {}).get(lv)
        base_tps = base[1] / base[0] if isinstance(base, tuple) else None
        for name, res in results.items():
            r = res.get(lv)
            if r is None:
                continue
            row = dict(name=f"{levels[lv].pack_len}:{levels[lv].sp} {name}", tokens_per_s="OOM", mfu="", vs_hf_sdpa="")
            if r != "OOM":
                seconds, tokens, flops = r
                row.update(tokens_per_s=f"{tokens / seconds:.0f}", mfu=f"{flops / seconds / peak:.3f}" if peak else "")
                row["vs_hf_sdpa"] = f"{tokens / seconds / base_tps:.2f}" if base_tps else ""
            rows.append(row)
    rows += overall(results, peak)
    print(format_table(rows, [("tokens_per_s", "s"), ("mfu", "s"), ("vs_hf_sdpa", "s")]))
    mem_rows = []
    for lv, m in sorted(memory.items()):
        measured = m["measured_gib"]
        error = f"{m['predicted_gib'] / measured - 1:+.1%}" if measured else "n/a (no CUDA)"
        row = dict(name=f"{levels[lv].pack_len}:{levels[lv].sp}", predicted_gib=f"{m['predicted_gib']:.2f}")
        mem_rows.append({**row, "measured_gib": f"{measured:.2f}" if measured else "", "error": error})
    if mem_rows:
        print("memory per level: the memory model's tensors (no CUDA reserve) against max_memory_allocated")
        print(format_table(mem_rows, [("predicted_gib", "s"), ("measured_gib", "s"), ("error", "s")]))
    for c in chosen:
        print(f"attention: {c['backend']} for {c['dtype']} {c['needs']} calls on {c['device']} ({c['why']})")
    if args.json:
        report = {
            "config": args.config, "device": device_name(device), "parameters": params, "steps": args.steps,
            "warmup": args.warmup, "throughput": rows, "attention": chosen,
            "memory": [{**r, **memory[lv]} for lv, r in zip(sorted(memory), mem_rows)],
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def overall(results: dict[str, dict[int, object]], peak: float | None) -> list[dict]:
    """Each mode's levels together (``all``): their tokens over their summed seconds, beside hf_sdpa's."""
    totals = {}
    for name, res in results.items():
        done = [r for r in res.values() if isinstance(r, tuple)]
        if done and len(done) == len(res):
            totals[name] = tuple(sum(r[i] for r in done) for i in range(3))
    base = totals.get("hf_sdpa")
    rows = []
    for name, (seconds, tokens, flops) in totals.items():
        row = dict(name=f"all {name}", tokens_per_s=f"{tokens / seconds:.0f}")
        row["mfu"] = f"{flops / seconds / peak:.3f}" if peak else ""
        row["vs_hf_sdpa"] = f"{tokens / seconds / (base[1] / base[0]):.2f}" if base else ""
        rows.append(row)
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


if __name__ == "__main__":
    sys.exit(main())
