"""HBPCurriculum: train on short levels first, then on the full mix (the paper's curriculum)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.errors import ConfigError


class HBPCurriculum(L.Callback):
    """Put ``warmup_steps`` optimizer steps of the short levels at the start of training.

    Long steps are deferred, never dropped: the first epoch's plan moves short-level steps to the
    front and keeps every other step. ``short_levels`` are pack lengths (default: the levels with
    sp == 1). Works with any data module that has ``set_curriculum(warmup_steps, short_levels)``
    and a ``plan`` (HBPDataModule). Because the plan is deterministic, resuming from a checkpoint
    continues the same curriculum. Logs ``curriculum/warmup`` (1 during the warm-up, else 0).
    """

    def __init__(self, warmup_steps: int, short_levels: list[int] | None = None):
        if warmup_steps < 0:
            raise ConfigError(f"HBPCurriculum warmup_steps: must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.short_levels = short_levels
        self._announced = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if not callable(getattr(dm, "set_curriculum", None)):
            raise TypeError(
                "HBPCurriculum needs a data module with set_curriculum(warmup_steps, short_levels), such as "
                f"HBPDataModule; got {type(dm).__name__}"
            )
        dm.set_curriculum(self.warmup_steps, self.short_levels)

    def _warmup_length(self, trainer: L.Trainer) -> int:
        plan = trainer.datamodule.plan
        return plan.report["curriculum_moved"] if trainer.current_epoch == 0 else 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        moved = self._warmup_length(trainer)
        warm = trainer.current_epoch == 0 and batch_idx // trainer.accumulate_grad_batches < moved
        if not self._announced and trainer.current_epoch == 0 and (warm or batch_idx == 0):  # not past it on resume
            self._announced = True
            plan = trainer.datamodule.plan
            rank_zero_info(
                f"curriculum: {moved} of {self.warmup_steps} requested warm-up steps from levels "
                f"{plan.report['short_levels']} come first, then the full mix"
            )
        pl_module.log("curriculum/warmup", float(warm), batch_size=1)
