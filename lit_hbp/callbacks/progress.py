"""The console of a run: a progress bar in optimizer steps, and a per-level summary of each epoch.

Lightning's bars count micro-batches against a total in optimizer steps (``300/150`` with
``accumulate_grad_batches: 2``), and the Rich bar writes ``Epoch 0/-2`` when ``max_epochs`` is
unlimited (-1). HBPProgressBar counts what ``max_steps`` counts; LevelSummary says at each epoch
end what each level trained, how fast, and what the data module left out.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.store import count_phrase, distinct
from lit_hbp.lightning.meter import StepMeter
from lit_hbp.lightning.plan_checks import planned_optimizer_steps


def planned_steps(trainer: L.Trainer) -> int | None:
    """The run's optimizer steps, what the LR schedule spans: the fewer of ``max_steps`` and the steps of
    ``max_epochs`` epochs (Lightning's ``estimated_stepping_batches``, or each epoch's plan where epochs differ:
    ``planned_optimizer_steps``); None when neither bounds the run."""
    estimate = trainer.estimated_stepping_batches
    if math.isinf(estimate) or math.isnan(estimate):
        return None
    planned = planned_optimizer_steps(trainer)
    return int(estimate) if planned is None else planned


def epoch_description(trainer: L.Trainer) -> str:
    """``Epoch 3`` (unlimited epochs) or ``Epoch 3/9`` (the last epoch's index, as Lightning numbers it)."""
    last = f"/{trainer.max_epochs - 1}" if trainer.max_epochs is not None and trainer.max_epochs > 0 else ""
    return f"Epoch {trainer.current_epoch}{last}"


class HBPProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar counting optimizer steps (``trainer.global_step``) over the run's planned
    steps (``planned_steps``), so its numbers match ``max_steps``, the logged step and the
    checkpoints; after a resume it starts at the restored step. The description is the epoch, with
    no total when ``max_epochs`` is unlimited. Validation bars are Lightning's.

    The CLI uses it unless the config sets another progress bar or ``enable_progress_bar: false``;
    in a plain Lightning project add it to ``Trainer(callbacks=...)``.
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._show_run(trainer)  # a mid-epoch resume starts here: Lightning calls no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        # Not Lightning's: its reset and renaming render the bar twice with the epoch's micro-batches as the
        # total and a negative rate, each render a line of its own in a log file.
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._show_run(trainer)

    def _show_run(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        if bar.disable:  # ranks other than 0 (a disabled tqdm keeps no description)
            return
        shown = (bar.total, bar.n, bar.desc)
        bar.total = planned_steps(trainer)
        bar.n = bar.initial = bar.last_print_n = trainer.global_step  # the rate counts this epoch's steps
        bar.set_description(epoch_description(trainer), refresh=False)
        if (bar.total, bar.n, bar.desc) != shown:  # an epoch's start after the run's start: rendered once
            bar.last_print_t = bar.start_t = time.time()
            bar.refresh()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is None or bar.disable or step == bar.n or not self._should_update(step, bar.total):
            return
        bar.n = step
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


class LevelSummary(L.Callback):
    """At the end of each training epoch, print once (rank 0) what each level (pack_len, sp) trained:
    optimizer steps and micro-batches, samples and tokens, seconds and tokens per second, and what
    the data module's store left out (dropped, truncated, skipped records).

    How it is counted: tokens are real sample tokens (``n_tokens``, not padding) and samples are the
    packs' samples; every rank counts its ``1/sp`` share of its pack and the shares are summed over
    ranks (one all-gather per epoch), so the totals are the world's. Micro-batches and steps are
    per rank (every rank trains the same number). Seconds are each level's micro-batches from
    ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, and the optimizer step
    that closes an accumulation; data loading and validation are not in them), measured with
    ``lit_hbp.lightning.meter.StepMeter`` (CUDA events on a GPU, the host clock on CPU) and taken from the
    slowest rank; tokens/s is the world's tokens over those seconds. The epoch's wall clock (host,
    validation excluded) is printed beside them. After a mid-epoch resume the summary counts the
    micro-batches this run trained and says where it started.

    Needs ``PackedBatch`` micro-batches (HBPDataModule); ``history`` keeps every epoch's numbers.
    """

    def __init__(self) -> None:
        self.history: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self._counts: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self._shapes: dict[int, tuple[int, int]] = {}
        self._meter = StepMeter()
        self._first_micro: int | None = None
        self._t0 = time.perf_counter()
        self._val_t0: float | None = None
        self._val_seconds = 0.0
        self._step_before = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()  # a mid-epoch resume starts here: Lightning calls no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_t0 is not None:
            self._val_seconds += time.perf_counter() - self._val_t0
            self._val_t0 = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, PackedBatch):
            raise TypeError(
                "LevelSummary counts the levels of lit_hbp PackedBatch micro-batches (from HBPDataModule); "
                f"got a batch of type {type(batch).__name__}"
            )
        self._step_before = trainer.global_step
        self._meter.start(batch.input_ids.device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        level, sp = int(batch.level), int(batch.sp)
        self._meter.stop(level, batch.n_tokens / sp)
        row = self._counts[level]
        row[0] += int(trainer.global_step > self._step_before)
        row[1] += 1
        row[2] += batch.sample_index.numel() / sp
        row[3] += batch.n_tokens / sp
        self._shapes.setdefault(level, (batch.pack_len, sp))
        if self._first_micro is None:
            self._first_micro = int(batch.micro_index)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wall = time.perf_counter() - self._t0 - self._val_seconds
        dm = getattr(trainer, "datamodule", None)
        levels = getattr(dm, "levels", None)
        shapes = {i: (lv.pack_len, lv.sp) for i, lv in enumerate(levels)} if levels else dict(self._shapes)
        n = max([len(shapes)] + [k + 1 for k in self._counts])
        times = self._meter.read_times()
        local = torch.zeros(n, 5, dtype=torch.float64)
        for k, row in self._counts.items():
            local[k, :4] = torch.tensor(row, dtype=torch.float64)
            local[k, 4] = times.get(k, (0.0, 0.0, 0))[0]
        gathered = trainer.strategy.all_gather(local.to(pl_module.device)).cpu()
        if gathered.dim() == 2:
            gathered = gathered[None]
        steps, micro = gathered[0, :, 0], gathered[0, :, 1]
        samples, tokens = gathered[:, :, 2].sum(0), gathered[:, :, 3].sum(0)
        seconds = gathered[:, :, 4].amax(0)
        rows = []
        for k in range(n):
            pack_len, sp = shapes.get(k, (0, 0))
            rate = float(tokens[k] / seconds[k]) if seconds[k] > 0 else 0.0
            rows.append(dict(level=k, pack_len=pack_len, sp=sp, steps=int(steps[k]), micro_batches=int(micro[k]),
                             samples=int(round(float(samples[k]))), tokens=int(round(float(tokens[k]))),
                             seconds=float(seconds[k]), tokens_per_s=rate))  # fmt: skip
        plan = getattr(dm, "plan", None) if dm is not None else None
        summary = dict(
            epoch=trainer.current_epoch,
            levels=rows,
            wall_s=wall,
            world_size=trainer.world_size,
            first_micro_batch=self._first_micro or 0,
            plan_steps=getattr(plan, "n_steps", None),
            plan_micro_batches=getattr(plan, "n_micro_steps", None),
            left_out=left_out(getattr(dm, "store", None)),
        )
        self.history.append(summary)
        text = format_summary(summary)
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar) and bar.is_enabled and trainer.is_global_zero:
            bar.print(text)  # above the bar (tqdm.write), not into its line
        else:
            rank_zero_info(text)


def left_out(store: Any) -> dict | None:
    """What the data module's SampleStore left out of the epoch (None without a store): over-length
    samples dropped and truncated (occurrences and distinct records), records skipped when read."""
    report = getattr(store, "report", None)
    if not report:
        return None
    out = {"over_length": report.get("over_length"), "max_len": report.get("max_len")}
    for name in ("dropped", "truncated", "truncated_to_nothing"):
        where = report.get(name) or []
        out[name] = (len(where), len(distinct(where)))
    out["skipped"] = sum(sum(m.get("skipped", {}).values()) for m in report.get("sources", []))
    return out


COLUMNS = [
    ("level", "level", "d"),
    ("pack_len", "pack_len", "d"),
    ("sp", "sp", "d"),
    ("steps", "steps", "d"),
    ("micro_batches", "micro-batches", "d"),
    ("samples", "samples", "d"),
    ("tokens", "tokens", "d"),
    ("seconds", "seconds", ".2f"),
    ("tokens_per_s", "tokens/s", ".0f"),
]


def format_summary(summary: dict) -> str:
    """The console text of one epoch's LevelSummary."""
    rows = summary["levels"]
    total = dict(level="all", pack_len="", sp="")
    for key in ("steps", "micro_batches", "samples", "tokens", "seconds"):
        total[key] = sum(r[key] for r in rows)
    total["tokens_per_s"] = total["tokens"] / total["seconds"] if total["seconds"] > 0 else 0.0
    cells = [[title for _, title, _ in COLUMNS]]
    for r in [*rows, total]:
        cells.append([format(r[key], fmt) if isinstance(r[key], (int, float)) else r[key] for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    table = ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]

    steps = total["steps"]
    of_plan = f" of the plan's {summary['plan_steps']}" if summary["plan_steps"] is not None else ""
    start = summary["first_micro_batch"]
    resumed = f" (resumed at micro-batch {start}: the {start} before it are not counted)" if start else ""
    wall = summary["wall_s"]
    rate = total["tokens"] / wall if wall > 0 else 0.0
    head = (
        f"epoch {summary['epoch']} summary: {steps}{of_plan} optimizer steps, {total['micro_batches']} micro-batches "
        f"per rank{resumed}, {total['tokens']} tokens in {wall:.1f} s wall clock "
        f"({rate:.0f} tokens/s, validation excluded; world {summary['world_size']})"
    )
    notes = [
        "  tokens: real sample tokens (no padding) over all ranks; seconds: each level's micro-batches, "
        "forward + backward + optimizer step, without data loading or validation (slowest rank)"
    ]
    out = summary["left_out"]
    if out is not None:
        parts = []
        for name, what in (("dropped", "dropped"), ("truncated", "truncated"), ("truncated_to_nothing", "emptied")):
            n, n_distinct = out[name]
            if n or name == "dropped":
                parts.append(f"{what} {count_phrase(n, n_distinct) if n else '0 samples'}")
        limit = f" longer than {out['max_len']} tokens" if out["max_len"] is not None else ""
        notes.append(
            f"  left out of the epoch (over_length: {out['over_length']}{limit}): {', '.join(parts)}; "
            f"{out['skipped']} record(s) skipped when read (data_report.json lists them all)"
        )
    return "\n".join([head, *table, *notes])
