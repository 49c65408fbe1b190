"""PackingMetrics: log how well the epoch is packed, and which level every step trains."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.cost.run_settings import Settings, cost_model, trainer_settings
from lit_hbp.errors import ConfigError, did_you_mean
from lit_hbp.model_spec import ModelSpec


class PackingMetrics(L.Callback):
    """At each epoch start, log the plan's DBR, ABR, PR, CR, Ave-T, fill and the counts of steps,
    packs, empty completion packs, dropped, truncated and zero-length samples; at every step, log
    its level, and for a context-parallel micro-batch ``packing/cp_area_imbalance``: the largest
    causal attention area of its CP ranks over their mean (the ABR inside the SP group). Works
    with any data module exposing ``plan`` (a ``lit_hbp.packing.Plan``), and writes to every
    logger the trainer has.

    Drop counts (sample occurrences of the epoch: a record of a source with repeat 2 counts twice):
        ``packing/dropped`` / ``packing/truncated``: every over-length sample of the epoch left out /
        cut, whoever did it: the data module before planning (its ``store.report``, when it has one)
        plus the planner (``plan.dropped`` / ``plan.truncated``). HBPDataModule applies
        ``over_length`` itself and plans what is left, so there these equal the ``data/`` keys.
        ``data/dropped``, ``data/truncated``, ``data/truncated_to_nothing``: the data module's part
        alone (truncated_to_nothing: cut, then removed for having no supervised token left), and
        ``data/<name>_distinct``: the distinct records among them.

    figures: also log, at each epoch start on rank zero, two figures of the epoch's plan to every
        logger whose ``experiment`` has ``add_figure`` (TensorBoard; other loggers are skipped):
        "packing/length_histogram", the sample lengths coloured by the level that packs them, and
        "packing/timeline", per-rank timelines of a few micro-steps priced with the analytic cost
        model of the trained model's run (``run_settings.cost_model``) on ``hardware``, which shows the idle
        time and SP communication the plan would cost on such a cluster. Its times are simulated,
        not measured on the devices of this run, and its titles say so. The model's shape comes from
        ``pl_module.model.config`` (a Hugging Face config); without one only the histogram is logged.
    hardware: the cost model's GPU preset for the timeline, a key of ``lit_hbp.cost.hardware.HARDWARE``.
    """

    def __init__(self, figures: bool = False, hardware: str = "h100") -> None:
        if hardware not in HARDWARE:
            raise ConfigError(
                f"PackingMetrics hardware: unknown {hardware!r}{did_you_mean(hardware, HARDWARE)}, choose one of "
                f"{sorted(HARDWARE)}"
            )
        self.figures = figures
        self.hardware = hardware

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
                metrics[f"data/{name}_distinct"] = float(report.get(f"{name}_distinct", len(set(report[name]))))
        # The epoch's over-length samples, whether the data module or the planner handled them.
        for name in ("dropped", "truncated"):
            metrics[f"packing/{name}"] += metrics.get(f"data/{name}", 0.0)
        metrics["epoch"] = float(trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if self.figures:
            self._log_figures(trainer, pl_module, plan)

    def _log_figures(self, trainer: L.Trainer, pl_module: L.LightningModule, plan) -> None:
        writers = [w for w in (getattr(lg, "experiment", None) for lg in trainer.loggers) if hasattr(w, "add_figure")]
        if not writers:
            return
        # Imported here: matplotlib and the simulator are only needed when figures are asked for.
        from lit_hbp.simulate.plots import length_histogram_figure

        figures = {"packing/length_histogram": length_histogram_figure(plan)}
        timeline = self._timeline(pl_module, plan, trainer)
        if timeline is not None:
            figures["packing/timeline"] = timeline
        for tag, fig in figures.items():
            for writer in writers:
                writer.add_figure(tag, fig, global_step=trainer.global_step, close=False)
            fig.clear()

    def _timeline(self, pl_module: L.LightningModule, plan, trainer: L.Trainer | None = None):
        """The epoch's plan priced with the cost model of the trained model (and of the trainer's run: its ZeRO
        stage, offloads, precision), or None without a config."""
        from lit_hbp.simulate import simulate
        from lit_hbp.simulate.plots import timeline_figure

        config = getattr(getattr(pl_module, "model", None), "config", None)
        if config is None or not hasattr(config, "to_dict"):
            rank_zero_warn("PackingMetrics(figures=True): the module has no `model.config`; timeline not logged")
            return None
        spec = ModelSpec.from_config(config.to_dict())
        hardware = HARDWARE[self.hardware]
        run = Settings(plan.world_size, hardware) if trainer is None else trainer_settings(trainer, hardware)
        cost = cost_model(spec, replace(run, world=plan.world_size))
        name = f"this epoch's plan, simulated on {plan.world_size} x {cost.hardware.name} (cost model)"
        return timeline_figure([simulate(plan, cost, name)])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        plan = self._plan(trainer)
        step = min(batch_idx // trainer.accumulate_grad_batches, plan.n_steps - 1)
        # A host tensor: Lightning copies a Python number to the device, a blocking copy every micro-step.
        pl_module.log("packing/level", torch.tensor(float(plan.step_level[step])), batch_size=1)
        if getattr(batch, "cp", 1) > 1:
            pl_module.log("packing/cp_area_imbalance", torch.tensor(float(batch.cp_imbalance)), batch_size=1)
