"""End-to-end training speed per level: lit-hbp beside Hugging Face Trainer on the same packs.

    python bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml [--steps 40] [--warmup 8]
    python bench/gpu_throughput.py --config configs/tiny_cpu.yaml --steps 4 --warmup 2   # a CPU smoke run
    Other arguments are LightningCLI overrides of the config, e.g. --model.compile=false

Modes, each over the same optimizer steps of each level of the config's epoch plan (the packs HBP
trains, curriculum off, validation off, one device, the same initial weights):

- hbp: ``Trainer.fit`` of the config (model, strategy, precision, compile, logger, callbacks, ...)
  as ``python train.py fit`` runs it, checkpointing off, the levels mixed as HBP trains them (the plan's
  order), timed as one window from the step by which every level had its ``--warmup`` steps: its row is
  ``all hbp`` only (a window of mixed levels cannot be split by level without a synchronization a step);
- hbp_alone: the same ``Trainer.fit``, one level at a time (the plan's steps of that level only);
- hf_sdpa / hf_flex_attention / hf_flash_attention_2: Hugging Face ``Trainer`` with ``DataCollatorWithFlattening``
  (one micro-batch's samples per batch: the same tokens per optimizer step as hbp, position_ids
  restarting per sample, bf16 autocast on a GPU), AdamW; when the config compiles, each decoder layer
  compiled as the run's, a symbol per size as in lit-hbp's packed calls (``sizes_apart``; ``--peer-compile
  model``: the Trainer's own ``torch_compile`` of the whole model instead); the model the family's own,
  lit-hbp's preparation undone (``baseline_copy``);
  flex_attention (transformers' FlexAttention with its packed-sequence block mask) on a GPU only,
  flash_attention_2 only when flash-attn is installed;
- trl_bfd: TRL's ``SFTTrainer`` on the level's samples, ``packing=True, packing_strategy="bfd"``
  (padding-free rows of the level's pack length, TRL's own packing), as many rows a step as the level's
  micro-batches hold packs (the same tokens a step), the same steps,
  flash_attention_2 where flash-attn installs, else sdpa (the row says which), compiled as above;
- fwd_bwd: HBPLitModule forward and backward only (weights in the compute dtype, no optimizer), its
  decoder layers compiled as the run's are when the config compiles.

Timing: every mode is timed alike, one device synchronization at each end of a window, the steps between
summed (the host runs ahead of the device as it does in training): every mode but hbp one window a level
(after the level's ``--warmup`` steps), hbp one window over its mixed levels. Each mode's ``all`` row is
its levels together: their tokens over their summed seconds (hbp's: its one window).

Tokens are real sample tokens; MFU is ``ModelSpec.train_flops`` (the module's definition: dense
layers on real tokens, causal attention per document, LM head on supervised tokens, no
recomputation) over the device's dense peak (TRL's rows: their documents from the rows' positions).
A mode that runs out of memory is reported as OOM, one that fails as failed (its traceback on stderr),
and the others still run. Bars (one H100): hbp MFU >= 0.45 at 16K and >= 0.40 at 4K, hbp >= 1.5x HF
Trainer's fastest padding-free mode and >= 1.2x trl_bfd at every level.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import sys
import tempfile
import time
import traceback
from dataclasses import replace

from lit_hbp.cli.command import heap_left_alone

# As a script: the imports without the cyclic collector, frozen after (as lit-hbp's command line); imported (by
# the tests), the importer's collector is left as it is.
with heap_left_alone() if __name__ == "__main__" else contextlib.nullcontext():
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
    from lit_hbp.model.compile_scope import sizes_apart
    from lit_hbp.packing.plan import Plan
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


class WindowClock(L.Callback):
    """One level trained alone, timed as one window: the device synchronized after ``warmup`` optimizer
    steps and after the ``total``-th, the steps between summed with their real tokens and model FLOPs;
    on a GPU the level's peak of allocated bytes."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total, self.steps = warmup, total, 0
        self.tokens = self.flops = 0.0
        self.start: float | None = None
        self.seconds: float | None = None
        self.peak = 0

    def on_train_start(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if self.warmup == 0:
            sync(pl_module.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.steps >= self.warmup:
            self.tokens += batch.n_tokens / batch.sp
            self.flops += pl_module.flops_per_batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.steps += 1
        if self.steps == self.warmup:
            sync(pl_module.device)
            self.start = time.perf_counter()
        elif self.steps == self.total:
            sync(pl_module.device)
            self.seconds = time.perf_counter() - self.start
            if pl_module.device.type == "cuda":
                self.peak = torch.cuda.max_memory_allocated(pl_module.device)


class MixedClock(WindowClock):
    """The levels mixed as HBP trains them, timed as one window (``WindowClock``); on a GPU each level's peak
    of allocated bytes over its micro-steps (the optimizer step included: Lightning runs it inside the training
    step), read from the allocator's counters on the host, which waits for nothing."""

    def __init__(self, warmup: int, total: int):
        super().__init__(warmup, total)
        self.levels: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            level = int(batch.level)
            self.levels[level] = max(self.levels.get(level, 0), torch.cuda.max_memory_allocated(pl_module.device))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def build(config: str, overrides: list[str], steps: int):
    """The config's trainer, module and data for ``steps`` optimizer steps, as ``train.py fit`` builds
    them: its logger and callbacks (their per-step costs are the run's) and the CLI's own, with no
    progress bar, no checkpoint written, no validation and the curriculum off (the timed steps are the
    plan's)."""
    args = ["--config", config, "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.limit_val_batches", "0"]  # the timed steps are training's alone
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


def run_hbp(cli, device, start: int, total: int, memory: dict) -> tuple[float, float, float]:
    """(seconds, tokens, FLOPs) of the mixed optimizer steps ``start + 1`` to ``total``, one window; ``memory``
    gets each level's predicted bytes (the memory model of this run, without its CUDA reserve) and its peak."""
    clock = MixedClock(start, total)
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, cli.datamodule)
    for level, predicted in enumerate(predicted_gib(cli.model, device)):
        measured = clock.levels[level] / GIB if level in clock.levels else None
        memory[level] = {"predicted_gib": predicted, "measured_gib": measured}
    return clock.seconds, clock.tokens, clock.flops


def predicted_gib(module, device) -> list[float]:
    """Each level's bytes (GiB) by the memory model of ``module``'s run, without its CUDA reserve."""
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0.0
    cost, layouts = module.cost_model(capacity)
    return [level_memory(cost, lv)["total"] - MEMORY_RESERVE_BYTES / GIB for lv in layouts]


def only_level(plan: Plan, level: int) -> Plan:
    """``plan`` with the steps of ``level`` only, in their order (their packs, normalizers and counts)."""
    keep = np.flatnonzero(plan.step_level == level)
    starts, ends = plan.step_offsets[keep], plan.step_offsets[keep + 1]
    packs = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
    sizes = plan.offsets[packs + 1] - plan.offsets[packs]
    members = np.concatenate([plan.members[plan.offsets[p] : plan.offsets[p + 1]] for p in packs])
    return replace(
        plan,
        members=members,
        offsets=np.r_[0, np.cumsum(sizes)].astype(plan.offsets.dtype),
        pack_capacity=plan.pack_capacity[packs],
        step_level=plan.step_level[keep],
        step_offsets=np.r_[0, np.cumsum(ends - starts)].astype(plan.step_offsets.dtype),
        step_loss_tokens=plan.step_loss_tokens[keep],
    )


def run_hbp_alone(config, overrides, level: int, steps: int, warmup: int, weights, device, memory: dict):
    """``Trainer.fit`` of the config on the first ``steps`` steps of ``level`` alone, timed as one window
    after ``warmup`` steps: (seconds, tokens, FLOPs); ``memory`` gets the level's prediction and peak."""
    fit = build(config, overrides, steps)
    fit.model.configure_model()
    fit.model.model.load_state_dict(weights)
    dm, plans = fit.datamodule, {}
    whole = dm.plan_for_epoch
    dm.plan_for_epoch = lambda epoch: plans.setdefault(epoch, only_level(whole(epoch), level))
    clock = WindowClock(warmup, steps)
    fit.trainer.callbacks.append(clock)
    fit.trainer.fit(fit.model, dm)
    predicted = predicted_gib(fit.model, device)[level]
    memory[level] = {"predicted_gib": predicted, "measured_gib": clock.peak / GIB if clock.peak else None}
    measured = f"{clock.peak / GIB:.2f}" if clock.peak else "n/a"
    print(f"memory of level {level}: {predicted:.2f} GiB predicted, {measured} GiB measured", file=sys.stderr)
    return clock.seconds, clock.tokens, clock.flops


def pack_flops(module, store, packs) -> tuple[float, float]:
    """(real tokens, model FLOPs) of one micro-batch of ``packs``, by the module's definition."""
    batch = collate_packs(packs, store.tokens)
    return batch.n_tokens, module.micro_batch_flops(batch)


def run_hf(
    base_model, attn: str, store, micro, device, warmup: int, module, compiled: str
) -> tuple[float, float, float]:
    """HF Trainer + DataCollatorWithFlattening over the same micro-batches (one micro-batch's samples a
    step); ``compiled``: ``layers`` (each decoder layer, as the run's), ``model`` (the Trainer's own
    ``torch_compile``) or ``none``."""
    from train_throughput import baseline_copy, hf_training_args  # the same baseline settings as the other bench
    from transformers import DataCollatorWithFlattening, Trainer

    cuda = device.type == "cuda"
    net = baseline_copy(base_model, attn, compiled == "layers").to(device=device, dtype=torch.float32).train()
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
    clock = hf_window(device, warmup, len(items))
    with tempfile.TemporaryDirectory() as out, sizes_apart():  # compiled as lit-hbp's packed calls compile
        targs = hf_training_args(out, 1, len(items), cuda, torch_compile=compiled == "model")
        trainer = Trainer(
            model=net, args=targs, train_dataset=items, data_collator=lambda b: flatten(b[0]), callbacks=[clock]
        )
        trainer.train()
    tokens = sum(t for t, _ in stats[warmup:])
    flops = sum(f for _, f in stats[warmup:])
    return clock.seconds, tokens, flops


def hf_window(device, warmup: int, total: int):
    """A Hugging Face ``TrainerCallback`` that times steps ``warmup`` + 1 .. ``total`` as one window (the
    device synchronized twice, as ``WindowClock`` times lit-hbp's): its ``seconds``."""
    from transformers import TrainerCallback

    class Window(TrainerCallback):
        seconds: float | None = None
        start: float | None = None

        def on_train_begin(self, targs, state, control, **kw):
            if warmup == 0:
                sync(device)
                self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            if state.global_step == warmup:
                sync(device)
                self.start = time.perf_counter()
            elif state.global_step == total:
                sync(device)
                self.seconds = time.perf_counter() - self.start

    return Window()


def run_trl(
    base_model, tokenizer, store, micro, pack_len: int, device, warmup: int, module, compiled: str
) -> tuple[float, float, float, str]:
    """TRL's ``SFTTrainer`` with BFD packing (padding-free rows of ``pack_len``) over the samples of
    ``micro``, as many rows a step as the level's micro-batches hold packs (the same tokens a step: one row a
    step made TRL's 4K level on the H200 of 2026-12-04 a quarter of lit-hbp's), for as many steps, compiled as
    ``run_hf``: (seconds, tokens, FLOPs, attention)."""
    import importlib.util

    from datasets import Dataset
    from train_throughput import baseline_copy, hf_training_args
    from trl import SFTConfig, SFTTrainer

    cuda = device.type == "cuda"
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    net = baseline_copy(base_model, attn, compiled == "layers").to(device=device, dtype=torch.float32).train()
    records = []
    for i in np.concatenate([np.concatenate(packs) for packs in micro]):
        ids, target = store.tokens(int(i))
        ids = ids.astype(np.int64)
        records.append({"input_ids": ids.tolist(), "labels": np.where(target, ids, -100).tolist()})
    rows: list[tuple[float, float]] = []  # each collated row's (real tokens, model FLOPs)

    def counted(collate):
        def collate_and_count(features):
            batch = collate(features)
            rows.append(row_flops(module, batch["position_ids"][0], batch["labels"][0]))
            return batch

        return collate_and_count

    clock = hf_window(device, warmup, len(micro))
    per_step = max(len(packs) for packs in micro)  # the level's packs a micro-batch: TRL's rows a step
    with tempfile.TemporaryDirectory() as out, sizes_apart():
        targs = hf_training_args(
            out, per_step, len(micro), cuda, args_class=SFTConfig, packing=True, packing_strategy="bfd",
            max_length=pack_len, dataset_num_proc=None, gradient_checkpointing=False, torch_compile=compiled == "model",
        )  # fmt: skip
        data = Dataset.from_list(records)
        trainer = SFTTrainer(model=net, args=targs, train_dataset=data, processing_class=tokenizer, callbacks=[clock])
        trainer.data_collator = counted(trainer.data_collator)
        trainer.train()
    timed = rows[warmup : len(micro)]
    return clock.seconds, sum(t for t, _ in timed), sum(f for _, f in timed), attn


def row_flops(module, positions: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(real tokens, model FLOPs) of one padding-free row, its documents where its positions restart, by
    the module's definition (``HBPLitModule.micro_batch_flops``)."""
    pos = positions.cpu().numpy()
    starts = np.flatnonzero(pos == 0)
    lens = np.diff(np.r_[starts, pos.size]).astype(np.float64)
    spec, full = module._spec, not module.hparams.lora
    head = int((labels[1:] != -100).sum())  # the shifted targets the LM head trains
    dense = spec.train_flops(pos.size, spec.attention_sq(lens), 0, full)
    return float(pos.size), dense + spec.train_flops(0, 0, head, full)


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
    start = time.perf_counter()
    for i, b in enumerate(batches):
        if i == warmup:  # one window after the warm-up, as WindowClock times hbp_alone's
            sync(device)
            start = time.perf_counter()
        net(b)[0].backward()
        net.zero_grad(set_to_none=True)
        if i >= warmup:
            tokens += b.n_tokens
            flops += net.micro_batch_flops(b)
    sync(device)
    return time.perf_counter() - start, tokens, flops


def guarded(name: str, fn, device, where: str = ""):
    """Run one mode; an out-of-memory error or any other failure is reported (its row says OOM or failed, the
    traceback goes to stderr), not raised. Each result is printed as it comes (a run stopped at its time limit
    keeps what it measured)."""
    try:
        result = fn()
        if isinstance(result, tuple) and result[0] > 0:
            seconds, tokens, flops = result[:3]
            print(f"measured {name} {where}: {tokens / seconds:.0f} tokens/s, {flops / seconds / 1e12:.1f} TFLOP/s "
                  f"({tokens:.0f} tokens in {seconds:.3f} s)", file=sys.stderr, flush=True)  # fmt: skip
        return result
    except OOM:
        print(f"{name}: out of memory", file=sys.stderr)
        return "OOM"
    except Exception:  # one mode's failure is its row's, not the run's: the others still measure
        print(f"{name} {where}: failed", file=sys.stderr)
        traceback.print_exc()
        return "failed"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b_1gpu.yaml")
    p.add_argument("--steps", type=int, default=40, help="timed optimizer steps per level (plus --warmup)")
    p.add_argument("--warmup", type=int, default=8, help="steps per level left out of the timing (compilation)")
    p.add_argument("--modes", default="hbp,hbp_alone,hf_sdpa,hf_flex_attention,hf_flash_attention_2,trl_bfd,fwd_bwd")
    p.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (GPUs: looked up)")
    p.add_argument("--json", help="write the table, the memory per level and the attention backends here")
    p.add_argument(
        "--peer-compile",
        choices=("layers", "model"),
        default="layers",
        help="when the config compiles, how HF Trainer's and TRL's models are: each decoder layer as the run's "
        "(default), or the Trainer's own torch_compile of the whole model (~100 s of compilation a level on an H200)",
    )
    args, overrides = p.parse_known_args()  # the rest are LightningCLI overrides, e.g. --model.compile=false
    modes = args.modes.split(",")
    per_level = args.steps + args.warmup
    cli = build(args.config, overrides, 1)
    dm, module = cli.datamodule, cli.model
    dm.trainer = cli.trainer  # the plan counts the run's world and gradient accumulation, as Trainer.fit's would
    dm.setup("fit")
    levels = dm.levels
    n_levels = len(levels)
    plan = dm.plan_for_epoch(0)
    counts = np.bincount(plan.step_level, minlength=n_levels)
    take = int(min(per_level, counts.min()))
    if take <= args.warmup:
        p.error(f"a level of this plan has {counts.min()} steps: fewer than --warmup {args.warmup} + 1")
    # Steps enough that every level trains ``take`` of its steps (levels are shuffled in the plan).
    order = plan.step_level
    need = max(int(np.flatnonzero(order == lv)[take - 1]) + 1 for lv in range(n_levels))
    warm = max(int(np.flatnonzero(order == lv)[args.warmup - 1]) + 1 for lv in range(n_levels)) if args.warmup else 0
    device = cli.trainer.strategy.root_device
    peak = peak_flops(device, args.peak_tflops)
    module.configure_model()
    base_model = copy.deepcopy(module.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    memory: dict[int, dict] = {}
    results: dict[str, dict[int | str, object]] = {}  # mode -> level (hbp: "all") -> (seconds, tokens, flops) | "OOM"
    chosen = []  # the attention backends lit-hbp's packed calls ran on, per kind of call
    if "hbp" in modes:
        fit = build(args.config, overrides, need)
        fit.model.configure_model()
        fit.model.model.load_state_dict(base_model.state_dict())
        results["hbp"] = {"all": guarded("hbp", lambda: run_hbp(fit, device, warm, need, memory), device, "all levels")}
        chosen += attention.choices(fit.model.model)
        del fit
    if "hbp_alone" in modes:
        weights = base_model.state_dict()
        results["hbp_alone"] = {
            lv: guarded(
                "hbp_alone",
                lambda lv=lv: run_hbp_alone(args.config, overrides, lv, take, args.warmup, weights, device, memory),
                device,
                f"level {levels[lv].pack_len}",
            )
            for lv in range(n_levels)
        }
    micro = {lv: level_packs(dm, lv, take) for lv in range(n_levels)}
    peers = args.peer_compile if module.hparams.compile else "none"  # HF's and TRL's: compiled when the run is
    for attn in ("sdpa", "flex_attention", "flash_attention_2"):
        name = f"hf_{attn}"
        if name not in modes:
            continue
        if attn == "flash_attention_2" and not _has_flash_attn():
            print(f"{name}: skipped, flash-attn is not installed", file=sys.stderr)
            continue
        if attn == "flex_attention" and device.type != "cuda":
            print(f"{name}: skipped, torch's FlexAttention has no backward on {device.type}", file=sys.stderr)
            continue
        results[name] = {
            lv: guarded(
                name,
                lambda lv=lv, attn=attn: run_hf(
                    base_model, attn, dm.store, micro[lv], device, args.warmup, module, peers
                ),
                device,
                f"level {levels[lv].pack_len}",
            )
            for lv in range(n_levels)
        }
    if "trl_bfd" in modes:
        trl = {
            lv: guarded(
                "trl_bfd",
                lambda lv=lv: run_trl(
                    base_model,
                    dm.tokenizer,
                    dm.store,
                    micro[lv],
                    levels[lv].pack_len,
                    device,
                    args.warmup,
                    module,
                    peers,
                ),
                device,
                f"level {levels[lv].pack_len}",
            )
            for lv in range(n_levels)
        }
        results["trl_bfd"] = {lv: r if r == "OOM" else r[:3] for lv, r in trl.items()}
        trl_attention = sorted({r[3] for r in trl.values() if r != "OOM"})
        print(f"trl_bfd: attention {', '.join(trl_attention) or 'none (out of memory)'}", file=sys.stderr)
    if "fwd_bwd" in modes:
        results["fwd_bwd"] = {
            lv: guarded(
                "fwd_bwd",
                lambda lv=lv: run_fwd_bwd(module, dm.store, micro[lv], device, dtype, args.warmup),
                device,
                f"level {levels[lv].pack_len}",
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
            row = dict(name=f"{levels[lv].pack_len}:{levels[lv].sp} {name}", tokens_per_s=r, mfu="", vs_hf_sdpa="")
            if isinstance(r, tuple):
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


def overall(results: dict[str, dict[int | str, object]], peak: float | None) -> list[dict]:
    """Each mode's levels together (``all``): their tokens over their summed seconds (a mode timed over its
    mixed levels: its one window), beside hf_sdpa's."""
    totals = {}
    for name, res in results.items():
        done = [r for r in res.values() if isinstance(r, tuple)]
        if done and len(done) == len(res):
            totals[name] = tuple(sum(r[i] for r in done) for i in range(3))
    base = totals.get("hf_sdpa")
    rows = [dict(name=f"all {name}", tokens_per_s=res["all"], mfu="", vs_hf_sdpa="") for name, res in results.items()
            if isinstance(res.get("all"), str)]  # fmt: skip
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
