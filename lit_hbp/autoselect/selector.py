"""Level selectors: the paper's Algorithm 1 behind one interface, for every place that chooses levels.

``AnalyticSelector`` prices candidates with the cost model; ``MeasuredSelector`` trains a few real
steps of the run's own module per candidate through HBPStrategy. Both are ``LevelSelector``s, so a
data module takes either (``HBPDataModule(levels=MeasuredSelector())``, or in YAML
``levels: {class_path: lit_hbp.autoselect.MeasuredSelector}``) and chooses at set-up. The command
line tool (``python -m lit_hbp.autoselect``) calls the same ``select`` on a ``RunSetting`` read from
a training config, and the measured selector's launcher calls it in every process it starts.
"""

from __future__ import annotations

import inspect
import math
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import AutoConfig, PretrainedConfig

from lit_hbp.autoselect.launch import launch
from lit_hbp.autoselect.measured import MeasuredProfiler, probe_strategy_args
from lit_hbp.autoselect.search import Selection, analytic_levels, select_levels, with_vision
from lit_hbp.cost.config import model_config, read_config, spec_of
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import GIB, HARDWARE, Hardware
from lit_hbp.cost.run_settings import (
    CONFIG,
    Settings,
    Tool,
    check,
    config_strategy,
    config_switches,
    cost_model,
    describe,
    local_hardware,
    settings_of,
    with_zero,
)
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.datamodule import data_seed
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.causal_lm import configured_spec
from lit_hbp.model.checks import model_config as hf_config
from lit_hbp.model.checks import position_range, read_config_json, rescaling_limit, takes_positions
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.levels import Level, LevelSelector
from lit_hbp.packing.vision_load import VisionLoad
from lit_hbp.parallel.kind import resolve_sp_kind


@dataclass
class RunSetting:
    """What selection needs to know about the run it chooses levels for.

    spec: the model's shape. world: ranks of the run. module_class/module_args: how to build a
    fresh copy of the run's LightningModule (measured probes). trainer_args: the run's Trainer
    settings a probe reuses (accelerator, devices, precision, accumulation, clipping).
    strategy_args: its HBPStrategy settings (ZeRO stage, DeepSpeed config); None for a run without DeepSpeed
    (HBPDDPStrategy, Lightning's DDP: nothing sharded, bf16 autocast over fp32 weights). in_world: True when
    called inside the run's own processes (probes run there); False from a tool (the measured
    selector starts ``world`` local processes). strategy: the run's strategy, which receives the
    SP groups the probes built. node_size: ranks per node (the default layouts keep Ulysses inside one).
    max_len: the longest position the model covers (``checks.position_range``: max_position_embeddings
    or what its RoPE scaling extends it to), None when unknown: the largest level the fit accepts.
    whole_past: the longest level sp > 1 may take (a longrope model's original positions, ``whole_past``),
    None when any may.
    tool: whose words a refusal speaks (``run_settings.Tool``): a training config's inside a fit, the
    command line's from ``python -m lit_hbp.autoselect``.
    """

    spec: ModelSpec
    world: int
    seed: int = 0
    module_class: type | None = None
    module_args: dict = field(default_factory=dict)
    trainer_args: dict = field(default_factory=dict)
    strategy_args: dict | None = field(default_factory=dict)
    in_world: bool = False
    strategy: Any = None
    node_size: int | None = None
    max_len: int | None = None
    whole_past: int | None = None
    tool: Tool = CONFIG

    def with_flags(
        self, liger: bool = False, offload_optimizer: bool = False, zero_stage: int | None = None
    ) -> RunSetting:
        """This run with Liger's RMSNorm/SwiGLU, the Adam states on the host and/or another ZeRO stage (the
        levers ``--liger``, ``--offload-optimizer`` and ``--zero-stage`` of the command line tools)."""
        flags = {"liger": liger, "optimizer_offload": offload_optimizer}
        tool = self.tool.with_config_words(config_switches(self.strategy_args, self.module_args, flags))
        module_args = {**self.module_args, **({"liger": True} if liger else {})}
        strategy_args = with_zero(self.strategy_args, zero_stage, offload_optimizer)
        return replace(self, module_args=module_args, strategy_args=strategy_args, tool=tool)

    def settings(self, hardware: Hardware) -> Settings:
        """The run's settings on ``hardware`` (``run_settings.settings_of``): its HBPStrategy's ZeRO stage and
        offloads, the module's Liger, LoRA (its adapters counted on the model priced, ``spec``) and loss chunk, the
        precision."""
        precision = self.trainer_args.get("precision")
        return settings_of(hardware, self.world, self.strategy_args, self.module_args, precision, self.spec)

    def cost_model(self, hardware: Hardware, sp_kind: str = "ulysses") -> CostModel:
        """The run's cost model on ``hardware`` (``run_settings.cost_model`` of ``settings``)."""
        return cost_model(self.spec, self.settings(hardware), sp_kind)

    def make_module(self):
        """A fresh copy of the run's module, seeded like the run."""
        if self.module_class is None:
            raise ValueError("measured selection needs the run's module (RunSetting.module_class)")
        torch.manual_seed(self.seed)
        return self.module_class(**self.module_args)

    @classmethod
    def from_trainer(cls, trainer, seed: int = 0) -> RunSetting:
        """The run being set up: its module (rebuilt from its init arguments), world, precision,
        accumulation and strategy."""
        module = trainer.lightning_module
        hparams = getattr(module, "hparams", None) or {}
        if hparams.get("model") is None:
            raise ValueError("level selection needs the model: train an HBPLitModule (its `model` describes it)")
        model = hparams["model"]
        vocab = hparams.get("vocab_size") or getattr(trainer.datamodule, "vocab_size", None)
        if isinstance(model, dict) and vocab is not None:  # as the fit builds it: the mapping's own if not fewer
            model = {**model, "vocab_size": max(vocab, model.get("vocab_size") or vocab)}
        device = trainer.strategy.root_device
        init = inspect.signature(type(module)).parameters  # hparams also hold LightningCLI's entries
        return cls(
            spec=configured_spec(model) or ModelSpec.from_config(model if isinstance(model, dict) else Path(model)),
            world=trainer.world_size,
            seed=seed,
            module_class=type(module),
            module_args={k: v for k, v in hparams.items() if k in init},
            trainer_args=dict(
                accelerator=device.type,
                devices=trainer.device_ids if device.type == "cuda" else trainer.num_devices,
                num_nodes=trainer.num_nodes,
                precision=trainer.precision,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
                gradient_clip_val=trainer.gradient_clip_val,
            ),
            strategy_args=probe_strategy_args(trainer.strategy),
            in_world=True,
            strategy=trainer.strategy,
            node_size=trainer.num_devices,
            max_len=position_limit(config := config_of(model)),
            whole_past=whole_past(config),
        )

    @classmethod
    def from_config(cls, config: dict, vocab: int | None, world: int, spec: ModelSpec | None = None) -> RunSetting:
        """A training config (``lit_hbp.cost.config.read_config``) to be run on ``world`` local processes:
        its model and loss settings, precision (Lightning's 32-true when it names none), accumulation,
        clipping and its DeepSpeed strategy's settings (``run_settings.config_strategy``; None, priced without
        DeepSpeed, when it names one without or none: Lightning's own strategy then trains it, as ``fit`` and
        ``python -m lit_hbp.cost.memory`` read it)."""
        module_args = dict(config.get("model") or {})
        if vocab is not None:
            module_args["vocab_size"] = vocab
        trainer = config.get("trainer") or {}
        kept = {k: trainer[k] for k in ("accumulate_grad_batches", "gradient_clip_val") if k in trainer}
        trainer_args = {"precision": trainer.get("precision", "32-true"), **kept}
        strategy_args = config_strategy(trainer.get("strategy"))
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        model = None if spec else model_config(config, vocab)
        return cls(
            spec=spec or spec_of(model),
            world=world,
            seed=data_seed((config.get("data") or {}).get("seed"), config.get("seed_everything")),
            module_class=HBPLitModule,
            module_args=module_args,
            trainer_args={"accelerator": accelerator, "devices": world, **trainer_args},
            strategy_args=strategy_args,
            max_len=position_limit(config := config_of(model)),
            whole_past=whole_past(config),
        )


def config_of(model) -> Any:
    """A model config (a mapping, a config.json or a checkpoint folder) as attributes, None when it cannot be
    read here; one already read is returned as it is (so the file is read once for several questions). A
    mapping is the Hugging Face config it builds, with the family's defaults, as the fit checks it (a Llama
    mapping without ``max_position_embeddings`` covers 2,048 positions there)."""
    if isinstance(model, (SimpleNamespace, PretrainedConfig)) or model is None:
        return model
    if isinstance(model, dict) and "model_type" in model:
        try:
            return hf_config(model)
        except (ValueError, TypeError, KeyError):  # a family transformers does not know: the mapping as it is
            pass
    if not isinstance(model, dict):
        path = Path(str(model))
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            return None
        try:  # as the fit reads it: transformers' own encoding too (an infinite value as {"__float__": "Infinity"})
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception:  # noqa: BLE001 - a family this transformers does not know or cannot build: the file as it is
            pass
        try:
            model = read_config_json(path)
        except (OSError, ValueError):
            return None
    return SimpleNamespace(**model)


def position_limit(model) -> int | None:
    """The longest position a model config (a mapping, a config.json, a checkpoint folder or ``config_of``'s) covers,
    None when it does not say or cannot be read here: the fit refuses levels past it
    (``checks.check_positions``: past ``max_position_embeddings`` uncovered, or past the length at which a
    dynamic rotary embedding rescales), so the search does not choose them; None for a model that takes no
    positions (``checks.takes_positions``: a hybrid without positional encoding), which the fit does not limit."""
    config = config_of(model)
    if config is None:
        return None
    covered = position_range(config)[1]
    rescaled = rescaling_limit(config)
    if (covered is None and rescaled is None) or not takes_positions(config):
        return None
    if rescaled is None or rescaled[0] == "longrope":  # longrope: past it at sp 1 (``whole_past``)
        return covered
    return min(rescaled[1], covered or rescaled[1])  # dynamic: no pack past it


def whole_past(model) -> int | None:
    """The longest level a model config lets sp > 1 take, None when any: a longrope rotary embedding's original
    positions, past which a pack gives each document the factors of its own length at sp 1 only
    (``rope.per_document_longrope``; ``checks.check_positions`` refuses an SP level past it)."""
    config = config_of(model)
    rescaled = None if config is None else rescaling_limit(config)
    longrope = rescaled is not None and rescaled[0] == "longrope"
    return rescaled[1] if longrope and takes_positions(config) else None


def positions_of(model: str) -> tuple[Any, int | None, int | None]:
    """--model's config (None for a preset), the longest position it covers and the longest level it lets sp > 1
    take (``selector.position_limit`` and ``whole_past``: what a fit applies), each None where it says nothing."""
    path = Path(model)
    config = config_of(model_config(read_config(path), None) if path.suffix in (".yaml", ".yml") else model)
    return config, position_limit(config), whole_past(config)


class Selector(LevelSelector):
    """The level search (``search.select_levels``) over ``candidates`` pack lengths (default: powers of
    two up to the one holding the longest sample), leaving ``margin_gib`` of device memory free. Levels
    with sp > 1: the built-in kinds (``ulysses``, ``cp``) search every (ulysses, cp) layout the heads
    allow and write the one chosen into the level; a kind of one's own (``sp_kind``) its ``layouts``.
    The largest level holds the longest sample, up to ``max_len`` and the model's positions (longer
    samples follow ``data.over_length``); when it fits nowhere the search refuses, naming the levers
    that would make it fit (``levers.NoLevelFits``)."""

    def __init__(
        self,
        candidates: list[int] | None = None,
        margin_gib: float = 2.0,
        sp_kind: str = "ulysses",
        max_len: int | None = None,
    ):
        name = type(self).__name__
        bad = [c for c in candidates or () if isinstance(c, bool) or not float(c).is_integer() or c < 1]
        if bad:
            raise ConfigError(f"{name} candidates: must be pack lengths in whole tokens >= 1, got {bad}")
        self.candidates = sorted(int(c) for c in candidates) if candidates else None
        if not (0 <= margin_gib < math.inf):  # NaN too: it crashed the memory fit with a traceback
            raise ConfigError(f"{name} margin_gib: must be a finite number >= 0 (GiB), got {margin_gib}")
        if max_len is not None and (isinstance(max_len, bool) or not float(max_len).is_integer() or max_len < 1):
            raise ConfigError(f"{name} max_len: must be a whole number of tokens >= 1, got {max_len}")
        try:  # a misspelt kind would otherwise surface only inside the level search
            resolve_sp_kind(sp_kind)
        except ValueError as e:
            raise ConfigError(f"{name} sp_kind: {e}") from None
        self.margin_gib, self.sp_kind = float(margin_gib), sp_kind
        self.max_len = None if max_len is None else int(max_len)

    def cap(self, run: RunSetting) -> int | None:
        """The longest level allowed: ``max_len`` and the model's positions, the shorter."""
        caps = [c for c in (self.max_len, run.max_len) if c is not None]
        return min(caps) if caps else None

    @abstractmethod
    def select(self, lengths: np.ndarray, run: RunSetting, vision: VisionLoad | None = None) -> Selection:
        """The levels for samples of ``lengths`` in ``run`` (``vision``: a vision-language run's images, per
        sample), with every candidate priced or measured."""

    @abstractmethod
    def where(self, run: RunSetting) -> str:
        """How the candidates are priced, for the log."""

    def levels_for(self, lengths: np.ndarray, trainer, vision: VisionLoad | None = None) -> tuple[Level, ...]:
        run = self.run_of(trainer)
        return self.chosen(self.select(lengths, run, vision), run)

    @staticmethod
    def run_of(trainer) -> RunSetting:
        """The run ``trainer`` is setting up."""
        return RunSetting.from_trainer(trainer, seed=getattr(trainer.datamodule, "seed", 0))

    def chosen(self, selection: Selection, run: RunSetting) -> tuple[Level, ...]:
        """``selection``'s levels, logged with how they were priced."""
        rank_zero_info(f"levels chosen by {type(self).__name__} ({self.where(run)})\n{selection.table()}\n")
        rank_zero_info(f"chosen {selection.yaml()}" + "".join(f"\n{note}" for note in selection.notes))
        return tuple(selection.levels)

    every_layout = True
    """Whether the search tries every (ulysses, cp) layout of each degree, or only the default one."""

    def _search(self, profiler, lengths: np.ndarray, run: RunSetting, cost: CostModel) -> Selection:
        return select_levels(
            profiler,
            lengths,
            run.spec,
            run.world,
            max_len=self.cap(run),
            candidates=self.candidates,
            margin=self.margin_gib * GIB,
            sp_kind=self.sp_kind,
            every_layout=self.every_layout,
            node_size=run.node_size,
            cost=cost,
            tool=run.tool,
            whole_past=run.whole_past,
        )


class AnalyticSelector(Selector):
    """Prices every candidate with the cost model of ``gpu`` GPUs (h100, h200, a100): instant, and
    usable before the cluster exists. ``margin_gib`` defaults to 0: the cost model already keeps a
    2 GB reserve (CUDA context, NCCL, allocator), as ``python -m lit_hbp.simulate`` and
    ``python -m lit_hbp.cost.memory`` count it."""

    def __init__(
        self,
        gpu: str = "h100",
        candidates: list[int] | None = None,
        margin_gib: float = 0.0,
        sp_kind: str = "ulysses",
        max_len: int | None = None,
    ):
        super().__init__(candidates, margin_gib, sp_kind, max_len)
        if gpu not in HARDWARE:
            raise ConfigError(f"AnalyticSelector gpu: unknown {gpu!r}; choose one of {sorted(HARDWARE)}")
        if margin_gib * GIB >= HARDWARE[gpu].memory_bytes:
            raise ConfigError(
                f"AnalyticSelector margin_gib: {margin_gib} leaves nothing of a {gpu}'s "
                f"{HARDWARE[gpu].memory_bytes / GIB:.1f} GiB to train in"
            )
        self.gpu = gpu

    def cost_model(self, run: RunSetting) -> CostModel:
        """The run's cost model on ``gpu``, its links priced on the run's nodes (``node_size`` devices, where the run
        says it) rather than the preset's."""
        hardware = HARDWARE[self.gpu]
        if run.node_size:
            hardware = replace(hardware, gpus_per_node=int(run.node_size))
        return run.cost_model(hardware, self.sp_kind)

    def select(self, lengths: np.ndarray, run: RunSetting, vision: VisionLoad | None = None) -> Selection:
        cost = self.cost_model(run)
        check(cost if vision is None else with_vision(cost, lengths, vision), run.tool)  # its images' rules too
        margin = self.margin_gib * GIB
        args = (self.cap(run), self.candidates, margin, self.sp_kind, run.node_size, run.tool, vision, run.whole_past)
        return analytic_levels(cost, lengths, run.seed, *args)

    def where(self, run: RunSetting) -> str:
        return f"analytic, {run.world} x {HARDWARE[self.gpu].name}, {describe(self.cost_model(run))}"


class MeasuredSelector(Selector):
    """Trains ``steps`` optimizer steps of the run's module per candidate, through HBPStrategy with
    the run's ZeRO stage, precision and accumulation, on the run's world (inside a run) or on
    ``run.world`` local processes it starts (from a tool). ``memory_gib``: memory per device (default
    the GPU's; 16 on CPU). The SP groups the probes built are handed to the run's strategy. A run with
    images or videos packs its own samples into the probes (the tower encodes them as in training)."""

    every_layout = False  # a probe is a short training run: one layout per degree, the default one

    def __init__(
        self,
        candidates: list[int] | None = None,
        margin_gib: float = 2.0,
        memory_gib: float | None = None,
        steps: int = 3,
        sp_kind: str = "ulysses",
        max_len: int | None = None,
    ):
        super().__init__(candidates, margin_gib, sp_kind, max_len)
        if isinstance(steps, bool) or int(steps) != steps or steps < 1:  # 0: no step timed, the first candidate won
            raise ConfigError(f"MeasuredSelector steps: must be a whole number of timed steps >= 1, got {steps}")
        if memory_gib is not None and not (0 < memory_gib < math.inf):
            raise ConfigError(
                f"MeasuredSelector memory_gib: must be a finite number > 0 (GiB per device), got {memory_gib}"
            )
        if memory_gib is not None and margin_gib >= memory_gib:
            raise ConfigError(
                f"MeasuredSelector margin_gib: {margin_gib} leaves nothing of memory_gib {memory_gib} to train in"
            )
        self.memory_gib, self.steps = memory_gib, int(steps)
        self.sp_groups = None

    def cost_model(self, run: RunSetting) -> CostModel:
        """The run's cost model on this process's device as it reports itself (``run_settings.local_hardware``):
        a GPU's memory, ``memory_gib`` where given, 16 GiB of a CPU."""
        cuda = run.trainer_args.get("accelerator") == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if self.memory_gib is not None:
            memory = self.memory_gib * GIB
        else:
            memory = None if cuda else 16.0 * GIB  # None: what the GPU reports
        return run.cost_model(local_hardware(device, memory, run.node_size or run.world), self.sp_kind)

    def levels_for(
        self, lengths: np.ndarray, trainer, vision: VisionLoad | None = None, samples=None
    ) -> tuple[Level, ...]:
        """The levels for the run ``trainer`` sets up; ``samples``: its samples with images or videos
        (``lit_hbp.lightning.loader.StoreSamples``, indexed as ``lengths``), which the probes pack."""
        run = self.run_of(trainer)
        return self.chosen(self.select(lengths, run, vision, samples), run)

    def select(self, lengths: np.ndarray, run: RunSetting, vision: VisionLoad | None = None, samples=None) -> Selection:
        """The levels for samples of ``lengths`` in ``run``, each candidate measured; a run with images or
        videos (``vision``) gives its ``samples`` too, and the probes pack them (``measured.ProbeData``)."""
        if vision is not None and samples is None:
            raise ConfigError(
                "MeasuredSelector packs the run's own samples into its probes when the data has images or videos, "
                "and was given the images (vision) without the samples: choose through HBPDataModule(levels=...) "
                "or python -m lit_hbp.autoselect --measured --config, which hand them over"
            )
        # The cost model refuses what set-up would refuse, screens out probes sure to run out of memory and
        # finds the levers a refusal names, priced on this device.
        cost = self.cost_model(run)
        if vision is not None and cost.model.vision is not None:  # the screen counts what the tower keeps
            cost = with_vision(cost, lengths, vision)
        check(cost, run.tool)
        if not run.in_world:
            cuda = run.trainer_args.get("accelerator") == "cuda"
            return launch(self.select, (lengths, replace(run, in_world=True), vision, samples), run.world, cuda)
        patches = None  # per sample, what the probes' densest pack is chosen by (a text run's samples: none)
        if samples is not None:
            patches = vision.patches if vision is not None else np.zeros(len(lengths))
        profiler = MeasuredProfiler(
            run.make_module,
            lengths,
            cost.hardware.memory_bytes,
            run.trainer_args,
            run.strategy_args,
            steps=self.steps,
            seed=run.seed,
            estimate=cost.memory_bytes,
            sp_kind=self.sp_kind,
            samples=samples,
            patches=patches,
        )
        selection = self._search(profiler, lengths, run, cost)
        self.sp_groups = profiler.sp_groups
        if run.strategy is not None and getattr(run.strategy, "sp_groups", False) is None:
            run.strategy.sp_groups = self.sp_groups  # the run uses the groups its probes built
        return selection

    def where(self, run: RunSetting) -> str:
        cost = self.cost_model(run)
        return f"measured on {run.world} x {cost.hardware.name}, {describe(cost)}"
