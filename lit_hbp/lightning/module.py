"""HBPLitModule: any Hugging Face causal LM trained on packed varlen micro-batches.

The model runs with the ``hbp_varlen`` attention (no padding, no T x T mask), the loss is a
chunked cross-entropy with the chosen normalizer (Ave-Token by default), and activation
checkpointing follows each batch's level: decoder layer i is checkpointed iff i < ckpt_layers.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.memory import not_fitting, trainer_cost
from lit_hbp.cost.run_settings import check, local_hardware, trainer_settings
from lit_hbp.data.batch import PackedBatch
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.meter import (
    MicroStepEnd,
    StepMeter,
    forget_last_window,
    logs_by_schedule,
    logs_now,
    monitored_now,
)
from lit_hbp.lightning.optimizer import (
    adamw_kind,
    check_deepspeed_accumulation,
    check_optimizer_settings,
    clips_scaled_gradients,
    clips_whole_gradients,
    decay_groups,
    grad_norm,
    optimizer_device,
    saved_group_sizes,
    zero_engine,
)
from lit_hbp.lightning.recompile import DYNAMO_LOG, RECOMPILE_LIMIT, RecompileLimitWatch, set_recompile_limit
from lit_hbp.lightning.refused_callbacks import check_callbacks, check_started_callbacks
from lit_hbp.lightning.resume_checks import (
    TRAINER_SETTINGS,
    check_resumed_fit,
    check_same_records,
    fit_held_out,
    kept_trainer_settings,
)
from lit_hbp.lightning.schedule import LR_SCHEDULE, long_warmup, lr_factor, run_steps, schedule_moved, take_schedule_now
from lit_hbp.model import attention
from lit_hbp.model.build import (
    apply_liger,
    base_of,
    build_causal_lm,
    check_lora,
    freeze_vision,
    own_generation_config,
    saved_dtype,
    train_lora,
    zero3_loading,
)
from lit_hbp.model.causal_lm import PackedLoss, decoder_layers, model_spec, packed_loss, prepare_model
from lit_hbp.model.checks import check_model_source, check_module_positions
from lit_hbp.model.loss import NORMALIZERS
from lit_hbp.model.packed_call import pack_scope
from lit_hbp.model.param_counts import wrapped_lora
from lit_hbp.model.vision import encoder_parameters, vision_tower
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.levels import Level


def device_memory(device: torch.device) -> float | None:
    """Bytes of a GPU's memory, what ``fit`` checks each level's predicted peak against (None off GPUs:
    a CPU run shares the host's memory with everything else)."""
    if device.type != "cuda":
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _require_packed(batch: Any) -> None:
    if not isinstance(batch, PackedBatch):
        raise TypeError(
            f"HBPLitModule trains on PackedBatch micro-batches (HBPDataModule's, or lit_hbp.pack_samples as the "
            f"collate_fn of your own DataLoader), got {type(batch).__name__}"
        )


ITER_REFUSED = "Lightning then hands the batch hooks no batch: take it (training_step(self, batch, batch_idx))"


def _setting(key: str, apply, *args):
    """``apply(*args)``, its refusal (what this model or machine cannot do) a ``ConfigError`` naming ``key``."""
    try:
        return apply(*args)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


class HBPLitModule(L.LightningModule):
    """Train a causal LM on HBP micro-batches.

    Args:
        model: local checkpoint path, or a config mapping with ``model_type`` (random init).
        vocab_size: tokenizer size (linked from the data module): a config mapping's own is kept if not fewer.
        loss: ``ave_token`` (default) | ``token_mean`` | ``sample_mean`` | ``sum``.
        lr, weight_decay, betas: AdamW, torch's fused kernel when every trainable parameter is on CUDA
            (``adamw_kind``; its multi-tensor one where Lightning's mixed precision clips the gradients, which the
            fused kernel refuses). Biases, norm weights and vectors are not decayed (``optimizer.decay_groups``).
        warmup_steps: linear warm-up of the learning rate, then cosine to ``min_lr_ratio * lr`` at the run's end.
        ce_chunk_size: supervised tokens per LM-head chunk of the cross-entropy.
        attn_backend: ``auto`` (the fastest that runs, per device, dtype and feature) or a name of
            ``lit_hbp.model.attention.backends.REGISTRY``: ``flash_attn_3``, ``flash_attn_4``,
            ``flash_attn``, ``torch_varlen``, ``flex``, ``sdpa``, ``eager``.
        compile: ``torch.compile`` each decoder layer, dynamic over pack lengths (off by default:
            the first steps of each level pay the compilation). Recompilations are logged and
            bounded (``RECOMPILE_LIMIT``): a layer that reaches the bound runs uncompiled from then on,
            and the run says so (``RecompileLimitWatch``); per-document attention loops stay uncompiled.
        self_check: at the start of fit, check that this model trains a pack of short documents
            exactly as it trains them one by one, at every level's SP degree (``lit_hbp.model.selfcheck``;
            a few forward/backward passes); refuse to train otherwise. On by default.
        lora: train LoRA adapters (peft) instead of the full model, e.g. ``{rank: 16, alpha: 32,
            dropout: 0.05, target_modules: all-linear, modules_to_save: [lm_head]}`` (other
            ``peft.LoraConfig`` fields by their own names); what is not given is peft's default (rank 8,
            alpha 8, dropout 0, no modules to save) but ``target_modules``: all-linear. Only the
            adapters (and the modules to save) get gradients and optimizer states; every level's SP degree,
            checkpointing and ZeRO stage work as for full fine-tuning. Export writes the adapter, or merged weights.
        liger: Liger kernels on a CUDA GPU (``pip install lit-hbp[gpu]``): RMSNorm, RoPE and SwiGLU
            of the model family where Liger has them (applied before LoRA wraps the model), and the
            fused linear cross-entropy in place of the chunked one, the LM head's gradient
            accumulated in fp32 (not for ``sample_mean``, whose weights differ per token, nor for an LM head
            an adapter wraps, both said, nor under ZeRO-3, which partitions the LM head's weight). Refused
            before the data is read on the CPU. Liger's loss reads two values on the
            host per micro-step (docs/design.md section 11). Off by default.
        freeze_vision: a vision-language model's image encoder keeps its weights (its projector and
            language model train); refused for a text-only model. Off by default: the tower trains.
            LoRA on a vision-language model targets its language model's linear layers by default.
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        vocab_size: int | None = None,
        loss: str = "ave_token",
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        ce_chunk_size: int = 1024,
        attn_backend: str = "auto",
        compile: bool = False,
        liger: bool = False,
        self_check: bool = True,
        lora: dict[str, Any] | None = None,
        freeze_vision: bool = False,
    ):
        super().__init__()
        if loss not in NORMALIZERS:
            raise ConfigError(f"model.loss must be one of {NORMALIZERS}, got {loss!r}")
        check_optimizer_settings(lr, weight_decay, betas, warmup_steps, min_lr_ratio, ce_chunk_size)
        check_model_source(model, "model")
        try:
            attention.check_backend(attn_backend)
        except ValueError as e:
            raise ConfigError(f"model.attn_backend: {e}") from None
        if lora is not None:
            check_lora(lora, "model.lora")
        self.save_hyperparameters()
        self.model = None
        self._layers: list[torch.nn.Module] = []
        self._spec: ModelSpec | None = None
        self._meter = StepMeter()
        self._grad_norm: torch.Tensor | None = None  # this optimizer step's, on logging steps (not ZeRO)
        self._step_lr: float | None = None  # the learning rate this optimizer step took, on logging steps
        self.flops_per_batch: float | None = None  # this rank's model FLOPs of the micro-batch (ThroughputMonitor)
        self._recompile_limit: int | None = None  # dynamo's, before configure_model raised it for compile
        self._recompile_watch: RecompileLimitWatch | None = None
        self._schedule: dict | None = None  # this run's learning-rate schedule (optimizer steps, warm-up)
        self._resumed_schedule: dict | None = None  # the one the checkpoint a run resumes from followed
        self._fit_held_out: dict | None = None  # the records its weights' fit held out (``check_same_records``)
        self._resumed_step = 0

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with zero3_loading(getattr(self._trainer, "strategy", None) if self._trainer is not None else None):
            self.model = build_causal_lm(self.hparams.model, self.hparams.vocab_size, self._tokenizer())
        # from_pretrained returns a model in eval mode, which Lightning keeps: a checkpoint folder would train
        # without dropout and activation checkpointing (transformers checkpoints a layer only in training mode).
        self.model.train()
        check_module_positions(self)  # max_position_embeddings vs the largest level
        self._layers = decoder_layers(prepare_model(self.model, attn_backend=self.hparams.attn_backend))
        try:
            self._spec = model_spec(self.model, self._layers)
        except ValueError as e:
            rank_zero_warn(f"model FLOPs unknown, MFU and FLOP/s are not logged: {e}")
        if self.hparams.liger:  # before peft wraps the model: Liger resolves the family's own modules
            _setting("model.liger", apply_liger, self.model)
        if self.hparams.freeze_vision:
            _setting("model.freeze_vision", freeze_vision, self.model)
        if self.hparams.lora:
            stage3 = getattr(getattr(self._trainer, "strategy", None), "zero_stage_3", False)
            self.model = train_lora(self.model, self.hparams.lora, stage3, not isinstance(self.hparams.model, str))
        if self.hparams.compile:
            self._recompile_limit = set_recompile_limit(RECOMPILE_LIMIT)
            self._recompile_watch = RecompileLimitWatch()
            logging.getLogger(DYNAMO_LOG).addFilter(self._recompile_watch)
            for layer in self._layers:
                layer.compile(dynamic=True)

    def teardown(self, stage: str) -> None:
        """Dynamo's recompile limit as it was before this module's compiled run (a later run in the process
        starts from torch's own), its logger without this run's watch."""
        if self._recompile_limit is not None:
            torch._dynamo.config.recompile_limit = self._recompile_limit
            self._recompile_limit = None
        if self._recompile_watch is not None:
            logging.getLogger(DYNAMO_LOG).removeFilter(self._recompile_watch)
            self._recompile_watch = None

    def _tokenizer(self):
        """The data module's tokenizer, when the trainer has one: a model built from a config mapping
        takes its special token ids (BOS, EOS, padding) from it."""
        return getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None)

    @property
    def base_model(self) -> torch.nn.Module:
        """The Hugging Face model itself (under LoRA: the model peft wraps)."""
        return base_of(self.model)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The model's config travels with its weights, so export needs nothing but the checkpoint (the run's folder
        may be gone): ``hf_config``, the dtype its base was saved in (``hf_saved_dtype``: the export's), and the
        model folder's own generation config (sampling defaults, every EOS id) as ``hf_generation_config`` (its
        non-default fields; without one the export rebuilds it from the config and tokenizer); the trainer's clipping
        and precision (``kept_trainer_settings``), which a resume that changes them says."""
        net = self.base_model
        checkpoint["hf_config"], checkpoint["hf_saved_dtype"] = net.config.to_dict(), saved_dtype(net)
        if self._schedule is not None:
            checkpoint[LR_SCHEDULE] = dict(self._schedule)
        if self._trainer is not None:
            checkpoint[TRAINER_SETTINGS] = kept_trainer_settings(self._trainer)
        generation = getattr(net, "generation_config", None)
        if generation is not None and own_generation_config(generation, net.config):
            checkpoint["hf_generation_config"] = generation.to_diff_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The learning-rate schedule the checkpoint's run followed, which the resumed run must follow (a
        checkpoint written before lit-hbp saved it holds none). A fit resumed with module arguments other than its
        checkpoint's (a DeepSpeed folder, ``last``, SLURM's requeue, a project's own ``Trainer.fit``: what no command
        line read first), or whose model folder now builds another config, is refused (``check_resumed_fit``)."""
        if self._trainer is not None and self.trainer.state.fn == "fit":  # also a restore no command line read first
            check_resumed_fit(self.hparams, checkpoint, self.base_model.config.to_dict(), self.trainer)
        self._resumed_schedule, self._fit_held_out = checkpoint.get(LR_SCHEDULE), fit_held_out(checkpoint)
        self._resumed_step = int(checkpoint.get("global_step", 0))
        self._say_schedule()

    def _say_schedule(self) -> None:
        """Said once both schedules are known: Lightning loads the checkpoint before ``configure_optimizers``, or
        after it under DeepSpeed (``schedule_moved``)."""
        hp = self.hparams
        said = schedule_moved(self._resumed_schedule, self._schedule, self._resumed_step, hp.lr, hp.min_lr_ratio)
        if said is not None:
            rank_zero_warn(said)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def on_train_start(self) -> None:  # (each module's train or eval mode is kept, as Lightning keeps it)
        if self._schedule is not None and self._resumed_schedule not in (None, self._schedule):
            take_schedule_now(self.lr_schedulers())  # the new schedule's rate from the resumed step on

    def on_fit_start(self) -> None:
        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

        for hook in ("training_step", "validation_step"):
            if is_param_in_hook_signature(getattr(self, hook), "dataloader_iter", explicit=True):
                raise ConfigError(f"{type(self).__name__}.{hook}(dataloader_iter): {ITER_REFUSED}")
        check_started_callbacks(self, self.trainer)
        dm = getattr(self.trainer, "datamodule", None)
        self._fit_held_out = getattr(dm, "held_out", None)  # what a later validation of these weights must hold out
        levels = tuple(getattr(dm, "levels", None) or ())
        for i, lv in enumerate(levels):
            if lv.ckpt_layers > self.num_layers:
                raise ConfigError(
                    f"data.levels: level {i} (pack_len {lv.pack_len}) checkpoints {lv.ckpt_layers} layers but the "
                    f"model has {self.num_layers} decoder layers"
                )
        strategy = self.trainer.strategy
        check_deepspeed_accumulation(strategy, self.trainer.accumulate_grad_batches)
        groups = getattr(strategy, "sp_groups", None)
        for i, lv in enumerate(levels):
            if lv.sp > 1 and groups is None:
                raise ConfigError(
                    f"data.levels: level {i} (pack_len {lv.pack_len}) uses sequence parallelism {lv.sp}, which "
                    f"{type(strategy).__name__} cannot run: train with lit_hbp.lightning.strategy.HBPStrategy"
                )
        if getattr(getattr(dm, "store", None), "has_media", False):
            self._check_media_family()
        if getattr(strategy, "zero_stage_3", False) and getattr(getattr(dm, "store", None), "has_media", False):
            raise ConfigError(
                "trainer.strategy: HBPStrategy(stage=3) with samples that have images: ZeRO-3 gathers a module's "
                "weights when its forward runs, but the vision tower runs only on ranks whose pack holds images, "
                "and some families use weights outside any forward (LLaVA-NeXT's image_newline); train "
                "vision-language data with stage 2 (or offload the optimizer: offload_optimizer=True)"
            )
        tiles = max((lv.mlp_tiles for lv in levels), default=1)
        check(trainer_settings(self.trainer, local_hardware(self.device), liger=self.hparams.liger), tiles=tiles)
        if tiles > 1:  # a model without token-wise MLPs refuses now, not at the first long step
            with pack_scope(self.model, tiles=tiles):
                pass
        capacity = device_memory(self.device)
        if capacity and levels and self._spec is not None:
            for line in not_fitting(*self.cost_model(capacity)):
                rank_zero_warn(f"{line} (python -m lit_hbp.cost.memory prints every level's parts)")
        if self.hparams.self_check:
            from lit_hbp.model.selfcheck import layout_name, run_self_check

            layouts = getattr(strategy, "levels", None) or levels  # the strategy's carry resolved layouts
            degrees = sorted({(lv.sp, lv.layout[1]) for lv in layouts} | {(1, 1)})
            media_docs = dm.self_check_samples() if hasattr(dm, "self_check_samples") else []
            errors = run_self_check(
                self,
                degrees,
                groups,
                self.trainer.precision_plugin.forward_context,
                max(lv.pack_len for lv in levels) if levels else None,
                media_docs,
            )
            if getattr(strategy, "zero_stage_3", False):
                # Modules whose inputs need no gradient (a frozen embedding under LoRA) keep their
                # gathered weights after a backward outside the engine: partition them again.
                strategy.deepspeed_engine.empty_partition_cache()
            kinds = [k for k, key in (("images", "pixel_values"), ("videos", "pixel_values_videos"))
                     if any(key in mm for _, mm in media_docs)]  # fmt: skip
            images = f", {len(media_docs)} of them with {' or '.join(kinds)}" if media_docs else ""
            rank_zero_info(
                f"self-check passed (a pack equals its documents alone{images}): "
                + ", ".join(
                    f"{layout_name(key)}: loss {e.loss:.1e}, input gradients {e.grads:.1e}, leak {e.leak:.0e}"
                    + (f", {e.left_out} document(s) left out: a token's experts tied by rounding" if e.left_out else "")
                    for key, e in errors.items()
                )
            )

    def _check_media_family(self) -> None:
        """A run whose data has images or videos, on a family that cannot pack them, stops here (exit 2)
        with the family's reason, not at its first step with images."""
        from lit_hbp.model.packed_call import record_of
        from lit_hbp.model.vision import check_encoder_outputs, refuse_batch_statistics, refuse_bidirectional

        net = self.base_model
        try:
            refuse_bidirectional(net, {"pixel_values": torch.ones(1)})
            refuse_batch_statistics(net, {"pixel_values": torch.ones(1)}, trained=True)
            check_encoder_outputs(record_of(net).runner)
        except ValueError as e:
            raise ConfigError(f"model.model: the data has images or videos, and {e}") from None

    def forward(self, batch: PackedBatch) -> PackedLoss:
        """(weighted loss, summed CE, supervised tokens) of a micro-batch (or of this rank's SP shard);
        the router's load-balancing loss is added when the model's config asks for it."""
        return self.packed_loss(batch)

    def packed_loss(
        self,
        batch: PackedBatch,
        weights: float | torch.Tensor | None = None,
        router_loss: bool = True,
        recompute: bool = True,
    ) -> PackedLoss:
        """``lit_hbp.packed_loss`` of ``batch`` with this module's normalizer and settings (or ``weights``:
        one number, or one per position of the shard); ``recompute=False`` keeps the LM head's logits
        instead of recomputing them (the self-check, whose backward runs outside the DeepSpeed engine)."""
        _require_packed(batch)
        hp = self.hparams
        return packed_loss(
            self.model, batch, hp.loss if weights is None else None, weights=weights,
            ce_chunk_size=hp.ce_chunk_size, liger=hp.liger, router_loss=router_loss, recompute=recompute,
        )  # fmt: skip

    def micro_batch_flops(self, batch: PackedBatch, forward_only: bool = False) -> float | None:
        """This rank's model FLOPs for ``batch`` (forward and backward, recomputation not counted, so FLOPs/s over
        peak is MFU; ``forward_only``: a validation batch's, a third): under SP a rank runs 1/sp of the pack's tokens
        through the dense layers and 1/sp of the heads over the whole pack; the LM head runs on its supervised
        tokens. From the collate step's host counts (nothing read from the device); None for an unknown shape."""
        if self._spec is None:
            return None
        head = batch.target_index.shape[0]
        full = forward_only or not self.hparams.lora  # LoRA runs no weight gradients of the frozen matmuls
        dense = self._spec.train_flops(batch.n_tokens, batch.attention_sq(self._spec), 0, full)
        flops = dense / int(batch.sp) + self._spec.train_flops(0, 0, head, full)
        return flops / 3.0 if forward_only else flops

    def on_train_batch_start(self, batch: PackedBatch, batch_idx: int) -> None:
        _require_packed(batch)
        self.flops_per_batch = self.micro_batch_flops(batch)
        if self.trainer.log_every_n_steps:  # else (barebones) nothing is ever logged: no time kept per micro-step
            self._meter.start(batch.input_ids.device)

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        loss, ce_sum, n = self(batch)
        self._meter.add_loss(ce_sum, n)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """At the optimizer steps whose metrics the loggers write, the global L2 norm of the gradients before
        clipping (Lightning clips after this hook), from the trainable parameters' ``.grad`` (under DDP or ZeRO
        stage 0 after the all-reduce, a loss scale divided out), kept on the device for ``train/grad_norm``.
        Under ZeRO 1-3 (partitioned gradients) the engine's own norm is read after its step. Nothing elsewhere."""
        self._grad_norm = None
        self._step_lr = None
        if not (logs_now(self.trainer) or monitored_now(self.trainer)):
            return
        # The learning rate this step takes: Lightning steps the scheduler before on_train_batch_end.
        self._step_lr = float(optimizer.param_groups[0]["lr"])
        if zero_engine(self.trainer.strategy) is not None:
            return
        # The model's own gradients: under DeepSpeed's stage-0 fp16/bf16 optimizers the optimizer's
        # parameters are fp32 master copies whose gradients are set only inside its step.
        norm = grad_norm([p.grad for p in self.model.parameters() if p.requires_grad and p.grad is not None])
        if norm is None:
            return
        # Gradients still loss-scaled here: DeepSpeed's fp16 optimizers (stage 0), and torch's GradScaler
        # with an optimizer that unscales in its own step (fused AdamW), which Lightning leaves scaled.
        scale = getattr(optimizer, "loss_scale", None)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scale = scaler.get_scale()  # a host read, at a logging step only
        if isinstance(scale, (int, float)) and scale not in (0, 1):
            norm = norm / scale
        self._grad_norm = norm

    def _logged_grad_norm(self) -> torch.Tensor | None:
        """``train/grad_norm`` of this optimizer step (a logging one): under ZeRO the engine's global
        norm before clipping (DeepSpeed 0.19: a device tensor, unscaled, the same on every rank;
        ``inf`` after an fp16 overflow; None with ``compute_grad_norm: false``), else what
        ``on_before_optimizer_step`` computed."""
        engine = zero_engine(self.trainer.strategy)
        norm, self._grad_norm = self._grad_norm, None
        if engine is not None:
            norm = engine.get_global_grad_norm()
            if norm is not None and not isinstance(norm, torch.Tensor):
                norm = torch.tensor(float(norm))
        return None if norm is None else norm.detach().float()

    def configure_callbacks(self) -> list[L.Callback]:
        """``MicroStepEnd`` (``end_micro_step`` first); a subclass's keeps it with ``super().configure_callbacks()``.
        Before any set-up: the callbacks a fit cannot serve are refused (``refused_callbacks``)."""
        if self.trainer.state.fn == "fit":
            check_callbacks(self.trainer, built=self.model is not None)
        return [MicroStepEnd()]

    def on_train_batch_end(self, outputs: Any, batch: PackedBatch, batch_idx: int) -> None:
        self.end_micro_step(batch)  # again after the callbacks: one of them may have asked the run to stop

    def end_micro_step(self, batch: PackedBatch) -> None:
        """The micro-step's clock stopped and, at a step the loggers write, its metrics logged, first of the callbacks
        (``MicroStepEnd``): a ``ModelCheckpoint`` of ``train/loss`` ranks this step's, as a ``training_step`` log."""
        self._meter.stop(int(batch.level), batch.n_tokens / batch.sp)  # once a micro-step: a second finds no start
        micro_step = self.trainer.fit_loop.epoch_loop.total_batch_idx
        ends = not self.trainer.fit_loop._should_accumulate()
        self._meter.count(micro_step, batch.n_tokens, batch.n_targets, ends)
        reduce = partial(self.trainer.strategy.reduce, reduce_op="sum") if self.trainer.world_size > 1 else None
        if self._meter.logged_at == micro_step or not logs_now(self.trainer):
            if monitored_now(self.trainer) and micro_step not in (self._meter.logged_at, self._meter.monitored_at):
                self._meter.monitored_at = micro_step  # the window so far, counted again where the loggers write
                forget_last_window(self.trainer)
                self._log_window(self._meter.read_loss(reduce, keep=True))
            return
        self._meter.logged_at = micro_step
        forget_last_window(self.trainer)
        # The step's plan fields and this rank's counts, at the steps the loggers write (a value logged at another step
        # would never be written), as host tensors: Lightning would copy a Python number to the device.
        for key, value in (
            ("level", batch.level),
            ("sp", batch.sp),
            ("ckpt_layers", batch.ckpt_layers),
            ("supervised_tokens", self._meter.step_targets),
            ("tokens", self._meter.step_tokens),
        ):
            self.log(f"train/{key}", torch.tensor(float(value)), batch_size=1)
        # train/loss: token-mean CE over every rank and micro-step since the last logged step.
        stops = self.trainer.should_stop and self.trainer.fit_loop._can_stop_early  # (not held by min_steps)
        self._log_window(self._meter.read_loss(reduce, keep=stops and not logs_by_schedule(self.trainer)))
        # The learning rate the step took (a host value, read before the scheduler stepped), as Lightning's
        # LearningRateMonitor reports it; the optimizer's own when no step ran.
        lr = self._step_lr
        if lr is None:
            optimizer = self.optimizers(use_pl_optimizer=False)
            lr = (optimizer[0] if isinstance(optimizer, list) else optimizer).param_groups[0]["lr"]
        self.log("train/lr", torch.tensor(float(lr)), batch_size=1)
        for level, (seconds, tokens, count) in self._meter.read_times().items():
            self.log(f"time/level{level}_micro_step_s", torch.tensor(seconds / count), batch_size=1)
            if seconds > 0:
                self.log(f"time/level{level}_tokens_per_s_per_device", torch.tensor(tokens / seconds), batch_size=1)

    def _log_window(self, loss: float | None) -> None:
        """``train/loss`` and the global gradient L2 norm before clipping (a device tensor, read when logged)."""
        if loss is not None:
            self.log("train/loss", torch.tensor(loss), prog_bar=True, batch_size=1)
        norm = self._logged_grad_norm()
        if norm is not None:
            self.log("train/grad_norm", norm, batch_size=1)

    def on_validation_epoch_start(self) -> None:
        if self.trainer.state.fn == "validate":  # weights loaded by load_from_checkpoint too: no data state restored
            check_same_records(self._fit_held_out, getattr(self.trainer.datamodule, "held_out", None))
        self._val_ce: torch.Tensor | float = 0.0
        self._val_targets = 0

    def on_validation_batch_start(self, batch: PackedBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        _require_packed(batch)
        self.flops_per_batch = self.micro_batch_flops(batch, forward_only=True)  # the throughput monitor's

    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        _, ce_sum, n = self(batch)
        self._val_ce = self._val_ce + ce_sum
        self._val_targets += n

    def on_validation_epoch_end(self) -> None:
        """val/loss: the token mean of the cross-entropy over the whole validation set (summed
        cross-entropy and supervised tokens added over every rank and micro-batch), and val/ppl."""
        device = self.device
        totals = torch.stack([torch.as_tensor(self._val_ce, device=device, dtype=torch.float64).reshape(()),
                              torch.tensor(float(self._val_targets), device=device, dtype=torch.float64)])  # fmt: skip
        if self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        ce, targets = totals.tolist()
        if targets > 0:  # the same value on every rank: sync_dist's mean keeps it, and says so to Lightning
            loss = ce / targets
            self.log("val/loss", loss, prog_bar=True, batch_size=1, sync_dist=True)
            self.log("val/ppl", math.exp(min(loss, 50.0)), batch_size=1, sync_dist=True)

    def cost_model(self, capacity: float) -> tuple[CostModel, list[Level]]:
        """The memory model of this run as its trainer set it up, on devices of ``capacity`` bytes:
        ``(CostModel, levels as laid out)``; ``lit_hbp.cost.memory.level_memory`` gives each level's parts."""
        half = any(p in str(self.trainer.precision) for p in ("16", "bf16"))
        dtype_bytes = 2 if half else next(self.model.parameters()).element_size()
        tower = vision_tower(base_of(self.model))
        in_tower = set() if tower is None else {id(p) for p in tower.parameters()}
        trained = tower is not None and any(p.requires_grad for p in encoder_parameters(tower))
        params = [p for p in self.model.parameters() if id(p) not in in_tower]  # the tower's: ``trained``
        trainable = sum(p.numel() for p in params if p.requires_grad) / max(sum(p.numel() for p in params), 1)
        hp = self.hparams
        counted = wrapped_lora(self.model, self._spec) if hp.lora else dict(trainable=trainable, added_params=0.0)
        return trainer_cost(
            self.trainer, self._spec, hp.liger, hp.ce_chunk_size, dtype_bytes, capacity, vision_trained=trained,
            compiled=bool(hp.compile), **counted,
        )  # fmt: skip

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clipping by norm where nothing scales the gradients (fp32, bf16) and every rank holds whole
        gradients (one device, DDP; not DeepSpeed, which clips in its own step, nor a sharding strategy,
        whose norm is over shards): ``clip_grad_norm_`` with torch's multi-tensor kernels, the norm left
        on the device (Lightning's own clips tensor by tensor off CUDA, and refuses the fused AdamW under
        bf16 though bf16 has no loss scale to undo). Otherwise Lightning's. <= 0 clips nothing, as in Lightning."""
        if clips_whole_gradients(self.trainer, gradient_clip_val, gradient_clip_algorithm):
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = decay_groups(self.model, hp.weight_decay, saved_group_sizes(self._trainer))
        device = optimizer_device(self.trainer.strategy) if self._trainer is not None else None
        kind = adamw_kind([p for g in groups for p in g["params"]], device)
        why = ""
        if kind == "fused" and self._trainer is not None and clips_scaled_gradients(self.trainer):
            kind = "foreach"
            why = ": the fused kernel unscales inside its step, where Lightning's fp16 loss scaling cannot clip"
        rank_zero_info(f"optimizer: AdamW ({kind}{why})")
        fused, foreach = (True, None) if kind == "fused" else (None, True)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), fused=fused, foreach=foreach)
        total = max(int(run_steps(self.trainer)), 1)
        warmup = hp.warmup_steps  # longer than the run: the rate rises all run, as the setting says
        if (said := long_warmup(warmup, total, hp.lr)) is not None:
            rank_zero_warn(said)
        self._schedule = {"total": total, "warmup": warmup}
        self._say_schedule()
        schedule = partial(lr_factor, total=total, warmup=warmup, min_ratio=hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
