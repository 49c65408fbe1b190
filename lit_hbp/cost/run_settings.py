"""A run's settings, read once: the cost model they price, and which of them set-up accepts together.

Every tool that plans a run or refuses one reads it here: the level search and its refusals
(``autoselect.levers``), ``python -m lit_hbp.cost.memory``, both selectors, the simulator, ``PackingMetrics``'
timeline and the set-up checks of ``HBPLitModule`` and ``HBPStrategy``. ``Settings`` is what a run's memory
depends on beyond its model; ``cost_model`` prices it; ``RULES`` says which settings set-up refuses and
with what; a ``Tool`` spells a setting the way one command line (or a training config) takes it. So what a
refusal advises is a flag of the tool that printed it, and what set-up then accepts.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE, Hardware
from lit_hbp.errors import ConfigError
from lit_hbp.model_spec import ModelSpec


@dataclass(frozen=True)
class Settings:
    """What a run's memory depends on beyond its model, under the names ``CostModel`` gives them.

    world: ranks. hardware: the GPU kind (a ``HARDWARE`` preset) or the device a measured search runs on.
    zero_stage: DeepSpeed's ZeRO stage (``HBPStrategy``'s default 2; 0 without DeepSpeed: DDP, one device).
    optimizer_offload / param_offload: DeepSpeed's ``offload_optimizer`` / ``offload_param`` to the host.
    liger: Liger's RMSNorm, SwiGLU and fused loss (``model.liger``). trainable: the share of the parameters
    trained (1; under LoRA its adapters' and copies' share, counted: ``param_counts.lora_settings``). added_params:
    the parameters the run adds to the model's (LoRA's). dtype_bytes: the precision's bytes per parameter and
    activation (bf16 where no precision is known). ce_chunk: the loss's chunk (``HBPLitModule``'s
    ``ce_chunk_size``). vision_trained: a vision-language model's tower trains (not under ``freeze_vision`` or
    LoRA). lora_whole: the LoRA setting that reads adapted weights whole (``CostModel.lora_whole``). compiled: its
    decoder layers run compiled (``HBPLitModule(compile=True)``). autocast: a ``*-mixed``
    precision without DeepSpeed (fp32 parameters, the layers under autocast: ``CostModel.autocast``). deepspeed:
    DeepSpeed steps the optimizer (False: torch's AdamW over the parameters, ``CostModel.deepspeed``)."""

    world: int = 1
    hardware: Hardware = HARDWARE["h100"]
    zero_stage: int = 2
    optimizer_offload: bool = False
    param_offload: bool = False
    liger: bool = False
    trainable: float = 1.0
    added_params: float = 0.0
    dtype_bytes: int = 2
    ce_chunk: int = 1024
    vision_trained: bool = True
    lora_whole: str = ""
    compiled: bool = False
    autocast: bool = False
    deepspeed: bool = True


def cost_model(spec: ModelSpec, settings: Settings, sp_kind: str = "ulysses") -> CostModel:
    """The cost model of a run: every field of ``settings`` is the cost model's own (a lever applied to one
    is applied to the other with ``dataclasses.replace``); ``sp_kind`` prices levels with sp > 1."""
    return CostModel(spec, sp_kind=sp_kind, **{f.name: getattr(settings, f.name) for f in fields(Settings)})


# ------------------------------------------------------------------------------------------ reading a run


def deepspeed_zero(config: dict | None) -> dict:
    """``zero_stage``, ``optimizer_offload`` and ``param_offload`` of a DeepSpeed config as DeepSpeed reads
    it: no ``zero_optimization`` section, or one without a stage, is stage 0; an offload counts where its
    device is not ``none``, or where DeepSpeed's older key (``cpu_offload``, ``cpu_offload_param``) is true."""
    zero = (config or {}).get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {"stage": 1} if zero is True else {}  # true: DeepSpeed's old stage 1

    def offloaded(key: str, older: str) -> bool:
        if zero.get(older) is not None:  # DeepSpeed reads it as an offload to the CPU (both given: it refuses)
            return bool(zero[older])
        return str((zero.get(key) or {}).get("device") or "none") != "none"

    return dict(
        zero_stage=int(zero.get("stage", 0)),
        optimizer_offload=offloaded("offload_optimizer", "cpu_offload"),
        param_offload=offloaded("offload_param", "cpu_offload_param"),
    )


def strategy_config(args: dict) -> dict:
    """The DeepSpeed config ``HBPStrategy(**args)`` trains with: its ``config`` (a mapping or a JSON file;
    Lightning then reads no ``stage`` nor offload argument), else the one Lightning builds from ``stage``
    (default 2) and ``offload_optimizer`` / ``offload_parameters``."""
    config = args.get("config")
    if isinstance(config, (str, Path)):
        return json.loads(Path(config).read_text())
    if config is not None:
        return config
    if args.get("zero_optimization") is False:  # no ZeRO section: stage 0 (stage and offloads refused beside it)
        return {}
    stage = args.get("stage")  # None: HBPStrategy's default
    zero: dict[str, Any] = {"stage": 2 if stage is None else int(stage)}
    if args.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": args.get("offload_optimizer_device", "cpu")}
    if args.get("offload_parameters"):
        zero["offload_param"] = {"device": args.get("offload_params_device", "cpu")}
    return {"zero_optimization": zero}


def with_zero(args: dict | None, zero_stage: int | None = None, optimizer_offload: bool = False) -> dict | None:
    """``HBPStrategy`` arguments ``args`` at ``zero_stage`` and/or with the Adam states on the host, written
    into their DeepSpeed ``config`` where they have one (Lightning reads nothing else then); a run without
    DeepSpeed (``args`` None) stays one unless a lever asks for DeepSpeed's."""
    if args is None and zero_stage is None and not optimizer_offload:
        return None
    args = copy.deepcopy(args or {})
    if args.get("config") is None:
        if zero_stage is not None:
            args["stage"] = zero_stage
        if optimizer_offload:
            args["offload_optimizer"] = True
        return args
    config = copy.deepcopy(strategy_config(args))
    zero = config.setdefault("zero_optimization", {})
    if zero_stage is not None:
        zero["stage"] = zero_stage
    if optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {**args, "config": config}


REGISTERED = re.compile(r"(hbp|deepspeed)(?:_stage_(\d))?(_offload)?(_nvme)?")
"""The registered names of DeepSpeed strategies: hbp, hbp_stage_N, deepspeed, deepspeed_stage_N[_offload[_nvme]]."""


def config_strategy(strategy: Any) -> dict | None:
    """The ``HBPStrategy`` arguments of a training config's ``trainer.strategy`` (a class_path entry or a
    registered name), None for a strategy without DeepSpeed (ddp, auto, none)."""
    if isinstance(strategy, dict):
        if not str(strategy.get("class_path", "")).endswith(("HBPStrategy", "DeepSpeedStrategy")):
            return None
        return {k: v for k, v in (strategy.get("init_args") or {}).items() if k != "levels" and v is not None}
    match = REGISTERED.fullmatch(str(strategy))
    if match is None:
        return None
    _, stage, offload, nvme = match.groups()
    args: dict[str, Any] = {} if stage is None else {"stage": int(stage)}
    if offload:  # Lightning's deepspeed_stage_2_offload, deepspeed_stage_3_offload[_nvme]
        args["offload_optimizer"] = True
        if stage == "3":
            args["offload_parameters"] = True
        if nvme:
            args.update(offload_optimizer_device="nvme", offload_params_device="nvme")
    return args


PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's short precision names and what it takes them for."""


def check_deepspeed_precision(precision: str) -> None:
    """A precision DeepSpeed cannot train in (``64-true``), refused by Lightning's DeepSpeed plugin itself, as
    the fit's set-up refuses it (the command line before anything spawns; the memory command rather than price a
    run that never starts)."""
    from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

    try:
        DeepSpeedPrecision(PRECISION_ALIASES.get(precision, precision))
    except ValueError:
        raise ConfigError(
            f"trainer.precision: {precision!r} is not one DeepSpeed trains in (trainer.strategy): use 32-true or "
            "bf16-mixed, or trainer.strategy hbp_ddp"
        ) from None


def precision_bytes(precision: Any) -> int:
    """Bytes per parameter and activation of a Lightning precision (``64-true``, ``32-true``, ``bf16-mixed``...)."""
    name = str(precision)
    return 8 if name.startswith("64") else 4 if name.startswith("32") else 2


def autocast_of(precision: Any, deepspeed: bool) -> bool:
    """Whether a Lightning precision keeps fp32 parameters under autocast: ``*-mixed`` without DeepSpeed (whose
    bf16 holds the parameters in bf16)."""
    return str(precision).endswith("-mixed") and precision_bytes(precision) < 4 and not deepspeed


def settings_of(
    hardware: Hardware,
    world: int,
    strategy_args: dict | None,
    model_args: dict,
    precision: Any = None,
    spec: ModelSpec | None = None,
) -> Settings:
    """A run from its parts: ``HBPStrategy`` arguments (None: no DeepSpeed), the module's arguments (liger,
    lora, ce_chunk_size, freeze_vision, compile), its Lightning precision (None: bf16) and the model priced
    (``spec``: a LoRA run's adapters are counted on it, ``param_counts.lora_settings``; a ConfigError where
    they cannot be)."""
    zero = deepspeed_zero(None if strategy_args is None else strategy_config(strategy_args))
    lora = model_args.get("lora")
    trained: dict = {}
    if lora:
        from lit_hbp.model.build import lora_reads_whole
        from lit_hbp.model.param_counts import lora_settings

        if spec is None:
            raise ValueError("settings_of: a LoRA run's trained parameters are counted on its model: give spec")
        trained = {**lora_settings(spec, lora), "lora_whole": (lora_reads_whole(lora) or ("",))[0]}
    return Settings(
        world,
        hardware,
        **zero,
        liger=bool(model_args.get("liger", False)),
        **trained,
        dtype_bytes=Settings.dtype_bytes if precision is None else precision_bytes(precision),
        ce_chunk=int(model_args.get("ce_chunk_size", Settings.ce_chunk)),
        vision_trained=not (model_args.get("freeze_vision") or model_args.get("lora")),
        compiled=bool(model_args.get("compile", False)),
        autocast=precision is not None and autocast_of(precision, strategy_args is not None),
        deepspeed=strategy_args is not None,
    )


def config_settings(config: dict, hardware: Hardware, world: int, spec: ModelSpec | None = None) -> Settings:
    """The run a training config (``lit_hbp.cost.config.read_config``) describes, on ``world`` GPUs of ``hardware``:
    its strategy, its model's liger, lora (counted on ``spec``, the model priced) and ce_chunk_size, and its
    precision (Lightning's 32-true if none)."""
    trainer = config.get("trainer") or {}
    strategy = config_strategy(trainer.get("strategy"))
    model = config.get("model") or {}
    return settings_of(hardware, world, strategy, model, trainer.get("precision", "32-true"), spec)


def trainer_settings(trainer: Any, hardware: Hardware, **given: Any) -> Settings:
    """The run a Lightning trainer sets up: its world, precision and strategy's DeepSpeed config (none:
    ZeRO stage 0), and what the caller knows better (``given``: liger, trainable, dtype_bytes, ce_chunk...)."""
    config = getattr(trainer.strategy, "config", None)
    zero = deepspeed_zero(config)
    read = dict(world=trainer.world_size, hardware=hardware, dtype_bytes=precision_bytes(trainer.precision), **zero)
    read["autocast"] = autocast_of(trainer.precision, config is not None)
    read["deepspeed"] = config is not None
    return Settings(**{**read, **given})


def local_hardware(device: Any, capacity: float | None = None, devices: int = 1) -> Hardware:
    """The device this process trains on, as it reports itself: a CUDA GPU's name and total memory (with its
    kind's FLOP/s and links where ``HARDWARE`` knows the kind), or a CPU; ``capacity`` in place of the
    device's memory (a user's ``memory_gib``), ``devices`` per node, and the host's memory. It prices a
    measured search's refusal and ``fit``'s memory check on the GPU that runs them."""
    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 0.0
    if device.type != "cuda":  # the host's memory is the device's
        memory = host if capacity is None else capacity
        kind = device.type
        return Hardware(kind.upper(), 0.0, memory, 0.0, 0.0, devices, host_memory_bytes=host, accelerator=kind)
    import torch

    name = torch.cuda.get_device_name(device)
    memory = float(torch.cuda.get_device_properties(device).total_memory) if capacity is None else capacity
    kind = next((hw for key, hw in HARDWARE.items() if key in name.lower()), Hardware(name, 0.0, memory, 0.0, 0.0))
    return replace(kind, name=name, memory_bytes=memory, gpus_per_node=devices, host_memory_bytes=host)


def describe(run: Settings | CostModel) -> str:
    """``ZeRO-2 + optimizer offload, Liger, bf16`` (``bf16 autocast over fp32 parameters`` under a ``*-mixed``
    precision without DeepSpeed): a run's settings in a header line."""
    offloads = (" + optimizer offload" if run.optimizer_offload else "") + (
        " + parameter offload" if run.param_offload else ""
    )
    extras = (", Liger" if run.liger else "") + (", LoRA" if run.added_params or run.trainable < 1 else "")
    dtype = {2: "bf16", 4: "fp32", 8: "fp64"}.get(run.dtype_bytes, f"{run.dtype_bytes}-byte")
    if run.autocast:
        dtype += " autocast over fp32 parameters"
    return f"ZeRO-{run.zero_stage}{offloads}{extras}, {dtype}"


# ------------------------------------------------------------------------ what set-up accepts, and spelling


class Run(Protocol):
    """What the rules read of a run: a ``Settings`` or a ``CostModel``."""

    zero_stage: int
    hardware: Hardware


@dataclass(frozen=True)
class Rule:
    """Set-up refuses ``setting`` on a run where ``allowed`` is False: it ``needs`` that (the run has ``now``),
    because ``why``; any one of ``fixes`` (settings and values) makes the run acceptable."""

    setting: str
    allowed: Callable[[Run], bool]
    needs: str
    now: Callable[[Run], str]
    why: str
    fixes: tuple[tuple[str, Any], ...]


def _stage(run: Run) -> str:
    return str(run.zero_stage)


RULES = (
    Rule(
        "zero_stage",
        lambda run: run.zero_stage < 3 or not getattr(getattr(run, "model", None), "mixing", 0),
        "a model without stateful token mixers",
        lambda run: "a hybrid's",
        "ZeRO-3 gathers a module's weights only where it is called as a module, and transformers' mixers read their "
        "convolution's weight directly: the strategy refuses it, mixers.ZERO3_REFUSAL",
        (("zero_stage", 2),),
    ),
    Rule(
        "zero_stage",
        lambda run: run.zero_stage < 3 or not getattr(run, "vision_patches_per_token", 0),
        "text-only data",
        lambda run: "samples with images or videos",
        "ZeRO-3 gathers a module's weights when its forward runs, and the vision tower runs only on ranks whose pack "
        "holds images: HBPLitModule refuses it",
        (("zero_stage", 2),),
    ),
    Rule(
        "zero_stage",
        lambda run: run.zero_stage < 3 or not getattr(run, "lora_whole", ""),
        "LoRA settings that leave the adapted weights partitioned",
        lambda run: f"model.lora.{run.lora_whole}",
        "peft reads each adapted weight whole for it, which ZeRO-3 partitions: HBPLitModule refuses it",
        (("zero_stage", 2),),
    ),
    Rule(
        "optimizer_offload",
        lambda run: run.zero_stage >= 1,
        "ZeRO stage 1-3",
        _stage,
        "without ZeRO DeepSpeed keeps the Adam states on the device: only ZeRO's optimizers read offload_optimizer",
        (("zero_stage", 2), ("optimizer_offload", False)),
    ),
    Rule(
        "param_offload",
        lambda run: run.zero_stage == 3,
        "ZeRO stage 3",
        _stage,
        "only ZeRO-3 partitions the parameters, and only its partitions are offloaded",
        (("zero_stage", 3), ("param_offload", False)),
    ),
    Rule(
        "liger",
        lambda run: run.zero_stage < 3,
        "ZeRO stage 0-2",
        _stage,
        "Liger's fused linear cross-entropy reads the LM head's weight whole, which ZeRO-3 partitions",
        (("zero_stage", 2), ("liger", False)),
    ),
    Rule(
        "liger",
        lambda run: run.hardware.accelerator == "cuda",
        "a CUDA GPU",
        lambda run: run.hardware.accelerator,
        "Liger's kernels are Triton kernels",
        (("liger", False),),
    ),
    Rule(
        "mlp_tiles",
        lambda run: getattr(getattr(run, "model", None), "mlp_values", None) is None,
        "token-wise MLPs",
        lambda run: "a mixture of experts",
        "a tiled MoE block would split its router's logits over the tiles (the packed call refuses it)",
        (("mlp_tiles", 1),),
    ),
    Rule(
        "mlp_tiles",
        lambda run: run.zero_stage < 3,
        "ZeRO stage 0-2",
        _stage,
        "a tiled MLP's backward reads the MLP's weights whole, which ZeRO-3 partitions",
        (("zero_stage", 2), ("mlp_tiles", 1)),
    ),
)
"""Which setting set-up accepts with which: ``HBPStrategy`` and ``HBPLitModule`` refuse what a rule refuses,
and the level search advises nothing a rule refuses."""


@dataclass(frozen=True)
class Tool:
    """How a command line, or a training config, spells the settings a refusal names, so that what it prints
    is what that tool takes. ``flags`` maps a setting to a template: ``{}`` takes the value, a bare flag
    turns the setting on; a setting the tool has no flag for is spelled as a training config has it."""

    flags: dict[str, str]

    def spell(self, setting: str, value: Any = True) -> str:
        template = self.flags.get(setting) or CONFIG.flags[setting]
        if "{}" in template:
            return template.format(str(value).lower() if isinstance(value, bool) else value)
        return template if value else f"without {template}"

    def with_config_words(self, settings: list[str]) -> Tool:
        """This tool, spelling ``settings`` as a training config does: switches a config turned on, which the
        tool's flags (that only turn them on) can neither name nor turn off."""
        return Tool({k: v for k, v in self.flags.items() if k not in settings})

    def spell_all(self, changes: dict[str, Any]) -> str:
        """Several settings: flags side by side (``--liger --zero-stage 2``), config keys in a list."""
        spelled = [self.spell(s, v) for s, v in changes.items()]
        return (" " if all(w.startswith("-") for w in spelled) else ", ").join(spelled)


CONFIG = Tool(
    {
        "liger": "model.liger: {}",
        "optimizer_offload": "HBPStrategy offload_optimizer: {}",
        "param_offload": "HBPStrategy offload_parameters: {}",
        "zero_stage": "HBPStrategy stage: {}",
        "mlp_tiles": "mlp_tiles: {}",
        "world": "trainer.devices x trainer.num_nodes = {}",
        "max_len": "the selector's max_len: {}",
        "margin": "the selector's margin_gib: {}",
        "analytic": "data.levels: lit_hbp.autoselect.AnalyticSelector",
    }
)
"""A training config's words: a selector's refusal inside a fit, set-up's refusals."""

_COMMAND = {"liger": "--liger", "optimizer_offload": "--offload-optimizer", "zero_stage": "--zero-stage {}",
            "margin": "--margin-gib {}"}  # fmt: skip
SIMULATE = Tool({**_COMMAND, "world": "--gpus {}", "max_len": "--max-len {}"})
"""``python -m lit_hbp.simulate``."""
ANALYTIC = Tool({**_COMMAND, "world": "--gpus {}", "max_len": "--max-len {}"})
"""``python -m lit_hbp.autoselect --analytic``."""
MEASURED = Tool({**_COMMAND, "world": "--devices {}", "max_len": "--max-len {}", "analytic": "--analytic"})
"""``python -m lit_hbp.autoselect --measured``."""


SWITCHES = ("liger", "optimizer_offload")
"""The run's switches a refusal may advise turning on (beside a higher ZeRO stage, more GPUs, a shorter level)."""


def config_switches(strategy_args: dict | None, model_args: dict, flags: dict[str, bool]) -> list[str]:
    """The switches (``SWITCHES``) a training config turns on itself, of those its tool's ``flags`` do not."""
    zero = deepspeed_zero(None if strategy_args is None else strategy_config(strategy_args))
    on = {"liger": bool(model_args.get("liger")), "optimizer_offload": bool(zero["optimizer_offload"])}
    return [s for s in SWITCHES if on[s] and not flags.get(s)]


def refusal(setting: str, run: Run, tool: Tool = CONFIG, value: Any = True) -> str | None:
    """Why set-up refuses ``setting`` at ``value`` on ``run``, in ``tool``'s words, or None when it accepts it."""
    rule = next((r for r in RULES if r.setting == setting and not r.allowed(run)), None)
    if rule is None:
        return None
    fixes = " or ".join(tool.spell(s, v) for s, v in rule.fixes)
    return f"{tool.spell(setting, value)} needs {rule.needs}, not {rule.now(run)} ({rule.why}): use {fixes}"


def problems(run: Settings | CostModel, tool: Tool = CONFIG, tiles: int = 1) -> list[str]:
    """What set-up refuses of ``run`` (and of MLP tiles of ``tiles``), in ``tool``'s words."""
    on = [(s, True) for s in ("liger", "optimizer_offload", "param_offload") if getattr(run, s)]
    on += [("mlp_tiles", tiles)] if tiles > 1 else []
    on += [("zero_stage", run.zero_stage)] if run.zero_stage == 3 else []
    return [why for s, value in on if (why := refusal(s, run, tool, value)) is not None]


def check(run: Settings | CostModel, tool: Tool = CONFIG, tiles: int = 1) -> None:
    """Refuse a run set-up would refuse (``problems``), with the first reason."""
    found = problems(run, tool, tiles)
    if found:
        raise ValueError(found[0])
