"""The LightningModule of an existing project: a Hugging Face causal LM fine-tuned on chats.

Adopting lit-hbp changed two lines of it: ``configure_model`` prepares the model for packs
(``prepare_model``) and ``training_step`` computes the packed loss (``packed_loss``).
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

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
