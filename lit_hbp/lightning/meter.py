"""What the training step measures, kept where it is produced and read only when the logger writes.

Reading a device value on the host (``.item()``, ``float(t)``, logging a Python number, which
Lightning turns into a device tensor) waits for every queued kernel: the host stops running ahead
of the GPU. So per micro-step nothing is read back: the summed cross-entropy stays on the device,
token counts are host integers from the collate step, and micro-step times are CUDA events. At
the end of an optimizer step whose metrics the logger will write, one all-reduce and one read
turn them into numbers.
"""

from __future__ import annotations

import time
from collections import defaultdict

import lightning as L
import torch


def logs_now(trainer) -> bool:
    """True at the last micro-step of an optimizer step whose metrics the loggers write (the same
    test Lightning's ThroughputMonitor uses)."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None:
        return False
    return not trainer.fit_loop._should_accumulate() and connector.should_update_logs


WINDOW_METRICS = ("train/loss", "train/grad_norm")  # a value per logging window, when the window has one


def forget_last_window(trainer) -> None:
    """Lightning writes every value logged since the epoch began at each log step, logged again or not: a window
    without supervised tokens wrote the last window's ``train/loss``, one without a level that level's old
    ``time/level*``. ``HBPLitModule`` forgets the values that describe a window before it logs this window's
    (Lightning's result collection has no public way)."""
    results = getattr(trainer, "_results", None)
    for metric in (results or {}).values():
        name = metric.meta.name
        if metric.meta.fx == "on_train_batch_end" and (name in WINDOW_METRICS or name.startswith("time/level")):
            metric.reset()


def monitored_now(trainer) -> bool:
    """True at the last micro-step of every optimizer step when a callback monitors a window metric (a
    ``ModelCheckpoint`` or ``EarlyStopping`` of ``train/loss``): it may act at any step (every n steps, by time, at
    an epoch's end or a validation), so the window so far is logged at each, as a ``training_step`` log would be;
    the loggers still write the whole window's at theirs."""
    monitors = any(getattr(callback, "monitor", None) in WINDOW_METRICS for callback in trainer.callbacks)
    return monitors and not trainer.fit_loop._should_accumulate()


def logs_by_schedule(trainer) -> bool:
    """``logs_now`` but for a stop: the step is one of every ``log_every_n_steps`` (Lightning also logs at the step a
    run stops at, which an uninterrupted run does not)."""
    every = trainer.log_every_n_steps  # 0: Lightning never logs
    step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1  # as Lightning's should_update_logs counts
    return every > 0 and not trainer.fit_loop._should_accumulate() and step % every == 0


PENDING_LOSS = "lit_hbp_pending_loss"  # the checkpoint's key: the loss since the last logged step (MicroStepEnd)


class StepMeter:
    """Cross-entropy and tokens since the last read, and each level's micro-step times."""

    def __init__(self) -> None:
        self.ce: torch.Tensor | None = None
        self.targets = 0
        self.logged_at: int | None = None  # the micro-step (the fit loop's count) whose metrics were logged
        self.monitored_at: int | None = None  # one whose window so far was logged for a monitor (``monitored_now``)
        self._spans: list[tuple[int, float, object, object]] = []
        self._start: object = None
        self.step_tokens = self.step_targets = 0  # this rank's, in the optimizer step so far (``count``)
        self._counted: tuple[int, bool] | None = None  # (the micro-step counted last, whether it ended its step)

    def count(self, micro_step: int, tokens: int, targets: int, ends_step: bool) -> None:
        """Add a micro-step's tokens and supervised tokens to its optimizer step's (once a micro-step; a step's
        counts start again at its first): the step's, not its last micro-batch's (an empty completion pack's 0)."""
        if self._counted is not None and self._counted[0] == micro_step:
            return
        if self._counted is None or self._counted[1]:
            self.step_tokens = self.step_targets = 0
        self.step_tokens += tokens
        self.step_targets += targets
        self._counted = (micro_step, ends_step)

    def add_loss(self, ce_sum: torch.Tensor, targets: int) -> None:
        ce_sum = ce_sum.detach().float()
        self.ce = ce_sum if self.ce is None else self.ce + ce_sum
        self.targets += targets

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, level: int, tokens: float) -> None:
        if self._start is None:
            return
        if isinstance(self._start, float):
            end: object = time.perf_counter()
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._spans.append((level, tokens, self._start, end))
        self._start = None

    def read_loss(self, reduce=None, keep: bool = False) -> float | None:
        """Token-mean cross-entropy since the last read over all ranks (``reduce`` sums a device
        tensor over the world; every rank must call it), or None without a supervised token. ``keep``: the
        next read counts these micro-steps again (a stop's log, a point the uninterrupted run does not have)."""
        if self.ce is None:  # no micro-step since the last read, on any rank
            return None
        local = torch.stack([self.ce, torch.tensor(float(self.targets), device=self.ce.device)])
        total = reduce(local) if reduce is not None else local
        ce, targets = total.tolist()
        if not keep:
            self.ce, self.targets = None, 0
        return ce / targets if targets > 0 else None

    def read_times(self) -> dict[int, tuple[float, float, int]]:
        """Per level: (seconds, tokens, micro-steps) since the last read."""
        out: dict[int, list] = defaultdict(lambda: [0.0, 0.0, 0])
        if self._spans and not isinstance(self._spans[-1][3], float):
            self._spans[-1][3].synchronize()
        for level, tokens, start, end in self._spans:
            seconds = end - start if isinstance(end, float) else start.elapsed_time(end) / 1000.0
            row = out[level]
            row[0] += seconds
            row[1] += tokens
            row[2] += 1
        self._spans = []
        return {level: tuple(row) for level, row in out.items()}


class MicroStepEnd(L.Callback):
    """Runs ``HBPLitModule.end_micro_step`` first among the callbacks' ``on_train_batch_end`` (the module adds it,
    ``configure_callbacks``): the module's own hook runs after every callback's, so a checkpoint saved at that step
    (seconds, for a large model) counted as the level's training time, and a ``ModelCheckpoint`` monitoring
    ``train/loss`` ranked each save by the last logged step's loss. A checkpoint carries the loss since the last
    logged step: a resumed run's first ``train/loss`` averages the micro-steps the uninterrupted run's did (it
    averaged only those after the resume). A run stopped between two logged steps also logs them at its stop, as
    Lightning logs there: a point the uninterrupted run does not have, which leaves them pending."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.callbacks = [self] + [c for c in trainer.callbacks if c is not self]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        end = getattr(pl_module, "end_micro_step", None)
        if end is not None:
            end(batch)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Every rank's loss since the last logged step, summed (each rank's save runs this)."""
        meter = getattr(pl_module, "_meter", None)
        if meter is None:
            return
        pending = (0.0, 0) if meter.ce is None else (float(meter.ce), meter.targets)
        # the strategy's device: after fit's teardown (an export's save at on_fit_end) the module is on the host
        total = torch.tensor(pending, dtype=torch.float64, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(total, reduce_op="sum")
        ce_sum, targets = total.tolist()
        if targets > 0:
            checkpoint[PENDING_LOSS] = {"ce_sum": ce_sum, "targets": int(targets)}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        meter = getattr(pl_module, "_meter", None)
        if meter is None:
            return
        meter.ce, meter.targets = None, 0
        pending = checkpoint.get(PENDING_LOSS)
        if pending and trainer.global_rank == 0:  # summed over the world when the loss is read: counted once
            meter.add_loss(torch.tensor(pending["ce_sum"]), pending["targets"])
