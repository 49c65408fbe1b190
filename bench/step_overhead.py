"""What a training step costs beyond its forward and backward: the run's optimizer step as ``Trainer.fit``
runs it, beside a bare PyTorch loop on the same packs and the same weights.

    python bench/step_overhead.py [--layers 4 8 16 32] [--width 64] [--pack-len 64] [--steps 30] [--rounds 3]
                                  [--modes bare,hbp_ddp,hbp_zero2,single] [--device cpu]

The model has the parameter tensors of ``configs/llama_1b_1gpu.yaml`` (16 Llama layers: 147 tensors) at
``--width`` 64, so a step's arithmetic is small and what is timed is what the host does per step. Modes,
each on the same packs (``--pack-len`` tokens of three documents each) from the same initial weights:

- ``bare``: ``prepare_model`` + ``packed_loss`` + AdamW (fused on CUDA, multi-tensor on CPU) +
  ``clip_grad_norm_(foreach=True)``, nothing read back: the floor a training library can reach;
- ``hbp_ddp``: ``Trainer.fit`` of ``HBPLitModule`` with ``HBPDDPStrategy`` (no DeepSpeed; what
  ``configs/llama_1b_1gpu.yaml`` runs);
- ``hbp_zero2``: ``Trainer.fit`` with ``HBPStrategy`` at ZeRO stage 2 (DeepSpeed, one process);
- ``single``: ``Trainer.fit`` with Lightning's own single-device strategy.

Every fit runs as the 1B config trains: gradient clipping at 1.0, ``log_every_n_steps`` 10 (so a tenth
of the timed steps log), its step callback ``HBPThroughputMonitor`` (``PackingMetrics`` works per epoch,
from a data module's plan), no checkpoint or logger files, no progress bar. Every mode is timed alike:
from the start of the first step after ``--warmup`` steps to the end of the last, one device
synchronization at each end (on a GPU), nothing in between; each round runs every mode once, in turn,
and each mode's figure is its median round. On a GPU (``--device cuda``) the fits use bf16-mixed and
the bare loop bf16 autocast. Also printed: the aten operations one optimizer step dispatches (counted
over a few steps after the timing, by a dispatch mode), and the step's time per parameter tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.model.build import build_causal_lm
from lit_hbp.report import format_table

MODES = ("bare", "hbp_ddp", "hbp_zero2", "single")
COUNTED_STEPS = 3  # optimizer steps whose dispatched operations are counted, after the timing


def model_config(layers: int, width: int, vocab: int) -> dict:
    """The 1B config's Llama at ``width``: 16 heads over 8 KV heads, its MLP ratio (5632 / 2048); heads at least 8
    wide, the narrowest the GPU's varlen kernels run, so a GPU's step takes the 1B config's attention path."""
    return dict(
        model_type="llama",
        hidden_size=width,
        intermediate_size=int(width * 5632 / 2048),
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=max(width // 16, 8),
        vocab_size=vocab,
        max_position_embeddings=4096,
    )


def make_packs(n: int, pack_len: int, vocab: int, seed: int = 0) -> list:
    """``n`` packs of three documents filling ``pack_len`` tokens, normalized as one micro-batch per step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cuts = np.sort(rng.choice(np.arange(4, pack_len - 4), 2, replace=False))
        lengths = np.diff(np.r_[0, cuts, pack_len])
        docs = [(rng.integers(3, vocab, k), rng.random(k) < 0.7) for k in lengths]
        batch = pack_samples(docs)
        out.append(batch.replace(loss_norm=float(batch.n_targets)))
    return out


class Counting(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step(net: torch.nn.Module, device: torch.device):
    """The bare loop's optimizer step on the prepared ``net``: ``packed_loss`` (bf16 autocast on CUDA), backward,
    foreach clipping, AdamW (fused on CUDA, multi-tensor on CPU); it returns the step's loss, read by nobody."""
    params = [p for p in net.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused or None, foreach=None if fused else True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if fused else contextlib.nullcontext()

    def step(batch) -> torch.Tensor:
        with autocast:
            loss = packed_loss(net, batch.to(device), "ave_token").loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def timed_window(step, packs: list, warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` steps after ``warmup``, one device synchronization at each end."""
    for batch in packs[:warmup]:
        step(batch)
    sync(device)
    start = time.perf_counter()
    for batch in packs[warmup : warmup + steps]:
        step(batch)
    sync(device)
    return (time.perf_counter() - start) / steps


def run_bare(config: dict, packs: list, args, device: torch.device) -> tuple[float, int]:
    """(seconds per optimizer step over the timed window, aten operations per step)."""
    torch.manual_seed(args.seed)
    step = bare_step(prepare_model(build_causal_lm(config).to(device)), device)
    seconds = timed_window(step, packs, args.warmup, args.steps, device)
    counter = Counting()
    with counter:
        for batch in packs[:COUNTED_STEPS]:
            step(batch)
    return seconds, counter.ops // COUNTED_STEPS


class Window:
    """A callback timing optimizer steps ``warmup`` to the end of fit, one synchronization at each end,
    then counting the operations of the last ``COUNTED_STEPS`` steps."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        from lightning.pytorch.callbacks import Callback

        window = self

        class _Clock(Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if trainer.global_step == warmup and window.start is None:
                    sync(device)
                    window.start = time.perf_counter()
                if trainer.global_step == warmup + steps and window.counter is None:
                    sync(device)
                    window.end = time.perf_counter()
                    window.counter = Counting()
                    window.counter.__enter__()

            def on_train_end(self, trainer, module):
                if window.counter is not None:
                    window.counter.__exit__(None, None, None)

        self.callback = _Clock()
        self.start: float | None = None
        self.end: float | None = None
        self.counter: Counting | None = None


def run_fit(mode: str, config: dict, packs: list, args, device: torch.device) -> tuple[float, int]:
    import lightning as L
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lit_hbp.callbacks import HBPThroughputMonitor
    from lit_hbp.lightning import strategy as hbp
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.packing.levels import Level

    levels = [Level(packs[0].input_ids.shape[1])]
    strategy = {
        "hbp_ddp": lambda: hbp.HBPDDPStrategy(levels=levels),
        "hbp_zero2": lambda: hbp.HBPStrategy(levels=levels, stage=2),
        "single": lambda: SingleDeviceStrategy(device),
    }[mode]()
    torch.manual_seed(args.seed)
    module = HBPLitModule(model=config, lr=1e-4, self_check=False)
    total = args.warmup + args.steps + COUNTED_STEPS
    window = Window(args.warmup, args.steps, device)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        max_steps=total,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[HBPThroughputMonitor(), window.callback],
    )
    loader = torch.utils.data.DataLoader(packs[:total], batch_size=None, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader)
    return (window.end - window.start) / args.steps, window.counter.ops // COUNTED_STEPS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[16])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--pack-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=1.20, help="the largest run/bare ratio that passes")
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; modes: {', '.join(MODES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # Lightning's single-device strategy needs the index
        device = torch.device("cuda", torch.cuda.current_device())
    vocab = 256
    packs = make_packs(args.warmup + args.steps + COUNTED_STEPS, args.pack_len, vocab, args.seed)
    rows, ok = [], True
    for layers in args.layers:
        config = model_config(layers, args.width, vocab)
        tensors = 9 * layers + 3
        times: dict[str, list[float]] = {m: [] for m in modes}
        ops: dict[str, int] = {}
        for _ in range(args.rounds):
            for mode in modes:
                run = run_bare if mode == "bare" else lambda *a, m=mode: run_fit(m, *a)
                seconds, ops[mode] = run(config, packs, args, device)
                times[mode].append(seconds)
                print(f"measured {layers} layers {mode}: {seconds * 1e3:.2f} ms a step", flush=True)
        bare = statistics.median(times["bare"]) if "bare" in times else None
        for mode in modes:
            ms = statistics.median(times[mode]) * 1e3
            ratio = ms / (bare * 1e3) if bare else float("nan")
            if mode == "hbp_ddp" and bare and ratio > args.budget:
                ok = False
            rows.append(
                dict(
                    name=f"{layers} layers",
                    tensors=str(tensors),
                    mode=mode,
                    ms_per_step=f"{ms:.2f}",
                    spread=f"{min(times[mode]) * 1e3:.1f}-{max(times[mode]) * 1e3:.1f}",
                    vs_bare=f"{ratio:.2f}",
                    us_per_tensor=f"{ms * 1e3 / tensors:.0f}",
                    ops_per_step=str(ops[mode]),
                )
            )
    cols = ["tensors", "mode", "ms_per_step", "spread", "vs_bare", "us_per_tensor", "ops_per_step"]
    print(
        f"{args.device}, torch {torch.__version__}, width {args.width}, {args.pack_len}-token packs, "
        f"{args.steps} timed steps after {args.warmup}, median of {args.rounds} rounds\n"
    )
    print(format_table(rows, [(c, "s") for c in cols]).replace("plan", "model", 1))
    if "bare" in modes and "hbp_ddp" in modes:
        print(f"\nhbp_ddp within {args.budget:.2f}x of the bare loop at every size: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
