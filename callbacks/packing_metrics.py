"""PackingMetrics: log how well the epoch is packed, and which level every step trains."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_only


class PackingMetrics(L.Callback):
    """At each epoch start, log the plan's DBR, ABR, PR, CR, Ave-T, fill and the counts of steps,
    packs, empty completion packs, dropped, truncated and zero-length samples; at every step, log
    its level. Works with any data module exposing ``plan`` (a ``lit_hbp.packing.Plan``), and
    writes to every logger the trainer has."""

    def _plan(self, trainer: L.Trainer):
        plan = getattr(trainer.datamodule, "plan", None)
        if plan is None:
            raise TypeError(
                "PackingMetrics needs a data module with a `plan` attribute (a lit_hbp.packing.Plan); "
                f"got {type(trainer.datamodule).__name__}"
            )
        return plan

    @rank_zero_only
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plan = self._plan(trainer)
        metrics = {f"packing/{k}": float(v) for k, v in plan.metrics().items()}
        for name in ("dropped", "truncated", "zero_length", "zero_loss"):
            metrics[f"packing/{name}"] = float(getattr(plan, name).size)
        report = getattr(getattr(trainer.datamodule, "store", None), "report", None) or {}
        for name in ("dropped", "truncated", "truncated_to_nothing"):
            if name in report:
                metrics[f"data/{name}"] = float(len(report[name]))
        metrics["epoch"] = float(trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        plan = self._plan(trainer)
        step = min(batch_idx // trainer.accumulate_grad_batches, plan.n_steps - 1)
        pl_module.log("packing/level", float(plan.step_level[step]), batch_size=1)
