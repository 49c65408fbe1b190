"""lit-hbp's strategies: a sequence-parallel degree per HBP level, switched batch by batch, over
DeepSpeed (``HBPStrategy``, ZeRO 0-3) or over torch's DDP (``HBPDDPStrategy``: no sharding, nothing in the
step that a step on one device does not need).

Every SP group of every degree the levels use is built once at setup; each micro-batch is then handed
over with its level's group (``PackedBatch.sp_group``, which its packed calls carry), at zero cost:
nothing is activated in the process, so nothing outlives the micro-batch (``LevelGroups``, what both
strategies share). DeepSpeed and DDP never hear of SP: their data-parallel group stays the whole world
(no ``mpu``, whose ZeRO partitioning would freeze one sp), and the Ave-Token loss carries all SP
accounting (docs/design.md sections 5-7).

Also fixed here, for DeepSpeed:
- Lightning divides the loss by accumulate_grad_batches and DeepSpeed divides gradients by its
  accumulation steps again; DeepSpeed's division is cancelled (``scale_wrt_gas=False``).
- Lightning saves every DeepSpeed checkpoint over the previous one's files (tag ``checkpoint``); here
  each save is a new tag and ``latest`` is written last (``lit_hbp.lightning.checkpoints``).
- Lightning's DeepSpeedStrategy refuses CPU accelerators; on CPU this strategy initializes
  DeepSpeed with gloo and ``device_rank=local_rank``, so the whole path runs and is tested on CPU.

Both strategies live in one module on purpose (just over 600 lines): they share ``LevelGroups``, the batch
hand-over and the process-group release, and a config names either by this one path.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import inspect
import os
import sys
import weakref
from collections.abc import Generator
from datetime import timedelta
from typing import Any
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402

from lit_hbp.cost.run_settings import Settings, check, deepspeed_zero, refusal, strategy_config  # noqa: E402
from lit_hbp.data.batch import PackedBatch  # noqa: E402
from lit_hbp.errors import ConfigError, did_you_mean  # noqa: E402
from lit_hbp.lightning.checkpoints import check_zero_folder, is_complete, save_deepspeed  # noqa: E402
from lit_hbp.lightning.deepspeed_config import (  # noqa: E402
    asked_settings,
    check_arguments,
    check_clipping,
    check_config_sections,
    check_half_precision_stage,
    check_loss_scaling,
    check_precision_sections,
    loss_scaling_asked,
    module_clipping_warning,
    overflow_note,
    put_back_torch_linear,
    sharding_note,
    with_run_defaults,
    without_idle_overlap,
    without_overflow_check,
)
from lit_hbp.lightning.op_builds import refuse_stale_build_locks  # noqa: E402
from lit_hbp.lightning.trained_model import (  # noqa: E402
    guard_frozen,
    refuse_cp_past_chunks,
    refuse_cp_under_router_loss,
    refuse_mixers_under_zero3,
    refuse_sp_over_mixers,
    trained_model,
)
from lit_hbp.model.build import zero3_loading  # noqa: E402
from lit_hbp.packing.levels import Level, as_level  # noqa: E402
from lit_hbp.parallel.context import SPCall  # noqa: E402
from lit_hbp.parallel.groups import SPGroups  # noqa: E402
from lit_hbp.parallel.kind import validate_sp_setup  # noqa: E402
from lit_hbp.parallel.topology import layout_levels, model_heads  # noqa: E402

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
OWN_OPTIMIZERS = LightningModule.configure_optimizers  # a module that keeps it configures none


def _plan_fields(levels) -> list[tuple]:
    """What the data module's plan and the strategy's groups must agree on, each side laid out (a layout left to
    the default on one side is filled in the same way on the other)."""
    return [
        (lv.pack_len, lv.sp, lv.ckpt_layers, lv.packs_per_rank, lv.offload, lv.mlp_tiles, lv.sp_kind, lv.layout)
        for lv in map(as_level, levels)
    ]


def config_zero_stage(strategy: Any) -> int | None:
    """The DeepSpeed ZeRO stage a config's ``trainer.strategy`` asks for (a registered name such as ``hbp`` or
    ``deepspeed_stage_3``, or ``{class_path, init_args}`` of a DeepSpeed strategy, its ``config`` a mapping or a
    JSON file), read before anything is built as the strategy will read it (``run_settings.strategy_config``);
    None where it names no DeepSpeed strategy, or a config file that cannot be read here."""
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            return None
        entry = StrategyRegistry[strategy]
        cls, args = entry["strategy"], dict(entry["init_params"])
    elif isinstance(strategy, dict) and isinstance(strategy.get("class_path"), str):
        module, _, name = strategy["class_path"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None
        args = dict(strategy.get("init_args") or {})
    else:
        return None
    if not (isinstance(cls, type) and issubclass(cls, DeepSpeedStrategy)):
        return None
    if args.get("config") is None and DeepSpeedStrategy.DEEPSPEED_ENV_VAR in os.environ:
        args["config"] = os.environ[DeepSpeedStrategy.DEEPSPEED_ENV_VAR]  # as DeepSpeedStrategy reads it
    try:
        return deepspeed_zero(strategy_config(args))["zero_stage"]
    except (OSError, ValueError):
        return None


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the strategies that set up a world in this process


@atexit.register
def release_process_groups() -> None:
    """At exit, while the interpreter is whole: drop the SP groups of every HBPStrategy still alive and
    destroy every process group (DeepSpeed's cached references included). A gloo worker thread left to end
    during interpreter shutdown can abort a successful run (``terminate called without an active
    exception``). A world already destroyed (the measured level search destroys its own) is left alone."""
    for strategy in list(_LIVE):
        strategy.sp_groups = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # DeepSpeed only where the run imported it: importing it now (a DDP run) would register atexit
        # callbacks during interpreter shutdown, which Python refuses with an error on every such exit.
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()


def _whole_folder(path: Any) -> None:
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete DeepSpeed checkpoint folder: its `latest` file must name a tag folder "
            "holding the model states (a save that was killed leaves the previous tag named)"
        )


def _check_deepspeed_device(device: torch.device) -> None:
    """DeepSpeed picks its device once, from ``DS_ACCELERATOR`` or what it finds: one that is not the
    trainer's would keep the model where the process group cannot reach it (a cryptic collective error)."""
    from deepspeed.accelerator import get_accelerator

    if device.type == "cuda" and get_accelerator().device_name() != "cuda":
        raise ConfigError(
            f"DeepSpeed runs on {get_accelerator().device_name()!r} (DS_ACCELERATOR="
            f"{os.environ.get('DS_ACCELERATOR', '')!r}) but the trainer on {device}: unset DS_ACCELERATOR, or set "
            "it to cuda"
        )


class LevelGroups:
    """What a lit-hbp strategy adds to its Lightning parent, whatever that is: the levels (the data
    module's, checked against the model and the world), every SP group they need built once at set-up,
    each micro-batch handed over with its level's group and kind, frozen models guarded. A subclass
    lists it before its Lightning strategy, calls ``init_levels`` in ``__init__`` and ``prepare_levels``
    in ``setup``."""

    levels: tuple[Level, ...] | None
    sp_groups: SPGroups | None

    def init_levels(self, levels: list[Level | dict | str | int] | None) -> None:
        self.levels = None if levels is None else tuple(as_level(x) for x in levels)
        self._given_levels = self.levels  # the caller's; ``levels`` becomes each run's (a later call's data module's)
        self.sp_groups = None
        self._sp_calls: dict[tuple, SPCall] = {}  # (sp, cp, kind) -> the level's SPCall, built on first use
        self._frozen_guards: list = []

    def prepare_levels(self, trainer) -> tuple[Level, ...]:
        """The run's levels laid out for its model and world (the data module's, or this strategy's if
        they agree), the SP groups they need, and the guards on frozen models."""
        data_levels = getattr(trainer.datamodule, "levels", None)
        levels = self._given_levels or data_levels
        if not levels:
            raise ValueError(f"{type(self).__name__} needs levels: pass levels=... or use a data module with .levels")
        module = trainer.lightning_module
        net = trained_model(module, [as_level(x) for x in levels])
        for handle in self._frozen_guards:  # a second call's (a resume's selection, set up again)
            handle.remove()
        self._frozen_guards = guard_frozen(module)
        cfg = net.config
        node_size = trainer.num_devices
        validate_sp_setup(
            levels,
            self.world_size,
            *model_heads(cfg),
            getattr(module, "num_layers", None) or cfg.get_text_config().num_hidden_layers,
            node_size,
        )
        laid_out = tuple(layout_levels([as_level(x) for x in levels], cfg, node_size))
        theirs = data_levels and layout_levels([as_level(x) for x in data_levels], cfg, node_size)
        if self._given_levels and theirs and _plan_fields(theirs) != _plan_fields(laid_out):
            raise ValueError(
                f"{type(self).__name__} levels {list(laid_out)} differ from the data module's {list(theirs)}: the "
                "batches carry the data module's sp and layout; give the levels once (the strategy reads the data's)"
            )
        refuse_sp_over_mixers(net, laid_out)
        refuse_cp_under_router_loss(net, laid_out)
        refuse_cp_past_chunks(net, laid_out)
        degrees = [(lv.sp, lv.layout[1]) for lv in laid_out]
        if self.sp_groups is None:
            self.sp_groups = SPGroups(degrees, self.world_size, self.global_rank, self._timeout)
        else:  # groups handed over from an earlier run of the same world (the measured level search)
            if (self.sp_groups.world_size, self.sp_groups.rank) != (self.world_size, self.global_rank):
                raise ValueError(
                    f"the SP groups handed to {type(self).__name__} were built for rank {self.sp_groups.rank} of "
                    f"{self.sp_groups.world_size}, not rank {self.global_rank} of {self.world_size}"
                )
            self.sp_groups.ensure(degrees)
        return laid_out

    def describe_levels(self) -> str:
        return ", ".join(
            f"{lv.pack_len} tokens sp {lv.sp}{lv.layout_note} ckpt {lv.ckpt_layers}{lv.memory_note}"
            + (f" B {lv.packs_per_rank}" if lv.packs_per_rank > 1 else "")
            for lv in self.levels or ()
        )

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, with its level's SP group and kind (its packed calls carry them)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, PackedBatch) and batch.sp > 1:
            key = (batch.sp, batch.cp, batch.sp_kind)
            if key not in self._sp_calls:
                self._sp_calls[key] = SPCall.of(self.sp_groups[(batch.sp, batch.cp)], batch.sp_kind)
            batch = batch.replace(sp_group=self._sp_calls[key])
        return batch

    def teardown(self) -> None:
        self._sp_calls = {}
        for handle in self._frozen_guards:
            handle.remove()
        self._frozen_guards = []
        super().teardown()


class HBPStrategy(LevelGroups, DeepSpeedStrategy):
    """DeepSpeed (ZeRO 0-3) with per-level sequence parallelism (Ulysses x context parallelism).

    Args:
        levels: the HBP levels; by default those of the trainer's data module (HBPDataModule).
        stage: ZeRO stage (default 2; beside a DeepSpeed ``config``, what its ``zero_optimization`` says).
        overlap_comm: ZeRO's overlap of the gradient reduction with the backward; by default (None)
            on with several processes and off with one, which reduces nothing (a DeepSpeed
            ``config`` that sets it decides instead).
        timeout: how long a collective waits for the other ranks before it fails (``h:m:s``): a rank
            that died mid-step stops the others after this long on GPUs (NCCL; gloo fails at once).
            10 minutes, not torch's 30: long enough for a checkpoint write or a first step's compile,
            which other ranks wait on. Other arguments are DeepSpeedStrategy's.

    DeepSpeed's throughput timer and its bf16 gradient-overflow check are off unless a DeepSpeed
    ``config`` turns them on: both synchronize the device (``without_overflow_check``). A config's settings
    DeepSpeed or Lightning would apply other than asked are refused (``deepspeed_config``: stage 0 under half
    precision, its optimizer or scheduler beside the module's, clipping beside the trainer's, arguments beside it).
    """

    strategy_name = "hbp"

    def __init__(
        self,
        levels: list[Level | dict | str | int] | None = None,
        stage: int | None = None,
        logging_batch_size_per_gpu: int = 1,
        overlap_comm: bool | None = None,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
        **kwargs: Any,
    ):
        if stage not in (None, 0, 1, 2, 3) or isinstance(stage, bool):
            raise ConfigError(f"trainer.strategy (HBPStrategy): stage is DeepSpeed's ZeRO stage, 0-3; got {stage!r}")
        given = {k: v for k, v in dict(kwargs, stage=stage, overlap_comm=overlap_comm).items() if v is not None}
        if overlap_comm is not None:
            kwargs["overlap_comm"] = overlap_comm
        super().__init__(
            stage=2 if stage is None else stage, logging_batch_size_per_gpu=logging_batch_size_per_gpu,
            timeout=timeout, **kwargs,
        )  # fmt: skip
        user_config = kwargs.get("config") is not None or self.DEEPSPEED_ENV_VAR in os.environ
        check_arguments(self.config if user_config else None, given)
        self._loss_scaling = loss_scaling_asked(given)
        asked = asked_settings(self.config if user_config else None, overlap_comm)
        self._user_clip, self._overlap_comm_asked, self._overflow_check_asked = asked
        if self.config is not None:
            self.config = with_run_defaults(self.config)
            check(Settings(**deepspeed_zero(self.config)))  # an offload DeepSpeed ignores at this ZeRO stage is refused
            self.precision_plugin = self._precision_plugin  # a plugin given to the constructor: checked now
        self.init_levels(levels)

    @DeepSpeedStrategy.precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Set as the Trainer is built: a DeepSpeed config's precision section checked there, before any data."""
        if plugin is not None and getattr(self, "config", None) is not None:  # (set after a constructor's plugin)
            check_precision_sections(self.config, str(plugin.precision))
            check_loss_scaling(self._loss_scaling, str(plugin.precision))
        self._precision_plugin = plugin

    def _format_config(self) -> None:
        super()._format_config()  # adds the precision's section (bf16) to the config
        check_half_precision_stage(self.config)
        module = self.lightning_module
        check_clipping(self._user_clip, None if module is None else module.trainer.gradient_clip_val)
        self.config = without_overflow_check(self.config, self._overflow_check_asked)

    def init_deepspeed(self) -> None:
        with module_clipping_warning(type(self.lightning_module)):
            super().init_deepspeed()

    @property
    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if self._on_cpu:
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's version refuses CPU accelerators
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        # Lightning destroys the process groups at exit for NCCL only: release_process_groups does it for
        # every backend, this strategy's SP groups included, before interpreter shutdown begins.
        _LIVE.add(self)
        refuse_stale_build_locks()  # DeepSpeed's op builds would wait on a stopped build's lock without end
        if not self._on_cpu:
            return super().setup_distributed()
        # CPU devices have no index, which the parent's device-index check rejects.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _deepspeed_args(self) -> argparse.Namespace:
        return argparse.Namespace(device_rank=self.local_rank if self._on_cpu else self.root_device.index)

    def _initialize_deepspeed_inference(self, model) -> None:
        """Lightning's engine for validate/test/predict; on CPU with the rank DeepSpeed needs (the
        parent passes the device index, which CPU devices do not have)."""
        if not self._on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed

        initialize = deepspeed.initialize
        with mock.patch.object(
            deepspeed, "initialize", lambda **kw: initialize(**{**kw, "args": self._deepspeed_args()})
        ):
            super()._initialize_deepspeed_inference(model)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if not self._on_cpu:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def setup(self, trainer: Trainer) -> None:
        self.levels = self.prepare_levels(trainer)
        own = getattr(type(trainer.lightning_module), "configure_optimizers", OWN_OPTIMIZERS)
        check_config_sections(self.config, own is not OWN_OPTIMIZERS)
        zero = Settings(**deepspeed_zero(self.config))
        refuse_mixers_under_zero3(trained_model(trainer.lightning_module, self.levels), zero.zero_stage)
        for i, lv in enumerate(self.levels):
            if lv.mlp_tiles > 1 and (why := refusal("mlp_tiles", zero, value=lv.mlp_tiles)):
                raise ConfigError(f"level {i} (pack_len {lv.pack_len}): {why}")
        self.config = without_idle_overlap(self.config, self.world_size, self._overlap_comm_asked)
        shards = sharding_note(self.world_size, zero) + overflow_note(self.config, self._overflow_check_asked)
        rank_zero_info(f"HBPStrategy levels: {self.describe_levels()}; ZeRO stage {zero.zero_stage}{shards}")
        _check_deepspeed_device(self.root_device)
        super().setup(trainer)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """DeepSpeed's ``zero.Init`` under ZeRO-3, with DeepSpeed's config registered for transformers:
        ``from_pretrained`` inside a module's ``configure_model`` then loads the checkpoint into the
        partitioned parameters (without it transformers fails, or loads nothing). DeepSpeed's linear, which
        ``zero.Init`` puts in torch for the process, is torch's own again at ``teardown``."""
        self._torch_linear = getattr(self, "_torch_linear", None) or torch.nn.functional.linear
        with super().model_sharded_context(), zero3_loading(self):
            yield

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            put_back_torch_linear(self.__dict__.pop("_torch_linear", None))

    def backward(
        self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Lightning already divided the loss by accumulate_grad_batches.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's checkpoint folder, written so that a kill at any moment leaves the previous save
        loadable (``lit_hbp.lightning.checkpoints.save_deepspeed``: a tag folder per save, ``latest`` last)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (no CheckpointIO is used)")
        save_deepspeed(self, checkpoint, filepath, exclude=("state_dict", "optimizer_states"))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """DeepSpeed's load, with the folder checked for what ``save_checkpoint`` writes (Lightning's
        check wants its fixed tag folder ``checkpoint``): ``latest`` naming a complete tag folder, saved by the
        ZeRO stage (3, or 0-2) loading it. A ZeRO-3 folder is loaded to train on only: DeepSpeed restores its
        partitioned weights through the optimizer, which a validation has not (its own load fails there)."""
        stage = deepspeed_zero(self.config)["zero_stage"]  # no section: stage 0
        check_zero_folder(checkpoint_path, stage, self.lightning_module.trainer.state.fn.value)
        with mock.patch("lightning.pytorch.strategies.deepspeed._validate_checkpoint_directory", _whole_folder):
            return super().load_checkpoint(checkpoint_path, weights_only)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``--trainer.strategy hbp`` (ZeRO-2), ``hbp_stage_1`` ... ``hbp_stage_3``, like DeepSpeed's names."""
        strategy_registry.register("hbp", cls, description="HBP: DeepSpeed ZeRO-2 with per-level SP", override=True)
        for stage in (0, 1, 2, 3):
            strategy_registry.register(
                f"hbp_stage_{stage}",
                cls,
                description=f"HBP with DeepSpeed ZeRO stage {stage}",
                stage=stage,
                override=True,
            )


HBPStrategy.register_strategies(StrategyRegistry)


class HBPDDPStrategy(LevelGroups, DDPStrategy):
    """torch's DDP with per-level sequence parallelism (Ulysses x context parallelism): every rank holds
    the whole model, its gradients and its optimizer states; the gradients are all-reduced over the world
    in DDP's buckets, overlapped with the backward.

    The fast path where ZeRO would shard nothing: on one device no DDP wrapper (no gradient hooks, no
    buckets), the module's fused AdamW and foreach clipping, so the optimizer step runs what a bare PyTorch
    loop runs (``bench/step_overhead.py``; docs/gpu.md). Use it when weights, gradients and fp32 Adam states
    fit on each device (16 bytes per parameter under bf16-mixed); ``HBPStrategy`` shards them.

    Args:
        levels: the HBP levels; by default those of the trainer's data module (HBPDataModule).
        timeout: how long a collective waits for the other ranks (10 minutes; see ``HBPStrategy``).
        Other arguments are DDPStrategy's (``find_unused_parameters=True`` for a model that leaves some
        trainable weights unused in a step: mixture-of-experts, a vision tower on a text-only pack;
        ``static_graph=True`` only without accumulation: DDP's static graph fails in ``no_sync``).
    """

    strategy_name = "hbp_ddp"

    def __init__(
        self,
        levels: list[Level | dict | str | int] | None = None,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
        **kwargs: Any,
    ):
        super().__init__(timeout=timeout, **kwargs)
        self.init_levels(levels)
        # On one device no DDP wrapper takes them: checked now, as DDP would on many.
        accepted = set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
        accepted -= {"self", "module"}
        unknown = sorted(set(self._ddp_kwargs) - accepted)
        if unknown:
            raise ConfigError(
                f"trainer.strategy (HBPDDPStrategy): {', '.join(map(repr, unknown))} is not an argument of torch's "
                f"DistributedDataParallel{did_you_mean(unknown[0], accepted)}"
            )

    def setup_distributed(self) -> None:
        _LIVE.add(self)  # its SP groups and process group released at exit (release_process_groups)
        super().setup_distributed()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DeepSpeed folder (``HBPStrategy``'s save) refused by name: torch's load stopped with IsADirectoryError."""
        if os.path.isdir(checkpoint_path):
            raise ConfigError(
                f"ckpt_path {checkpoint_path}: a DeepSpeed checkpoint folder (HBPStrategy's), which HBPDDPStrategy "
                "does not load: load it under HBPStrategy at the ZeRO stage that saved it, or export it (python -m "
                "lit_hbp.export CKPT OUT) and give model.model: OUT"
            )
        return super().load_checkpoint(checkpoint_path, weights_only)

    def setup(self, trainer: Trainer) -> None:
        self.levels = self.prepare_levels(trainer)
        how = f"DDP over {self.world_size} processes" if self.world_size > 1 else "one device"
        rank_zero_info(f"HBPDDPStrategy levels: {self.describe_levels()}; {how}")
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """One process reduces nothing: the module stays unwrapped (no DDP hooks nor buckets), unless a
        communication hook is given: it changes the gradients (fp16 compression rounds them)."""
        hooked = self._ddp_comm_hook is not None or self._ddp_comm_wrapper is not None
        if hooked and self.root_device.type != "cuda":
            raise ConfigError(
                f"trainer.strategy (HBPDDPStrategy): ddp_comm_hook runs on CUDA devices only (Lightning registers it "
                f"only there), not on {self.root_device.type}: remove it"
            )
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        if self.world_size > 1 and self._ddp_kwargs.get("static_graph") and accumulate > 1:
            raise ConfigError(  # Lightning accumulates in no_sync, which DDP's static graph fails on (internal assert)
                f"trainer.strategy (HBPDDPStrategy): static_graph=True with accumulate_grad_batches {accumulate}: "
                "torch's DDP cannot skip the reduction of accumulating micro-steps (no_sync) on a static graph; drop "
                "static_graph"
            )
        if self.world_size > 1 or hooked:
            super().configure_ddp()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``--trainer.strategy hbp_ddp``."""
        strategy_registry.register("hbp_ddp", cls, description="HBP: DDP (no sharding), per-level SP", override=True)


HBPDDPStrategy.register_strategies(StrategyRegistry)
