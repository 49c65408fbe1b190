"""The LightningModule of an existing project: a Hugging Face causal LM fine-tuned on chats.

Adopting lit-hbp changed a few lines of it: ``configure_model`` prepares the model for packs
(``prepare_model``), ``training_step`` and ``validation_step`` compute the packed loss (``packed_loss``).
"""

from __future__ import annotations

import lightning as L
import torch
from transformers import AutoModelForCausalLM

from lit_hbp import packed_loss, prepare_model


class ChatLM(L.LightningModule):
    def __init__(self, checkpoint: str, lr: float = 1e-5, weight_decay: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = prepare_model(AutoModelForCausalLM.from_pretrained(self.hparams.checkpoint))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        out = packed_loss(self.model, batch)  # batch: a lit_hbp.PackedBatch (this rank's shard under SP)
        self.log("train/ce", out.mean_ce(batch), batch_size=1)  # the whole pack's, over its SP group
        return out.loss

    def validation_step(self, batch, batch_idx: int) -> None:
        out = packed_loss(self.model, batch)
        # This rank's shard weighted by its supervised tokens: Lightning's mean over the validation's micro-batches
        # and ranks is then the token mean of the whole set (a pack with no supervised token weighs nothing).
        self.log("val/ce", out.ce_sum / max(out.n_targets, 1), batch_size=out.n_targets, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
