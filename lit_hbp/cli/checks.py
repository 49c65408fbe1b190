"""A training config's checks before anything is built or spawned (``check_run_config``: the model's,
from ``lit_hbp.model.checks``, the levels against the world and the model's heads, the curriculum
against the levels), and the compact resolved config printed after set-up.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_hbp.cli.launch import check_launcher, world_size_of
from lit_hbp.cost.run_settings import check_deepspeed_precision
from lit_hbp.errors import ConfigError, did_you_mean
from lit_hbp.model.checks import check_model_config, check_model_source, model_config


def check_sp_setup(levels: Sequence[Any], world_size: int, model: Any) -> None:
    """The levels against the world (every sp divides it) and, when they use sequence parallelism and
    the model's shape is known, against its attention heads and layers: HBPStrategy's own checks at
    setup, run from the config alone."""
    from lit_hbp.packing.levels import as_level, validate_levels

    levels = validate_levels([as_level(x, f"data.levels[{i}]") for i, x in enumerate(levels)], world_size)
    if all(lv.sp == 1 for lv in levels):
        return
    config = model_config(model)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(heads, int) or not isinstance(layers, int):
        return
    from lit_hbp.parallel.kind import validate_sp_setup

    validate_sp_setup(levels, world_size, heads, getattr(config, "num_key_value_heads", None) or heads, layers)


def check_curriculum(levels: Sequence[Any], callbacks: Any) -> None:
    """An ``HBPCurriculum`` among the trainer's callbacks whose ``short_levels`` name a pack length the
    levels do not have (``--data.levels`` given without it) is refused now, naming both."""
    from lit_hbp.packing.levels import as_level

    try:
        lengths = sorted(as_level(x, f"data.levels[{i}]").pack_len for i, x in enumerate(levels))
    except (ValueError, TypeError):
        return  # the levels' own error comes where they are checked
    from lit_hbp.callbacks.curriculum import HBPCurriculum

    for i, entry in enumerate(callbacks if isinstance(callbacks, list) else []):
        if not isinstance(entry, Mapping) or not is_instance_entry(entry, HBPCurriculum):
            continue
        short = (entry.get("init_args") or {}).get("short_levels")
        for x in short if isinstance(short, list) else []:
            try:
                length = as_level(x).pack_len
            except (ValueError, TypeError):
                continue
            if length not in lengths:
                raise ConfigError(
                    f"trainer.callbacks[{i}] (HBPCurriculum) short_levels: {x!r} is not the pack_len of a level of "
                    f"data.levels ({lengths}): name levels the data has, or leave short_levels out (every level "
                    "without sp but the largest)"
                )


def check_run_config(config: Mapping[str, Any], trains: bool = True) -> None:
    """What a LightningCLI config (the subcommand's section, as plain data) shows wrong before any
    process spawns: the model (its folder, or the mapping's keys), the levels against the world size
    and the model's heads."""
    data = config.get("data") or {}
    if data.get("demo_dir") and data.get("demo", "text") != "text":  # the demo's checkpoint folder is the model
        from lit_hbp.demo import ensure_kind

        ensure_kind(data["demo_dir"], data["demo"])
    check_launcher(config.get("trainer") or {})
    if trains:
        check_monitored_validation(config)
    model = (config.get("model") or {}).get("model")
    check_model_source(model)
    if isinstance(model, Mapping):
        check_model_config(model)
    levels = (config.get("data") or {}).get("levels")
    if not isinstance(levels, list) or not levels:  # a LevelSelector: chosen at setup
        return
    if trains:
        check_curriculum(levels, (config.get("trainer") or {}).get("callbacks"))
    world = world_size_of(config.get("trainer") or {})
    if world is not None:
        check_sp_setup(levels, world, model)


# Trainer arguments whose values need this machine's hardware or a built object to check: the probe in
# check_trainer_values leaves them to the trainer the run builds.
UNPROBED = ("accelerator", "devices", "strategy", "precision", "plugins", "callbacks", "logger", "profiler")
# Values Lightning's Trainer takes but a run cannot: key -> (accepted?, what is accepted, what happens otherwise).
RUN_RULES = {
    "accumulate_grad_batches": (
        lambda v: isinstance(v, int) and v >= 1,
        "a whole number >= 1",
        "the plan of micro-batches per optimizer step needs at least one",
    ),
    "overfit_batches": (
        lambda v: v == 0,
        "0 (use limit_train_batches to train on a few batches)",
        "Lightning would swap HBPDataModule's planned loader for a sequential one of the first batches, which the "
        "plan of packs, levels and ranks cannot be",
    ),
    "gradient_clip_val": (
        lambda v: v is None or v >= 0,
        "a number >= 0, or null for no clipping",
        "Lightning clips nothing at a value <= 0, so a negative one is a mistyped norm (null or 0: no clipping)",
    ),
    "val_check_interval": (
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
        "a number of micro-batches >= 1 or a share of the epoch > 0, or null",
        "Lightning divides by it after the first micro-batch trained",
    ),
    "log_every_n_steps": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        "a whole number >= 0 (0: never)",
        "Lightning logs every step at a negative one",
    ),
}


def strategy_registry():
    """Lightning's strategy registry, lit-hbp's names (hbp, hbp_stage_N, hbp_ddp) registered in it."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lit_hbp.lightning.strategy  # noqa: F401  (registers them)

    return StrategyRegistry


def is_deepspeed(value: Any) -> bool:
    """Whether ``trainer.strategy`` (a registered name or a class_path mapping) is a DeepSpeed strategy, which
    saves and loads a checkpoint folder (lit-hbp's HBPStrategy is one, HBPDDPStrategy is not): the class
    itself is asked, not its name."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if hasattr(value, "get"):
        return is_instance_entry(value, DeepSpeedStrategy)  # a class that does not import: Lightning names it
    entry = dict.get(strategy_registry(), str(value))  # (the registry's own get() builds the strategy)
    chosen = entry["strategy"] if entry else None
    return isinstance(chosen, type) and issubclass(chosen, DeepSpeedStrategy)


def check_strategy_name(strategy: Any) -> None:
    """A ``trainer.strategy`` given as a name must be one Lightning knows (``auto`` or registered: ``ddp``,
    ``hbp``, ``hbp_ddp``, ...); a class is given as ``{class_path: ...}``. Lightning would refuse an unknown one
    with a traceback after the data is tokenized."""
    registry = strategy_registry()
    if not isinstance(strategy, str) or strategy == "auto" or strategy in registry:
        return
    names = ["auto", *registry.available_strategies()]
    if "." in strategy:
        raise ConfigError(
            f"trainer.strategy: {strategy!r} is not a strategy name; a class is given as "
            f"{{class_path: {strategy}}} (on the command line: --trainer.strategy.class_path {strategy})"
        )
    raise ConfigError(
        f"trainer.strategy: {strategy!r} is not a strategy Lightning knows{did_you_mean(strategy, names)}; lit-hbp's "
        "are hbp (DeepSpeed, ZeRO stage 2), hbp_stage_N and hbp_ddp (docs/gpu.md)"
    )


def class_of(entry: Any) -> type | None:
    """The class a config entry names (``class_path``, in a mapping or a parsed namespace), or an object's own
    type; None when the path does not import (the run's own parse names it). Entries are asked by class, so a
    subclass (a user's own ``ModelCheckpoint``) counts as what it extends."""
    path = entry.get("class_path") if isinstance(entry, (Mapping, argparse.Namespace)) else None
    if path is None:
        return None if isinstance(entry, (Mapping, argparse.Namespace)) else type(entry)
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        return None


def is_instance_entry(entry: Any, base: type) -> bool:
    """Whether a config entry (``class_path`` or an object) is ``base`` or a subclass of it."""
    kind = class_of(entry)
    return isinstance(kind, type) and issubclass(kind, base)


def check_no_checkpoint_callback(callbacks: Any, switch: str = "") -> None:
    """``enable_checkpointing: false`` (or ``barebones: true``, ``switch``) beside a ``ModelCheckpoint`` among the
    callbacks (a config's, turned off on the command line): Lightning refuses the pair when it builds the trainer,
    after the data is read; refused now, naming the callback."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    switch = switch or "enable_checkpointing: false"
    for i, entry in enumerate(_entries(callbacks)):
        kind = class_of(entry)
        if isinstance(kind, type) and issubclass(kind, ModelCheckpoint):
            raise ConfigError(
                f"trainer.{switch} beside trainer.callbacks[{i}] ({kind.__name__}), which saves checkpoints: drop "
                f"that callback to save none, or leave checkpointing on"
            )


def check_logging_callbacks(trainer: Any) -> None:
    """A fit without a logger (``logger: false``, ``logger: []`` or ``barebones: true``) beside a Lightning callback
    that refuses to run without one (Lightning 2.6: ``LearningRateMonitor`` at the fit's start, ``DeviceStatsMonitor``
    at its set-up; both run in a validate), raised after the data is read and the model built; refused now."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor

    logger, barebones = (trainer or {}).get("logger"), (trainer or {}).get("barebones") is True
    if not barebones and logger is not False and not (isinstance(logger, list) and not logger):
        return
    switch = "barebones: true" if barebones else f"logger: {'false' if logger is False else '[]'}"
    for i, entry in enumerate(_entries((trainer or {}).get("callbacks"))):
        kind = class_of(entry)
        if isinstance(kind, type) and issubclass(kind, (LearningRateMonitor, DeviceStatsMonitor)):
            raise ConfigError(
                f"trainer.callbacks[{i}] ({kind.__name__}) writes to the trainer's logger, and trainer.{switch} sets "
                f"none (Lightning refuses the pair when the fit starts): remove trainer.{switch} or the callback"
            )


def _entries(callbacks: Any) -> list:
    return callbacks if isinstance(callbacks, list) else [callbacks] if callbacks else []


def step_callbacks(callbacks: Any) -> list:
    """The config's ``ModelCheckpoint`` and ``GradientAccumulationScheduler`` entries built (those whose
    arguments do not build are left to the run's own parse): what the probe ``Trainer`` needs to say where a
    run's checkpoints fall against its optimizer steps (``plan_checks.check_checkpoint_positions``)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

    built = []
    for entry in _entries(callbacks):
        kind = class_of(entry)
        if not (isinstance(kind, type) and issubclass(kind, (ModelCheckpoint, GradientAccumulationScheduler))):
            continue
        if not isinstance(entry, (Mapping, argparse.Namespace)):
            built.append(entry)
            continue
        args = entry.get("init_args") or {}
        try:
            built.append(kind(**(vars(args) if isinstance(args, argparse.Namespace) else dict(args))))
        except (TypeError, ValueError, MisconfigurationException):
            continue
    return built


def check_fixed_accumulation(callbacks: Any) -> None:
    """A ``GradientAccumulationScheduler`` under DeepSpeed, whose engine takes one accumulation for the run:
    Lightning refuses it when training starts, after the data is read; refused now. So is a ``WeightAveraging``,
    whose average a DeepSpeed checkpoint never holds (``checkpoints.AVERAGED_UNDER_DEEPSPEED``)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, WeightAveraging

    from lit_hbp.lightning.checkpoints import AVERAGED_UNDER_DEEPSPEED

    for i, entry in enumerate(_entries(callbacks)):
        kind = class_of(entry)
        if isinstance(kind, type) and issubclass(kind, GradientAccumulationScheduler):
            raise ConfigError(
                f"trainer.callbacks[{i}] ({kind.__name__}) under DeepSpeed (trainer.strategy), whose engine takes one "
                "accumulate_grad_batches for the whole run: set trainer.accumulate_grad_batches, or train with "
                "trainer.strategy hbp_ddp"
            )
        if isinstance(kind, type) and issubclass(kind, WeightAveraging):
            raise ConfigError(f"trainer.callbacks[{i}] ({kind.__name__}) {AVERAGED_UNDER_DEEPSPEED}")


def check_refused_callbacks(callbacks: Any) -> None:
    """A callback HBPLitModule cannot serve in a fit among the config's (``lightning.refused_callbacks``; the
    command line's model is built in ``configure_model``): refused before the data is read."""
    from lit_hbp.lightning.refused_callbacks import refusals

    kinds = [k if isinstance(k := class_of(entry), type) else object for entry in _entries(callbacks)]
    for i, kind, why in refusals(kinds):
        raise ConfigError(f"trainer.callbacks[{i}] ({kind.__name__}): {why}")


# What HBPLitModule and lit-hbp's callbacks log under a fixed name: a monitor a separator away from one is a typo
# Lightning finds only when the first validation (or epoch) ends.
LOGGED = ("train/loss", "train/grad_norm", "train/lr", "val/loss", "val/ppl", "packing/level",
          "packing/cp_area_imbalance", "curriculum/warmup")  # fmt: skip


def _monitors(callbacks: Any) -> list[tuple[int, str, str]]:
    """(index, class name, monitor) of the config's callbacks that monitor a metric."""
    out = []
    for i, entry in enumerate(_entries(callbacks)):
        args = entry.get("init_args") if isinstance(entry, (Mapping, argparse.Namespace)) else vars(entry)
        monitor = args.get("monitor") if isinstance(args, (Mapping, argparse.Namespace)) else None
        if isinstance(monitor, str):
            out.append((i, getattr(class_of(entry), "__name__", "callback"), monitor))
    return out


def check_monitors(callbacks: Any) -> None:
    """A callback's ``monitor`` (ModelCheckpoint, EarlyStopping, ...) that is a metric lit-hbp logs but for its
    separators or case (``val_loss`` for ``val/loss``), or with Lightning's ``_step``/``_epoch`` ending (lit-hbp
    logs each once, under its own name): refused now, naming it. Any other name is left to Lightning (a project's
    own metric)."""

    def bare(name: str) -> str:
        return re.sub(r"[/_.\-\s]", "", name).lower()

    for i, kind, monitor in _monitors(callbacks):
        if monitor in LOGGED:
            continue
        near = [name for name in LOGGED if bare(monitor) in (bare(name), bare(name) + "step", bare(name) + "epoch")]
        if near:
            raise ConfigError(
                f"trainer.callbacks[{i}] ({kind}): monitor {monitor!r} is logged by nothing; lit-hbp logs {near[0]!r}"
            )


def check_monitored_validation(config: Mapping[str, Any]) -> None:
    """A callback monitoring a validation metric (``val/loss``) in a fit that validates nothing (no
    ``data.val_fraction``, no ``data.val_sources``, or ``trainer.limit_val_batches: 0``): a ModelCheckpoint
    saved no checkpoint and an EarlyStopping never stopped, without a word (Lightning warns only where it
    validates every epoch). Refused before the data is read."""
    data, trainer = config.get("data") or {}, config.get("trainer") or {}
    if data.get("val_fraction") or data.get("val_sources"):
        if trainer.get("limit_val_batches") not in (0, 0.0):
            return
        why = "trainer.limit_val_batches is 0"
    else:
        why = "the run has no validation data (data.val_fraction 0, no data.val_sources)"
    for i, kind, monitor in _monitors(trainer.get("callbacks")):
        if monitor.startswith("val/"):
            raise ConfigError(
                f"trainer.callbacks[{i}] ({kind}): monitor {monitor!r}, but {why}: hold out records "
                "(data.val_fraction) or give data.val_sources, or monitor train/loss"
            )


def check_one_accumulation(trainer: Mapping[str, Any]) -> None:
    """A ``GradientAccumulationScheduler`` beside ``trainer.accumulate_grad_batches`` other than 1: Lightning refuses
    the pair when training starts, on a traceback after the data is read and the model built; refused now."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate in (None, 1):
        return
    for i, entry in enumerate(_entries(trainer.get("callbacks"))):
        kind = class_of(entry)
        if isinstance(kind, type) and issubclass(kind, GradientAccumulationScheduler):
            raise ConfigError(
                f"trainer.callbacks[{i}] ({kind.__name__}) beside trainer.accumulate_grad_batches {accumulate}: "
                "each sets the accumulation; keep one (the scheduler's epoch 0 entry for the first)"
            )


def check_trainer_values(section: Any) -> None:
    """Every trainer value Lightning's ``Trainer`` would refuse (``max_steps: -5``, ``max_epochs: -3``,
    ``limit_val_batches: 1.5``, ...), refused now as a ``ConfigError`` naming the key, before the data
    are tokenized: a ``Trainer`` is built from the config's values on the CPU, quietly, and its refusal is
    the error. Lightning's own checks are the reference, so each release's rules are the ones applied;
    ``RUN_RULES`` adds the values it takes but a run cannot use (``accumulate_grad_batches: 0``)."""

    from lightning.pytorch import Trainer

    from lit_hbp.lightning.plan_checks import (
        check_accumulation_windows,
        check_checkpoint_positions,
        check_validation_interval,
    )

    trainer = section.get("trainer")
    if trainer is None:
        return
    check_strategy_name(trainer.get("strategy"))
    precision = str(trainer.get("precision") or "")
    if precision.startswith("transformer-engine") and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            f"trainer.precision: {precision!r} needs NVIDIA's transformer-engine, which is not installed here: "
            "install it, or train with bf16-mixed"
        )
    if trainer.get("gradient_clip_algorithm") == "value" and is_deepspeed(trainer.get("strategy")):
        raise ConfigError(
            "trainer.gradient_clip_algorithm: 'value' with DeepSpeed (trainer.strategy), which clips by the global "
            "norm only: use 'norm', or trainer.strategy hbp_ddp"
        )
    if trainer.get("enable_checkpointing") is False or trainer.get("barebones") is True:
        check_no_checkpoint_callback(trainer.get("callbacks"), "barebones: true" if trainer.get("barebones") else "")
    check_monitors(trainer.get("callbacks"))
    if is_deepspeed(trainer.get("strategy")):
        check_fixed_accumulation(trainer.get("callbacks"))
    check_one_accumulation(trainer)
    if trainer.get("max_steps") == -1 and trainer.get("max_epochs") == -1:
        from lit_hbp.lightning.schedule import NO_END

        raise ConfigError(NO_END)
    for key, (accepted, what, why) in RUN_RULES.items():
        if key in trainer and not accepted(trainer.get(key)):
            raise ConfigError(f"trainer.{key} must be {what}, got {trainer.get(key)!r}: {why}")
    values = {k: v for k, v in trainer.as_dict().items() if k not in UNPROBED}
    given = trainer.get("logger")
    values["logger"] = False if given in (None, False, []) else True  # barebones refuses any logger
    values["profiler"] = None if trainer.get("profiler") is None else "simple"
    # The devices on the accelerator the config names (an Accelerator object is taken as given): what
    # Lightning's accelerator connector refuses (``devices: 0``, more CPU processes than it can count ...).
    accelerator = trainer.get("accelerator") or "auto"
    hardware = {"accelerator": accelerator, "devices": trainer.get("devices", "auto")}
    probes = [
        dict(
            accelerator="cpu", devices=1, strategy="auto", callbacks=step_callbacks(trainer.get("callbacks")), **values
        )
    ]
    if isinstance(accelerator, str):
        probes.append(dict(hardware, strategy="auto", logger=False, num_nodes=values.get("num_nodes", 1)))
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # no "GPU available" banner from the probe: the run prints its own
    built = []
    try:
        for probe in probes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built.append(Trainer(**probe))
    except (MisconfigurationException, ValueError, TypeError, RuntimeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        named = [k for k in re.findall(r"`(?:Trainer\()?(\w+)(?:=[^`]*)?`", message) if k in {**values, **hardware}]
        if not named and any(w in message.lower() for w in ("accelerator", "backend")):
            named = ["accelerator"]  # "No supported gpu backend found!"
        key = f"trainer.{named[0]}" if named else "trainer"
        raise ConfigError(f"{key}: {message}") from None
    finally:
        logging.disable(previous)
    check_validation_interval(built[0])  # the config's values as Lightning parsed them
    check_accumulation_windows(built[0])
    data = section.get("data")
    validates = data is None or bool(data.get("val_fraction") or data.get("val_sources"))
    check_checkpoint_positions(built[0], validates)
    if is_deepspeed(trainer.get("strategy")):
        check_deepspeed_precision(str(trainer.get("precision") or "32-true"))
    if len(built) > 1:
        check_backend_device((section.get("model") or {}).get("attn_backend") or "auto", built[1])


def check_backend_device(backend: str, trainer: Any) -> None:
    """A ``model.attn_backend`` that cannot run on the device the run resolves to (``flex`` or a flash
    kernel on a CPU), refused before the data is read, not at the self-check's first packed call."""
    import torch

    from lit_hbp.model.attention import REGISTRY

    if backend not in REGISTRY:  # auto, or a misspelled name the module refuses by name
        return

    device = trainer.strategy.root_device.type
    if device == "cuda":  # asking a flash kernel about the GPU initializes CUDA here, before a fork launches the run
        return
    reasons = {REGISTRY[backend].unusable(device, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    if None not in reasons:
        raise ConfigError(
            f"model.attn_backend: {backend!r} cannot run on {device} ({sorted(reasons)[0]}): use auto, which "
            "takes the fastest backend the device runs"
        )


def check_yaml_texts(argv: Sequence[str]) -> None:
    """``check_yaml_text`` over what the command line hands YAML: its config files and its values."""
    from pathlib import Path

    from lit_hbp.cost.config import check_yaml_text

    for i, arg in enumerate(argv):
        name, given, value = arg.partition("=")
        if not given:
            value = argv[i + 1] if i + 1 < len(argv) and arg.startswith("-") else None
        if value is None or not name.startswith("-"):
            continue
        if name in ("--config", "-c") and Path(value).is_file():
            check_yaml_text(Path(value).read_text(), value)
        elif ":" in value:
            check_yaml_text(value, "", name)
