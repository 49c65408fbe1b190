"""Lightning's ThroughputMonitor for packed micro-batches, synchronizing only when it logs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from lit_hbp.cost.gpu_peaks import peak_flops
from lit_hbp.data.batch import PackedBatch
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.meter import logs_now


def samples_in_batch(batch: PackedBatch) -> float:
    """This rank's share: every rank of an SP group sees the group's whole list of samples."""
    return batch.sample_index.numel() / batch.sp


def tokens_in_batch(batch: PackedBatch) -> float:
    """This rank's share of the pack's real tokens (not its padding)."""
    return batch.n_tokens / batch.sp


def _counting_hint(batch: Any) -> str:
    """The ``batch_size_fn`` / ``length_fn`` arguments that count a batch of this shape."""
    if isinstance(batch, dict) and "input_ids" in batch:
        tokens = 'b["attention_mask"].sum()' if "attention_mask" in batch else 'b["input_ids"].numel()'
        return f'batch_size_fn=lambda b: len(b["input_ids"]), length_fn=lambda b: {tokens}'
    if isinstance(batch, (tuple, list)):
        return "batch_size_fn=lambda b: len(b[0]), length_fn=lambda b: b[0].numel()"
    return "batch_size_fn=lambda b: <samples in b>, length_fn=lambda b: <tokens in b>"


class ShareThroughput(Throughput):
    """Lightning's Throughput without its assumption that a batch holds at least one sample: a
    rank's share of a 128K pack split over SP 8 is 1/8 of a sample."""

    def update(self, *, time: float, batches: int, samples: float, lengths: float | None = None, flops=None) -> None:
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)


class HBPThroughputMonitor(ThroughputMonitor):
    """Logs samples/s, tokens/s, FLOP/s and (on GPUs whose peak ``lit_hbp.cost.gpu_peaks`` knows) MFU,
    where tokens are real sample tokens, never padding, and an SP group's ranks each count their 1/sp
    share. The world's rates are rank 0's counts times the world size (Lightning's ``Throughput``): HBP
    balances the ranks' work, not their tokens, so they are the world's within about 1% over an epoch, and
    off at a step where some ranks run empty completion packs (a level's last).

    Lightning's ThroughputMonitor synchronizes the GPU after every micro-batch to time it, which
    stops the host from queueing the next micro-batch while the GPU works. This one counts each
    micro-batch's samples, tokens and FLOPs on the host and synchronizes only at the optimizer
    steps whose metrics the loggers write; the rates are over the last ``window_size - 1`` such
    intervals (default 1: since the previous log). FLOP/s and MFU need the module's
    ``flops_per_batch`` (None: not logged). A level's empty completion packs (a dummy
    forward so collectives match) add no sample and no token; their time still counts.

    In a plain Lightning project (batches that are not PackedBatch) give ``batch_size_fn`` and
    optionally ``length_fn``, as to Lightning's ThroughputMonitor: they then count the samples and
    tokens. Without them a batch that is not a PackedBatch stops the run on the first batch with an
    error that says so.
    """

    def __init__(
        self,
        window_size: int = 2,
        batch_size_fn: Callable[[Any], float] | None = None,
        length_fn: Callable[[Any], float] | None = None,
        **kwargs: Any,
    ):
        if batch_size_fn is None and length_fn is not None:
            raise ConfigError("HBPThroughputMonitor length_fn: needs its batch_size_fn (samples in a batch)")
        if window_size < 2:  # Lightning's Throughput asserts it at set-up, without a word
            raise ConfigError(f"HBPThroughputMonitor window_size: must be >= 2 (rates between logs), got {window_size}")
        packed = batch_size_fn is None
        super().__init__(
            batch_size_fn=batch_size_fn or samples_in_batch,
            length_fn=tokens_in_batch if packed else length_fn,
            window_size=window_size,
            **kwargs,
        )
        self._check_packed = packed  # counting PackedBatch micro-batches: the first batch is checked
        self._pending = dict(samples=0.0, tokens=0.0, flops=0.0, batches=0)
        self._resumed: dict[str, float] = {}  # the counts of the checkpoint a run resumed from, until it starts

    def _check_batch(self, batch: Any) -> None:
        if self._check_packed and not isinstance(batch, PackedBatch):
            raise TypeError(
                "HBPThroughputMonitor counts the samples and tokens of lit_hbp PackedBatch micro-batches "
                f"(from HBPDataModule), but this batch is a {type(batch).__name__}: say how to count yours, as to "
                f"Lightning's ThroughputMonitor: HBPThroughputMonitor({_counting_hint(batch)})"
            )
        self._check_packed = False

    def _update(self, trainer, pl_module, batch: Any, iter_num: int) -> None:
        self._check_batch(batch)  # validation batches go through Lightning's ThroughputMonitor
        super()._update(trainer, pl_module, batch, iter_num)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning's setup with the peak of the exact GPU variant (``lit_hbp.cost.gpu_peaks``) and
        throughputs that count shares of samples."""
        self.available_flops = peak_flops(
            trainer.strategy.root_device, _plugin_to_compute_dtype(trainer.precision_plugin)
        )
        stages = [trainer.state.stage]
        if stage == TrainerFn.FITTING and trainer.enable_validation:
            stages.append(RunningStage.VALIDATING)  # fit includes validation
        self._throughputs = {
            s: ShareThroughput(available_flops=self.available_flops, world_size=trainer.world_size, **self.kwargs)
            for s in stages
        }

    def state_dict(self) -> dict[str, float]:
        """The training stage's running counts (the micro-batches since the last logging step too): a resumed run
        counts on from them, as the uninterrupted run does (its ``train/batches``, ``train/samples`` and
        ``train/lengths`` started again from 0). Rank 0's, which counts; the rates start afresh."""
        stage, pending = RunningStage.TRAINING, self._pending
        return {
            "batches": self._batches.get(stage, 0) + pending["batches"],
            "samples": self._samples.get(stage, 0) + pending["samples"],
            "lengths": self._lengths.get(stage, 0) + pending["tokens"],
        }

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self._resumed = dict(state_dict)

    @rank_zero_only
    def on_train_start(self, trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)  # Lightning's start sets the counts to 0
        resumed, self._resumed = self._resumed, {}
        stage = RunningStage.TRAINING
        for name, counts in (("batches", self._batches), ("samples", self._samples), ("lengths", self._lengths)):
            counts[stage] += resumed.get(name, 0)

    @rank_zero_only
    def on_validation_start(self, trainer, *args: Any) -> None:
        super().on_validation_start(trainer, *args)
        self._validation_began = time.perf_counter()

    @rank_zero_only
    def on_validation_end(self, trainer, *args: Any) -> None:
        """The training clock passes over the validation's own time only. Lightning's takes training to have
        stopped at its last update, which here is the last logging step: the steps after it would lose their
        time and keep their tokens (training tokens/s and FLOP/s 2.5x too high after a validation)."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._t0s[RunningStage.TRAINING] += time.perf_counter() - self._validation_began

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any) -> None:
        self._check_batch(batch)
        pending = self._pending
        pending["samples"] += self.batch_size_fn(batch)
        pending["tokens"] += self.length_fn(batch) if self.length_fn is not None else 0.0
        flops = getattr(pl_module, "flops_per_batch", None)
        pending["flops"] = None if flops is None or pending["flops"] is None else pending["flops"] + flops
        pending["batches"] += 1
        if not logs_now(trainer):
            return
        stage = trainer.state.stage
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._batches[stage] += pending["batches"]
        self._samples[stage] += pending["samples"]
        self._lengths[stage] += pending["tokens"]
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage] if self.length_fn is not None else None,
            flops=pending["flops"],
        )
        self._pending = dict(samples=0.0, tokens=0.0, flops=0.0, batches=0)
        self._compute(trainer)
