"""HBPLitModule: any Hugging Face causal LM trained on packed varlen micro-batches.

The model runs with the ``hbp_varlen`` attention (no padding, no T x T mask), the loss is a
chunked cross-entropy with the chosen normalizer (Ave-Token by default), and activation
checkpointing follows each batch's level: decoder layer i is checkpointed iff i < ckpt_layers.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from lit_hbp import attention
from lit_hbp.costmodel import ModelSpec
from lit_hbp.loss import NORMALIZERS, chunked_cross_entropy, token_weights


def build_causal_lm(model: str | dict, vocab_size: int | None = None):
    """A causal LM from a local checkpoint folder, or randomly initialized from a config mapping
    (``{"model_type": "llama", "hidden_size": ...}``). Uses the varlen attention and no KV cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model, dict):
        cfg = dict(model)
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            raise ValueError("a model config mapping needs a 'model_type' (e.g. 'llama', 'qwen2', 'mistral')")
        if vocab_size is not None:
            cfg["vocab_size"] = vocab_size
        config = AutoConfig.for_model(model_type, **cfg)
        config.use_cache = False
        net = AutoModelForCausalLM.from_config(config, attn_implementation=attention.ATTN_NAME)
    else:
        net = AutoModelForCausalLM.from_pretrained(
            model, attn_implementation=attention.ATTN_NAME, dtype=torch.get_default_dtype(), local_files_only=True
        )
        net.config.use_cache = False
        if vocab_size is not None and vocab_size > net.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but {model} embeds only "
                f"{net.get_input_embeddings().num_embeddings}: use the checkpoint's tokenizer"
            )
    return net


@contextlib.contextmanager
def _zero3_loading(trainer):
    """Under DeepSpeed ZeRO-3 the model is built inside ``deepspeed.zero.Init`` (parameters are
    partitioned as they are created), so ``from_pretrained`` must load the checkpoint the ZeRO-3
    way; transformers does when a DeepSpeed config is registered for the duration of the load."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if not getattr(strategy, "zero_stage_3", False):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    registered = HfDeepSpeedConfig(strategy.config)  # noqa: F841  (kept alive: transformers holds a weakref)
    try:
        yield
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def checkpoint_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers that support activation checkpointing, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in net.modules() if isinstance(m, GradientCheckpointingLayer)]


class HBPLitModule(L.LightningModule):
    """Train a causal LM on HBP micro-batches.

    Args:
        model: local checkpoint path, or a config mapping with ``model_type`` (random init).
        vocab_size: tokenizer size (linked from the data module); overrides a config's vocab_size.
        loss: ``ave_token`` (default) | ``token_mean`` | ``sample_mean`` | ``sum``.
        lr, weight_decay, betas: AdamW. Bias and norm weights are not decayed.
        warmup_steps: linear warm-up of the learning rate, then cosine decay to ``min_lr_ratio * lr``
            at the last optimizer step of the run.
        ce_chunk_size: supervised tokens per LM-head chunk of the cross-entropy.
        attn_backend: ``auto`` | ``flash_attn`` | ``torch_varlen`` | ``sdpa``.
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
    ):
        super().__init__()
        if loss not in NORMALIZERS:
            raise ValueError(f"loss must be one of {NORMALIZERS}, got {loss!r}")
        attention.set_backend(attn_backend)
        self.save_hyperparameters()
        self.model = None
        self._layers: list[torch.nn.Module] = []
        self._step_start = 0.0
        self._step_stats = torch.zeros(2)
        self._spec: ModelSpec | None = None
        self.flops_per_batch = 0.0  # this rank's model FLOPs of the current micro-batch (ThroughputMonitor)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with _zero3_loading(self._trainer):
            self.model = build_causal_lm(self.hparams.model, self.hparams.vocab_size)
        self._layers = checkpoint_layers(self.model)
        self._spec = ModelSpec.from_config(self.model.config.to_dict())
        for layer in self._layers:
            layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
            layer.gradient_checkpointing = False

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def set_checkpointing(self, ckpt_layers: int) -> None:
        """Checkpoint the first ``ckpt_layers`` decoder layers, run the rest normally."""
        if ckpt_layers > len(self._layers):
            raise ValueError(f"ckpt_layers {ckpt_layers} exceeds the model's {len(self._layers)} decoder layers")
        for i, layer in enumerate(self._layers):
            layer.gradient_checkpointing = i < ckpt_layers

    def on_fit_start(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        for i, lv in enumerate(getattr(dm, "levels", ())):
            if lv.ckpt_layers > self.num_layers:
                raise ValueError(
                    f"level {i} (pack_len {lv.pack_len}) checkpoints {lv.ckpt_layers} layers but the model has "
                    f"{self.num_layers} decoder layers"
                )

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weighted loss, summed CE, supervised tokens) of a micro-batch (or of this rank's SP shard)."""
        cu = batch["cu_seqlens"]
        hidden = self.model.get_decoder()(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=batch["max_seqlen"],
            max_length_k=batch["max_seqlen"],
            use_cache=False,
        ).last_hidden_state
        weights = token_weights(batch, self.hparams.loss)
        return chunked_cross_entropy(
            hidden[0],
            self.model.get_output_embeddings(),
            batch["labels"][0],
            weights[0],
            self.hparams.ce_chunk_size,
            getattr(self.model.config, "final_logit_softcapping", None),
        )

    def micro_batch_flops(self, batch: dict) -> float:
        """This rank's model FLOPs for ``batch`` (forward and backward, recomputation not counted,
        so FLOPs/s over peak is MFU): under SP a rank runs 1/sp of the pack's tokens through the dense
        layers and 1/sp of the heads over the whole pack; the LM head runs on its supervised tokens."""
        n = int(batch["n_tokens"])
        cu = np.asarray(batch["cu_seqlens"].tolist())
        lengths = np.diff(cu)[cu[1:] <= n].astype(np.float64)  # documents, not the padding segment
        head = int((batch["labels"] != -100).sum())
        return self._spec.train_flops(n, float((lengths**2).sum()), 0) / int(batch["sp"]) + self._spec.train_flops(
            0, 0, head
        )

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self.set_checkpointing(int(batch["ckpt_layers"]))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.flops_per_batch = self.micro_batch_flops(batch)
        self._step_start = time.perf_counter()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, ce_sum, n = self(batch)
        # train/loss: token-mean CE over all ranks and micro-steps of the optimizer step so far, so
        # the value logged at a step is that step's loss (an SP shard or an empty completion pack
        # alone may hold no supervised token).
        stats = torch.stack([ce_sum.detach().float(), torch.tensor(float(n), device=ce_sum.device)])
        if self.trainer.world_size > 1:
            stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        if batch_idx % self.trainer.accumulate_grad_batches == 0 or self._step_stats.device != stats.device:
            self._step_stats = torch.zeros_like(stats)
        self._step_stats = self._step_stats + stats
        if self._step_stats[1] > 0:
            self.log("train/loss", self._step_stats[0] / self._step_stats[1], prog_bar=True, batch_size=1)
        for key, value in (
            ("level", batch["level"]),
            ("sp", batch["sp"]),
            ("ckpt_layers", batch["ckpt_layers"]),
            ("supervised_tokens", batch["n_targets"]),
            ("tokens", batch["n_tokens"]),
        ):
            self.log(f"train/{key}", float(value), batch_size=1)
        return loss

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._step_start
        level = int(batch["level"])
        self.log(f"time/level{level}_micro_step_s", seconds, batch_size=1)
        tokens = batch["n_tokens"] / batch["sp"]  # this rank's share of the pack's real tokens
        self.log(f"time/level{level}_tokens_per_s_per_device", tokens / seconds, batch_size=1)

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 partitions parameters into 1-D shards
                (no_decay if len(shape) < 2 or "norm" in name.lower() else decay).append(p)
        groups = [dict(params=decay, weight_decay=hp.weight_decay), dict(params=no_decay, weight_decay=0.0)]
        groups = [g for g in groups if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(hp.warmup_steps, total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = (step - warmup) / max(total - warmup, 1)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
