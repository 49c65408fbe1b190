"""The measured profiler: each probe is a short ``Trainer.fit`` of the user's module through
HBPStrategy, so what it measures (step time, peak memory) is what training will see: the run's
DeepSpeed engine with its ZeRO stage, precision, optimizer states and gradient reduction, the SP
group of the probed degree, and the probed number of checkpointed layers.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import time
import warnings
from collections.abc import Callable

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lit_hbp.autoselect.profiler import Measurement
from lit_hbp.costmodel import synthetic_pack
from lit_hbp.data.collate import collate_packs, shard
from lit_hbp.packing.levels import Level
from lit_hbp.parallel.groups import SPGroups
from lit_hbp.parallel.topology import sp_coords
from lit_hbp.strategy import HBPStrategy


def synthetic_batch(
    lengths, pack_len: int, sp: int, sp_rank: int, vocab: int, ckpt_layers: int, rng: np.random.Generator
) -> dict:
    """This rank's shard of one micro-batch: a pack filled from the data's length distribution
    (random token ids, every token supervised), tagged as level 0 with ``ckpt_layers``."""
    take = synthetic_pack(lengths, pack_len, rng)
    docs = [(rng.integers(0, vocab, int(n)), np.ones(int(n), bool)) for n in take]
    batch = collate_packs(
        [np.arange(len(take))],
        docs.__getitem__,
        sp=sp,
        meta={"loss_norm": float(take.sum()), "level": 0, "ckpt_layers": ckpt_layers},
    )
    return shard(batch, sp, sp_rank) if sp > 1 else batch


def probe_strategy_args(strategy) -> dict:
    """HBPStrategy arguments that reproduce a run's strategy in a probe: its DeepSpeed config when
    it is a DeepSpeed strategy (less what Lightning sets per run), else HBPStrategy's defaults."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy) or strategy.config is None:
        return {}
    config = copy.deepcopy(strategy.config)
    config.pop("gradient_accumulation_steps", None)
    return {"config": config}


class MeasuredProfiler:
    """Trains ``warmup + steps`` optimizer steps of a fresh copy of the user's module per probe on
    synthetic packs drawn from the dataset's lengths.

    Every rank of the world must call ``measure`` with the same arguments (a probe is a
    distributed run). ``seconds`` is the mean time of a measured micro-step, its share of the
    optimizer step and of the gradient reduction included; ``memory`` the peak CUDA allocation, or
    on CPU the peak resident set size, from the start of training (engine built, optimizer states
    not yet allocated) to the end. Ranks agree on the slowest time and the largest peak. A probe that
    runs out of memory does not fit. Caveat: a CUDA out-of-memory on one rank inside a collective
    leaves the others waiting; give ``capacity`` a margin so Algorithm 4's probes stay inside.

    Args:
        module_factory: a fresh, unconfigured LightningModule (an HBPLitModule) per probe.
        lengths: the dataset's sample lengths.
        capacity: device memory a probe may use, bytes.
        trainer_args: ``lightning.Trainer`` arguments of the run: accelerator, devices, num_nodes,
            precision, accumulate_grad_batches.
        strategy_args: ``HBPStrategy`` arguments of the run (stage, config, ...), levels excluded.
    """

    def __init__(
        self,
        module_factory: Callable[[], L.LightningModule],
        lengths,
        capacity: float,
        trainer_args: dict | None = None,
        strategy_args: dict | None = None,
        steps: int = 3,
        warmup: int = 1,
        seed: int = 0,
    ):
        self.module_factory = module_factory
        self.lengths = np.asarray(lengths)
        self.capacity = capacity
        self.trainer_args = dict(trainer_args or {})
        self.strategy_args = {k: v for k, v in (strategy_args or {}).items() if k != "levels"}
        self.steps, self.warmup, self.seed = steps, warmup, seed
        self.sp_groups: SPGroups | None = None

    def _groups(self, sp: int) -> SPGroups:
        """SP groups shared by every probe (a probe building its own would add communicators each time)."""
        if self.sp_groups is None:
            world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            self.sp_groups = SPGroups([], world, rank)
        self.sp_groups.ensure([sp])
        return self.sp_groups

    def measure(self, pack_len: int, sp: int, ckpt_layers: int) -> Measurement:
        strategy = HBPStrategy(**copy.deepcopy(self.strategy_args))
        strategy.sp_groups = self._groups(sp)
        accumulate = self.trainer_args.get("accumulate_grad_batches", 1)
        level = Level(pack_len, sp, ckpt_layers)
        data = ProbeData(level, self.lengths, (self.warmup + self.steps) * accumulate, self.seed)
        timer = ProbeTimer(skip=self.warmup * accumulate)
        with _quiet():
            trainer = L.Trainer(
                **self.trainer_args,
                strategy=strategy,
                max_steps=self.warmup + self.steps,
                callbacks=[timer],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                use_distributed_sampler=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                log_every_n_steps=1,
            )
            device = trainer.strategy.root_device
            oom = False
            try:
                trainer.fit(self.module_factory(), datamodule=data)
            except torch.OutOfMemoryError:
                oom = True
            finally:
                del trainer, strategy
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        seconds, memory = (math.inf, math.inf) if oom else (timer.seconds, timer.peak)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank must take the same decisions: the slowest rank and the largest peak decide.
            t = torch.tensor([seconds, memory], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds, memory = (float(x) for x in t.cpu())
        if math.isinf(memory):
            return Measurement(math.inf, None, float(data.tokens), False)
        return Measurement(seconds, memory, float(data.tokens), memory <= self.capacity)


class ProbeData(L.LightningDataModule):
    """``n`` copies of this rank's shard of one synthetic micro-batch. It carries the probe's level
    as HBPDataModule carries its levels (HBPStrategy reads them there), and builds the batch once
    the trainer knows the rank and the model its vocabulary."""

    def __init__(self, level: Level, lengths: np.ndarray, n: int, seed: int):
        super().__init__()
        self.levels = [level]
        self.lengths, self.n, self.seed = lengths, n, seed
        self.tokens = 0

    def train_dataloader(self) -> DataLoader:
        lv = self.levels[0]
        vocab = self.trainer.lightning_module.model.config.vocab_size
        sp_rank = sp_coords(self.trainer.global_rank, lv.sp)[1]
        rng = np.random.default_rng(self.seed)  # the same pack on every SP group
        batch = synthetic_batch(self.lengths, lv.pack_len, lv.sp, sp_rank, vocab, lv.ckpt_layers, rng)
        self.tokens = batch["input_ids"].shape[1]
        return DataLoader([batch] * self.n, batch_size=None)


class ProbeTimer(L.Callback):
    """Times every micro-step after the first ``skip`` (device-synchronized) and tracks peak memory."""

    def __init__(self, skip: int):
        self.skip = skip
        self.times: list[float] = []
        self.peak = math.nan
        self._start = 0.0

    @property
    def seconds(self) -> float:
        return float(np.mean(self.times)) if self.times else math.inf

    def on_train_start(self, trainer, pl_module) -> None:
        _reset_peak_memory(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _sync(trainer.strategy.root_device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync(trainer.strategy.root_device)
        if batch_idx >= self.skip:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak = _peak_memory(trainer.strategy.root_device)


@contextlib.contextmanager
def _quiet():
    """A probe is an internal run: keep Lightning's and DeepSpeed's per-run banners out of the log."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    except OSError:
        pass


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
