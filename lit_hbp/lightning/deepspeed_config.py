"""A DeepSpeed config as ``HBPStrategy`` runs it: what it turns off that synchronizes the device for nothing, and
what it refuses before it trains (settings DeepSpeed or Lightning would drop or apply other than asked, each named
with its fix: a run that trains otherwise than its config says is the one outcome lit-hbp does not allow), and what
DeepSpeed leaves changed in torch after the run that it puts back."""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lit_hbp.cost.run_settings import Settings, deepspeed_zero
from lit_hbp.errors import ConfigError

WHERE = "trainer.strategy (HBPStrategy)"
ARGUMENTS = {  # HBPStrategy's own arguments Lightning reads only without a config: what each is in a config
    "stage": lambda c: deepspeed_zero(c)["zero_stage"],
    "offload_optimizer": lambda c: deepspeed_zero(c)["optimizer_offload"],
    "offload_parameters": lambda c: deepspeed_zero(c)["param_offload"],
    # DeepSpeed's default: on at stage 3, off below
    "overlap_comm": lambda c: bool(
        ((c or {}).get("zero_optimization") or {}).get("overlap_comm", deepspeed_zero(c)["zero_stage"] == 3)
    ),
}


BUILD_CONFIG = (  # DeepSpeedStrategy's arguments it builds a config from when given none (_create_default_config)
    *ARGUMENTS, "zero_optimization", "zero_allow_untested_optimizer", "nvme_path", "offload_params_device",
    "params_buffer_count", "params_buffer_size", "max_in_cpu", "offload_optimizer_device", "optimizer_buffer_count",
    "pin_memory", "block_size", "queue_depth", "single_submit", "overlap_events", "thread_count", "sub_group_size",
    "contiguous_gradients", "allgather_partitions", "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size",
)  # fmt: skip
AIO = ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")  # built with or without ZeRO
# fp16's dynamic loss scaling, which Lightning writes into the fp16 section it adds (16-mixed and 16-true, a config
# without an fp16 section) and reads nowhere else.
LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
ACTIVATION_CHECKPOINTING = (  # DeepSpeed's activation checkpointing, which lit-hbp's layers never call
    "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
)  # fmt: skip


def asked_settings(config: dict | None, overlap_comm: bool | None) -> tuple[Any, bool, bool]:
    """What a user's DeepSpeed ``config`` (None: none given) and ``HBPStrategy(overlap_comm=)`` decide that lit-hbp
    sets otherwise: the config's clipping, ZeRO's overlap_comm, bf16's overflow check."""
    said = config or {}
    overlap = overlap_comm is not None or "overlap_comm" in (said.get("zero_optimization") or {})
    return said.get("gradient_clipping"), overlap, "check_grad_overflow" in (said.get("bf16") or {})


def check_arguments(config: dict | None, given: dict[str, Any]) -> None:
    """The arguments ``given`` to ``HBPStrategy`` (those its caller set), each used or refused: with a DeepSpeed
    ``config`` Lightning builds nothing from ``stage``, the offloads, ``overlap_comm``, the bucket sizes, ...
    (``HBPStrategy(stage=3, config={...})`` trained at the config's stage, 0 without a ``zero_optimization``
    section), so each must say what the config says; DeepSpeed's activation checkpointing is never called (a
    level's ``ckpt_layers`` and ``offload`` checkpoint)."""
    unused = [k for k in ACTIVATION_CHECKPOINTING if given.get(k)]
    section = (config or {}).get("activation_checkpointing") or {}
    unused += [f"activation_checkpointing.{k}" for k in ACTIVATION_CHECKPOINTING if section.get(k)]
    if unused:
        raise ConfigError(
            f"{WHERE}: {', '.join(unused)} configure DeepSpeed's activation checkpointing, which lit-hbp's layers do "
            "not use: a level's ckpt_layers and offload (data.levels) checkpoint and offload its layers; leave them out"
        )
    defaults = {k: p.default for k, p in inspect.signature(DeepSpeedStrategy.__init__).parameters.items()}
    defaults.update(stage=None, overlap_comm=None)  # HBPStrategy's own: any value given was asked for
    asked = [k for k, v in given.items() if v != defaults.get(k, v)]  # a parser passes every default: not asked
    if config is None and given.get("zero_optimization") is False:
        zero = [k for k in asked if k in BUILD_CONFIG and k not in (*AIO, "zero_optimization")]
        if zero:
            raise ConfigError(
                f"{WHERE}: {', '.join(f'{k}={given[k]!r}' for k in zero)} beside zero_optimization=False, which "
                "builds no ZeRO section (DeepSpeed trains stage 0, nothing offloaded): leave zero_optimization out "
                "to train as they say, or leave them out"
            )
    scaling = [k for k in asked if k in LOSS_SCALING]
    if scaling and "fp16" in (config or {}):
        raise ConfigError(
            f"{WHERE}: {', '.join(f'{k}={given[k]!r}' for k in scaling)} beside a DeepSpeed config with an fp16 "
            "section, which DeepSpeed trains as it says: set them in the section (or leave them out)"
        )
    if config is None:
        return
    if isinstance(config.get("zero_optimization"), bool):  # DeepSpeed reads true as stage 1 and the old top-level keys
        raise ConfigError(
            f"{WHERE}: the DeepSpeed config's zero_optimization: {str(config['zero_optimization']).lower()} is "
            "DeepSpeed's deprecated form: write the section, zero_optimization: {stage: 1} (true's) or {stage: 0}"
        )
    if "gradient_accumulation_steps" in config:  # Lightning's own refusal came as a traceback once the data was read
        raise ConfigError(
            f"{WHERE}: the DeepSpeed config's gradient_accumulation_steps ({config['gradient_accumulation_steps']!r}) "
            "is the trainer's to set: remove it and set trainer.accumulate_grad_batches"
        )
    for name in asked:
        value = given[name]
        if name not in BUILD_CONFIG:
            continue
        said = ARGUMENTS[name](config) if name in ARGUMENTS else None
        if name not in ARGUMENTS or value != said:
            where = f"whose zero_optimization says {said!r}" if name in ARGUMENTS else "(nothing is built from it)"
            raise ConfigError(
                f"{WHERE}: {name}={value!r} beside a DeepSpeed config {where}; DeepSpeed trains the config's, so set "
                f"it there (or leave {name} out)"
            )


def check_config_sections(config: dict | None, module_optimizes: bool) -> None:
    """A DeepSpeed config's ``optimizer`` section replaces the module's own optimizer and schedule (Lightning
    hands DeepSpeed none: ``model.lr``, ``warmup_steps``, the no-decay group were dropped); its ``scheduler``
    section is ignored beside the module's schedule. Refused where the module configures its optimizers."""
    sections = [k for k in ("optimizer", "scheduler") if k in (config or {})]
    if sections and module_optimizes:
        raise ConfigError(
            f"{WHERE}: the DeepSpeed config's {' and '.join(repr(s) for s in sections)} section would "
            f"{'replace' if 'optimizer' in sections else 'be ignored beside'} the module's own optimizer and "
            "learning-rate schedule (configure_optimizers: model.lr, weight_decay, betas, warmup_steps, "
            f"min_lr_ratio): remove {'it' if len(sections) == 1 else 'them'} and set those instead"
        )


def check_half_precision_stage(config: dict) -> None:
    """At ZeRO stage 0 DeepSpeed wraps a half-precision run's optimizer in its fp16/bf16 optimizer, which takes
    one AdamW step on zero gradients as it is built: the step count starts at 1 (every bias correction a step
    off) and the weights decay once before training (a bf16 run's weights 0.032 off a stage-1 run's after 4
    steps). Refused; stage 1 shards nothing on one device, HBPDDPStrategy runs no DeepSpeed."""
    half = [k for k in ("bf16", "fp16") if ((config or {}).get(k) or {}).get("enabled")]
    if half and deepspeed_zero(config)["zero_stage"] == 0:
        raise ConfigError(
            f"{WHERE}: ZeRO stage 0 with {half[0]} precision: DeepSpeed's {half[0]} optimizer wrapper steps AdamW "
            "once on zero gradients as it is built (the weights decay and the step count starts at 1 before "
            "training), so the run would not train as the module's optimizer says. Use stage 1 or 2, or "
            "strategy: hbp_ddp"
        )


def check_loss_scaling(given: dict[str, Any], precision: str) -> None:
    """fp16's loss-scaling arguments (``LOSS_SCALING``, non-default in ``given``) under a precision that is not
    fp16: Lightning writes them nowhere, so they would change nothing."""
    if given and not precision.startswith("16"):
        raise ConfigError(
            f"{WHERE}: {', '.join(f'{k}={v!r}' for k, v in given.items())} scale fp16's loss, and trainer.precision "
            f"is {precision!r}: they would change nothing; leave them out (or train with precision 16-mixed)"
        )


def loss_scaling_asked(given: dict[str, Any]) -> dict[str, Any]:
    """The loss-scaling arguments among ``given`` set otherwise than DeepSpeedStrategy's defaults."""
    defaults = inspect.signature(DeepSpeedStrategy.__init__).parameters
    return {k: v for k, v in given.items() if k in LOSS_SCALING and v != defaults[k].default}


def check_precision_sections(config: dict | None, precision: str) -> None:
    """A DeepSpeed config's ``bf16`` or ``fp16`` section decides the run's precision (Lightning writes the section of
    ``trainer.precision`` only where the config has none): ``bf16: {enabled: true}`` under ``32-true`` trained in
    bf16, ``bf16: {enabled: false}`` under ``bf16-mixed`` in fp32. One that says other than the trainer is refused."""
    wanted = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else None
    for kind in ("bf16", "fp16"):
        section = (config or {}).get(kind)
        if not isinstance(section, dict):
            continue
        enabled = section.get("enabled", False)  # DeepSpeed's default for both sections
        if not isinstance(enabled, bool):  # DeepSpeed reads the string "false" as false, Python's bool() as true
            raise ConfigError(f"{WHERE}: the DeepSpeed config's {kind}.enabled must be true or false, got {enabled!r}")
        if enabled != (kind == wanted):
            raise ConfigError(
                f"{WHERE}: the DeepSpeed config's {kind} section says enabled: {str(enabled).lower()} and "
                f"trainer.precision is {precision!r}, and DeepSpeed trains as the config says: make them agree, or "
                f"leave the {kind} section out (Lightning writes it from trainer.precision)"
            )


def check_clipping(user_clip: float | None, trainer_clip: float | None) -> None:
    """A DeepSpeed config's ``gradient_clipping`` wins over ``Trainer(gradient_clip_val)`` (Lightning fills it
    only when the config has none): both given and different is refused."""
    if user_clip is None or trainer_clip is None or float(user_clip) == float(trainer_clip):
        return
    raise ConfigError(
        f"{WHERE}: the DeepSpeed config's gradient_clipping {user_clip} and trainer.gradient_clip_val "
        f"{trainer_clip} differ, and DeepSpeed clips at the config's: give one of them"
    )


# Lightning's warning at DeepSpeed's set-up for any module that overrides configure_gradient_clipping.
CLIPPING_WARNING = "Since DeepSpeed handles gradient clipping internally"


@contextlib.contextmanager
def module_clipping_warning(module_type: type) -> Iterator[None]:
    """Lightning warns at DeepSpeed's set-up that a module's own ``configure_gradient_clipping`` "will not actually
    clip gradients". HBPLitModule's hands the clipping to DeepSpeed's step, at ``trainer.gradient_clip_val``
    (``check_clipping``), so for it the warning is wrong (it printed on every HBPStrategy run that clips) and is
    left out; any other module's own hook (a subclass's too) keeps it."""
    from lit_hbp.lightning.module import HBPLitModule  # here: the strategy also trains modules of one's own

    ours = getattr(module_type, "configure_gradient_clipping", None) is HBPLitModule.configure_gradient_clipping
    with warnings.catch_warnings():
        if ours:
            warnings.filterwarnings("ignore", message=CLIPPING_WARNING)
        yield


def with_run_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` (the caller's dict stays theirs: Lightning writes the run's settings into the one it
    holds) with what lit-hbp runs unless the config says otherwise: a micro-batch of one packed row (else Lightning
    infers it from a dataloader before the model exists); DeepSpeed's throughput timer off (it synchronizes the
    device in every forward and optimizer step; HBPThroughputMonitor times the steps without waiting); with the
    optimizer offloaded, a torch optimizer allowed (DeepSpeed refuses HBPLitModule's AdamW there unless told)."""
    config = copy.deepcopy(config)
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.setdefault("timers", {"throughput": {"enabled": False, "synchronized": False}})
    if deepspeed_zero(config)["optimizer_offload"]:
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    return config


def without_idle_overlap(config: dict[str, Any], world_size: int, asked: bool) -> dict[str, Any]:
    """``config`` with ZeRO's ``overlap_comm`` off in a world of one process, unless ``asked``: it
    overlaps the gradient reduction with the backward, and one process reduces nothing, while ZeRO's
    gradient epilogue still synchronizes the device for it (after every backward under ZeRO-2)."""
    zero = config.get("zero_optimization")
    if asked or world_size > 1 or not isinstance(zero, dict):
        return config
    return {**config, "zero_optimization": {**zero, "overlap_comm": False}}


def without_overflow_check(config: dict[str, Any], asked: bool) -> dict[str, Any]:
    """``config`` with DeepSpeed's bf16 gradient-overflow check off, unless ``asked``: bf16 has no loss
    scale to adjust, and the check reads an overflow flag and the gradient norm's finiteness on the
    host at every optimizer step (two device syncs). Without it a non-finite gradient is not skipped
    but shows in the logged loss, as in torch's, Megatron's and Hugging Face Trainer's bf16 training."""
    bf16 = config.get("bf16")
    if asked or not isinstance(bf16, dict) or not bf16.get("enabled"):
        return config
    return {**config, "bf16": {**bf16, "check_grad_overflow": False}}


def overflow_note(config: dict[str, Any], asked: bool) -> str:
    """Said at set-up where ``without_overflow_check`` turned DeepSpeed's default off: a plain
    DeepSpeedStrategy run would skip a step whose gradients are not finite; this one applies it."""
    bf16 = config.get("bf16")
    if asked or not isinstance(bf16, dict) or not bf16.get("enabled"):
        return ""
    return (
        "; bf16 steps with non-finite gradients are applied, not skipped (DeepSpeed's check_grad_overflow off: "
        "it reads the device twice a step; a DeepSpeed config with bf16.check_grad_overflow: true turns it on)"
    )


def sharding_note(world_size: int, zero: Settings) -> str:
    """What DeepSpeed shards here, said where it shards nothing: its step then only costs the host more than
    HBPDDPStrategy's (per-parameter hooks, flat gradient copies, waits for the device: docs/gpu.md), unless it
    offloads to the host, which only DeepSpeed does."""
    if zero.optimizer_offload or zero.param_offload or (world_size > 1 and zero.zero_stage > 0):
        return ""
    where = "one process" if world_size == 1 else "stage 0"
    return (
        f" ({where}: nothing sharded; --trainer.strategy hbp_ddp trains the same levels with a lighter step, "
        "docs/gpu.md)"
    )


def put_back_torch_linear(before: Callable | None) -> None:
    """DeepSpeed's ``zero.Init`` (a ZeRO-3 run's model construction, and transformers' ``from_pretrained`` under it)
    replaces ``torch.nn.functional.linear`` for the whole process with its memory-efficient one, which the run needs,
    and never puts it back ("This will persist unless manually reset"): every model the process ran after the run
    went through DeepSpeed's linear (under autocast it keeps the fp32 weights for the backward, where torch keeps a
    bf16 copy: other memory, another graph). Put back to what the run found, unless another hand replaced it."""
    now = torch.nn.functional.linear
    if before is not None and now is not before and getattr(now, "__module__", "").startswith("deepspeed"):
        torch.nn.functional.linear = before
