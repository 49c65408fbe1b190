"""The optimizer step of an ``HBPLitModule`` run: its settings checked, which AdamW steps the parameters (fused
where it can, else foreach: never a Python loop over them), and the global gradient norm it logs, read from the
device only at the steps the loggers write.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_hbp.cost.run_settings import deepspeed_zero
from lit_hbp.errors import ConfigError


def adamw_kind(params: list[torch.Tensor], device: torch.device | None = None) -> str:
    """``fused`` when every trainable parameter is a floating tensor stepped on a CUDA device, else
    ``foreach`` (torch's multi-tensor kernels: a handful of calls per step, not a Python loop over the
    parameters). ``device`` is where the optimizer steps them (the strategy's: a model built before
    ``fit`` is on the host until DeepSpeed moves it, and DeepSpeed steps its fp32 master copies there);
    without it, where the parameters are. The fused kernel updates every parameter in one pass over
    memory; the unfused AdamW makes about ten."""
    on_cuda = device.type == "cuda" if device is not None else all(p.is_cuda for p in params)
    fused = bool(params) and on_cuda and all(p.is_floating_point() for p in params)
    return "fused" if fused else "foreach"


def decay_groups(model: torch.nn.Module, weight_decay: float, saved: list[int] | None = None) -> list[dict]:
    """AdamW's parameter groups of ``model``'s trainable parameters: decayed by ``weight_decay``, or not.
    Not decayed: every parameter whose name holds ``bias`` or ``norm`` (Hugging Face Trainer's rule, a MoE's
    2-D expert biases included) and every one with fewer than two dimensions (scales, gates, a state-space
    layer's ``A_log`` and ``D``: the convention of nanoGPT and Mamba's own training code, which HF Trainer
    decays). Empty groups are left out. ``saved``: the group sizes of the checkpoint a run resumes
    (``saved_group_sizes``): one written before 2-D biases left the decayed group resumes on its own groups, said."""
    groups = _groups(model, weight_decay, ("bias", "norm"))
    if saved is None or [len(g["params"]) for g in groups] == saved:
        return groups
    old = _groups(model, weight_decay, ("norm",))
    if [len(g["params"]) for g in old] != saved:
        raise ConfigError(
            f"the checkpoint's AdamW groups hold {saved} parameters, this run's {[len(g['params']) for g in groups]}: "
            "resume the model it was written for (its lora and trainable parameters as they were)"
        )
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(
        "the checkpoint's AdamW groups decay 2-D biases (written before lit-hbp left every parameter named bias "
        "undecayed): the resumed run keeps its groups"
    )
    return old


def _groups(model: torch.nn.Module, weight_decay: float, undecayed: tuple[str, ...]) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 partitions parameters into 1-D shards
            lowered = name.lower()
            (no_decay if len(shape) < 2 or any(w in lowered for w in undecayed) else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def saved_group_sizes(trainer) -> list[int] | None:
    """The parameters of each optimizer group in the checkpoint ``trainer`` resumes, which Lightning holds loaded
    while the optimizer is built (None otherwise, and under DeepSpeed, which restores after)."""
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None) or {}
    states = loaded.get("optimizer_states") or [{}]
    groups = states[0].get("param_groups") if isinstance(states[0], dict) else None
    return [len(g["params"]) for g in groups] if groups else None


def clips_scaled_gradients(trainer) -> bool:
    """Whether Lightning clips the gradients before the optimizer's step with fp16's loss scaler, which it
    unscales first and so refuses an optimizer that unscales inside its step (fused AdamW: "does not allow
    for gradient clipping"). Without a scaler (fp32, bf16) ``HBPLitModule.configure_gradient_clipping``
    clips itself and the fused kernel runs; DeepSpeed clips inside its own step."""
    clip = getattr(trainer, "gradient_clip_val", None)
    return bool(clip) and getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None


def optimizer_device(strategy) -> torch.device:
    """Where ``strategy`` steps the optimizer: its root device, the host under ZeRO-Offload."""
    offloaded = deepspeed_zero(getattr(strategy, "config", None))["optimizer_offload"]
    return torch.device("cpu") if offloaded else strategy.root_device


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of ``grads`` taken as one vector, accumulated in fp32 (float64 gradients in float64), as a
    tensor on the first gradient's device (nothing is read on the host); None without a gradient."""
    if not grads:
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, torch.promote_types(g.dtype, torch.float32)), []).append(g.detach())
    device, dtype = grads[0].device, max((d for _, d in groups), key=lambda d: torch.finfo(d).bits)
    norms = [n.to(device, dtype) for (_, d), group in groups.items() for n in torch._foreach_norm(group, 2, dtype=d)]
    return torch.linalg.vector_norm(torch.stack(norms))


def zero_engine(strategy):
    """The DeepSpeed engine of a strategy (DeepSpeedStrategy, HBPStrategy) whose optimizer is one of
    ZeRO's (stages 1-3, and DeepSpeed's BF16 optimizer): it computes the global gradient norm itself,
    over the gradient partitions of every rank, before clipping (``get_global_grad_norm()`` after the
    step). None for other strategies and for ZeRO stage 0, whose gradients are whole on each rank in
    the parameters' ``.grad``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    engine = strategy.model  # the engine, once the strategy has set it up
    return engine if isinstance(getattr(engine, "optimizer", None), ZeROOptimizer) else None


def check_optimizer_settings(
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    min_lr_ratio: float,
    ce_chunk_size: int,
) -> None:
    """Refuse, naming the config key, a value that torch would take and train on wrongly (a negative floor is a
    negative learning rate: gradient ascent; an infinite rate or decay, weights of NaN) or refuse only at the first
    step with its own words."""
    bad = []
    for key, value in (("lr", lr), ("weight_decay", weight_decay)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            bad.append(f"model.{key} must be a finite number >= 0, got {value!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        bad.append(f"model.betas must be two numbers in [0, 1), got {list(betas)!r}")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        bad.append(f"model.warmup_steps must be a whole number of optimizer steps >= 0, got {warmup_steps!r}")
    if not isinstance(min_lr_ratio, (int, float)) or not 0 <= min_lr_ratio <= 1:
        bad.append(f"model.min_lr_ratio (the cosine's floor, a share of lr) must be in [0, 1], got {min_lr_ratio!r}")
    if not isinstance(ce_chunk_size, int) or isinstance(ce_chunk_size, bool) or ce_chunk_size < 1:
        bad.append(f"model.ce_chunk_size (a loss chunk's tokens) must be a whole number >= 1, got {ce_chunk_size!r}")
    if bad:
        raise ConfigError("; ".join(bad))


def check_deepspeed_accumulation(strategy: Any, accumulate: int) -> None:
    """Lightning's own ``DeepSpeedStrategy`` with gradient accumulation: Lightning's loop divides the loss by
    ``accumulate_grad_batches`` and DeepSpeed's ``engine.backward`` divides it again, so every gradient is 1/A of
    the module's loss (clipping A times as strong, ``train/grad_norm`` A times low). ``HBPStrategy``'s backward
    divides once."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    plain = isinstance(strategy, DeepSpeedStrategy) and type(strategy).backward is DeepSpeedStrategy.backward
    if accumulate > 1 and plain:
        raise ConfigError(
            f"trainer.strategy {type(strategy).__name__} with accumulate_grad_batches {accumulate}: Lightning and "
            f"DeepSpeed's engine.backward each divide the loss by {accumulate}, so every gradient would be 1/"
            f"{accumulate} of the loss's: train with trainer.strategy hbp (HBPStrategy, DeepSpeed dividing once)"
        )


def clips_whole_gradients(trainer: Any, value: float | None, algorithm: Any) -> bool:
    """Whether ``configure_gradient_clipping`` clips by norm itself: a value > 0, by norm, nothing scaling the
    gradients, and whole gradients on every rank (one device, DDP; not DeepSpeed's, not a sharding strategy's)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    by_norm = algorithm is None or algorithm == "norm"  # a str or Lightning's str enum
    unscaled = getattr(trainer.precision_plugin, "scaler", None) is None
    strategy = trainer.strategy
    whole = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, DeepSpeedStrategy)
    return value is not None and value > 0 and by_norm and unscaled and whole
