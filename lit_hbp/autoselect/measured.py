"""The measured profiler: each probe is a short ``Trainer.fit`` of the user's module through
HBPStrategy, so what it measures (step time, peak memory) is what training will see: the run's
DeepSpeed engine with its ZeRO stage, precision, optimizer states and gradient reduction, the SP
group of the probed degree, and the probed number of checkpointed layers.

A text run's probes train packs of random tokens drawn from the data's lengths. A run with images or
videos packs its probes with its own samples (``StoreSamples``: their images decoded by the run's
processor, encoded by its tower, split over the SP group as training splits them): the first micro-batch
is the level's densest pack (whole samples by patches per token, most first: the tower's largest share
of memory), the measured ones drawn from the samples the level holds, as the planner fills packs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import random
import time
import warnings
from collections.abc import Callable

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_hbp.autoselect.profiler import Measurement
from lit_hbp.cost.sample_packs import synthetic_members, synthetic_pack
from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.strategy import HBPDDPStrategy, HBPStrategy
from lit_hbp.packing.levels import LAYOUT_KINDS, Level
from lit_hbp.parallel.groups import SPGroups
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import sp_coords


def synthetic_batch(
    lengths,
    pack_len: int,
    sp: int,
    sp_rank: int,
    vocab: int,
    ckpt_layers: int,
    rng: np.random.Generator,
    sp_kind: str = "ulysses",
    cp: int = 1,
) -> PackedBatch:
    """This rank's shard of one micro-batch: a pack filled from the data's length distribution
    (random token ids, every token supervised), tagged as level 0 with ``ckpt_layers``, cut the
    ``sp_kind`` way over the (sp / cp) x cp layout."""
    take = synthetic_pack(lengths, pack_len, rng)
    docs = [(rng.integers(0, vocab, int(n)), np.ones(int(n), bool)) for n in take]
    batch = collate_packs(
        [np.arange(len(take))],
        docs.__getitem__,
        sp=sp,
        sp_kind=sp_kind,
        cp=cp,
        loss_norm=float(take.sum()),
        ckpt_layers=ckpt_layers,
    )
    return resolve_sp_kind(sp_kind).shard(batch, sp, sp_rank) if sp > 1 else batch


def densest_members(lengths: np.ndarray, patches: np.ndarray, pack_len: int) -> np.ndarray:
    """The samples of a pack of ``pack_len`` with the most image patches: whole samples by patches per token,
    most first, each taken while it fits (what the tower keeps at its largest in a pack of the level)."""
    lengths, patches = np.asarray(lengths, np.int64), np.asarray(patches, np.float64)
    fits = np.flatnonzero((lengths > 0) & (lengths <= pack_len))
    order = fits[np.argsort(-patches[fits] / lengths[fits], kind="stable")]
    room, smallest, take = pack_len, int(lengths[fits].min(initial=pack_len + 1)), []
    for i in order.tolist():
        if room < smallest:
            break
        if lengths[i] <= room:
            take.append(i)
            room -= int(lengths[i])
    return np.asarray(take, np.int64)


def sample_batch(samples, members: np.ndarray, level: Level, sp_rank: int) -> PackedBatch:
    """This rank's shard of a micro-batch of the run's own samples ``members`` (``StoreSamples``: their
    images and videos as the processor makes them), cut as ``level`` cuts it."""
    members = np.asarray(members, np.int64)
    supervised = sum(int(samples.tokens(int(i))[1].sum()) for i in members)
    return samples.batch([members], level, sp_rank, loss_norm=float(max(supervised, 1)), ckpt_layers=level.ckpt_layers)


def probe_strategy_args(strategy) -> dict | None:
    """HBPStrategy arguments that reproduce a run's strategy in a probe: when it is a DeepSpeed
    strategy, its DeepSpeed config (less what Lightning sets per run), ZeRO-3 parameter placement
    and fp16 loss scaling (HBPStrategy's defaults before its config is built); None for a strategy without
    DeepSpeed, whose probes run under ``HBPDDPStrategy`` (nothing sharded, as the run)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    if strategy.config is None:
        return {}
    config = copy.deepcopy(strategy.config)
    config.pop("gradient_accumulation_steps", None)
    kept = ("remote_device", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    return {"config": config, **{name: getattr(strategy, name) for name in kept}}


class MeasuredProfiler:
    """Trains ``warmup + steps`` optimizer steps of a fresh copy of the user's module per probe on
    synthetic packs drawn from the dataset's lengths.

    Every rank of the world must call ``measure`` with the same arguments (a probe is a
    distributed run). Each micro-step trains a different pack (the same on every SP group).
    ``seconds`` is the mean time of a measured micro-step, its share of the optimizer step and of
    the gradient reduction included; ``memory`` the peak from the start of training (engine built,
    optimizer states not yet allocated) to its end: on CUDA the allocator's peak reservation plus
    what the process holds outside it, on CPU the peak resident set size. Ranks agree on the
    slowest time, the largest peak and the smallest capacity. A probe that runs out of memory does
    not fit. A probe leaves no trace: its engine is freed, and the random states and environment
    variables of the process are restored.

    Args:
        module_factory: a fresh, unconfigured LightningModule (an HBPLitModule) per probe.
        lengths: the dataset's sample lengths.
        capacity: device memory a probe may use, bytes.
        trainer_args: ``lightning.Trainer`` arguments of the run: accelerator, devices, num_nodes,
            precision, accumulate_grad_batches.
        strategy_args: ``HBPStrategy`` arguments of the run (stage, config, ...), levels excluded; None: a run
            without DeepSpeed, probed under ``HBPDDPStrategy``.
        estimate: expected peak bytes of a probe, e.g. the cost model's ``memory_bytes``; a probe
            estimated over twice ``capacity`` is not run and does not fit. A real out-of-memory
            that strikes one rank before the others inside a collective leaves them waiting; this
            keeps the probes that are sure to fail (Algorithm 4 starts at no checkpointing) off the
            device.
        sp_kind: how probes with sp > 1 split their packs (``lit_hbp.parallel.kind``).
        samples: the run's samples with images or videos (``lit_hbp.lightning.loader.StoreSamples``, indexed as
            ``lengths``) and ``patches`` their patches per sample (``VisionLoad.patches``): the probes pack
            them, the first micro-batch the densest in patches. None: random tokens (a text run).
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
        estimate: Callable[[int, int, int], float] | None = None,
        sp_kind: str = "ulysses",
        samples=None,
        patches: np.ndarray | None = None,
    ):
        self.module_factory = module_factory
        self.lengths = np.asarray(lengths)
        self.capacity = capacity
        self.trainer_args = dict(trainer_args or {})
        self.strategy_args = strategy_args  # None: the run has no DeepSpeed, its probes run under HBPDDPStrategy
        if strategy_args is not None:
            self.strategy_args = {k: v for k, v in strategy_args.items() if k != "levels"}
        self.steps, self.warmup, self.seed = steps, warmup, seed
        self.estimate = estimate
        self.sp_kind = sp_kind
        if (samples is None) != (patches is None):
            raise ValueError("MeasuredProfiler: samples and their patches come together")
        self.samples, self.patches = samples, None if patches is None else np.asarray(patches)
        self.sp_groups: SPGroups | None = None
        self._capacity_agreed = False
        self._measured: dict[tuple[int, int, int, int], Measurement] = {}

    def _groups(self, sp: int, cp: int) -> SPGroups:
        """SP groups shared by every probe (a probe building its own would add communicators each time)."""
        if self.sp_groups is None:
            world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            self.sp_groups = SPGroups([], world, rank)
        self.sp_groups.ensure([(sp, cp)])
        return self.sp_groups

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, cp: int = 1) -> Measurement:
        """Probe once per setting (Algorithm 3 asks again for the setting Algorithm 4 settled on)."""
        key = (int(pack_len), int(sp), int(ckpt_layers), int(cp))
        if key not in self._measured:
            self._measured[key] = self.probe(*key)
        return self._measured[key]

    def probe(self, pack_len: int, sp: int, ckpt_layers: int, cp: int = 1) -> Measurement:
        """A fresh probe of one setting (not cached; `measure` caches)."""
        if not self._capacity_agreed:  # every rank decides against the smallest device
            self.capacity = -_reduce_max([-self.capacity])[0]
            self._capacity_agreed = True
        if self.estimate is not None:
            expected = self.estimate(pack_len, sp, ckpt_layers)
            if expected > 2 * self.capacity:
                rank_zero_info(
                    f"probe {pack_len} tokens sp {sp} ckpt {ckpt_layers} not run: the cost model expects "
                    f"{expected / 2**30:.1f} GiB per device, over twice the {self.capacity / 2**30:.1f} GiB available"
                )
                return Measurement(math.inf, None, pack_len / sp, False)
        if self.strategy_args is None:
            strategy = HBPDDPStrategy()
        else:
            strategy = HBPStrategy(**copy.deepcopy(self.strategy_args))
        strategy.sp_groups = self._groups(sp, cp)
        accumulate = self.trainer_args.get("accumulate_grad_batches", 1)
        builtin = self.sp_kind in LAYOUT_KINDS  # the layout probed, written (a level without one takes the default)
        layout = dict(ulysses=sp // cp, cp=cp) if builtin and sp > 1 else {} if builtin else dict(sp_kind=self.sp_kind)
        level = Level(pack_len, sp, ckpt_layers, **layout)
        n = (self.warmup + self.steps) * accumulate
        data = ProbeData(level, self.lengths, n, self.seed, self.samples, self.patches)
        timer = ProbeTimer(skip=self.warmup * accumulate)
        with _quiet(), _isolated():
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
            module = self.module_factory()
            if "self_check" in getattr(module, "hparams", {}):
                module.hparams.self_check = False  # the run itself checks the model once, not every probe
            compiled = bool(getattr(module, "hparams", {}).get("compile"))
            graphs = _compiled_codes() if compiled else {}
            finished = False
            try:
                trainer.fit(module, datamodule=data)
                finished = True
            except torch.OutOfMemoryError:
                oom = True
            finally:
                if not finished and hasattr(module, "teardown"):
                    module.teardown("fit")  # Lightning tears a module down only after a fit that ended
                _release(trainer)
                data.trainer = None
                del trainer, strategy, module
                gc.collect()
                if compiled:
                    _forget_compiled(graphs)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        seconds, memory = (math.inf, math.inf) if oom else (timer.seconds, timer.peak)
        # Every rank must take the same decisions: the slowest rank and the largest peak decide.
        seconds, memory = _reduce_max([seconds, memory])
        if math.isinf(memory):
            return Measurement(math.inf, None, data.tokens, False)
        return Measurement(seconds, memory, data.tokens, memory <= self.capacity)


def _reduce_max(values: list[float]) -> list[float]:
    """Element-wise maximum over the world's ranks (the values themselves outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _compiled_codes() -> dict:
    """Every code object dynamo compiled in this process, with its count of graphs (cache entries)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = (ref() for ref in convert_frame.input_codes.seen + convert_frame.output_codes.seen)
    return {code: len(_debug_get_cache_entry_list(code)) for code in codes if code is not None}


def _forget_compiled(before: dict) -> None:
    """The graphs of the codes a probe compiled, dropped: counted toward dynamo's recompile limit on the same
    code the run's layers run, they would be the run's to inherit (a run after many probes would hit the limit
    and train uncompiled). Code the probe did not compile keeps its graphs (a user's own compiled functions)."""
    for code, graphs in _compiled_codes().items():
        if graphs > before.get(code, 0):
            torch._dynamo.reset_code(code)


def _release(trainer: L.Trainer) -> None:
    """Free a finished probe's DeepSpeed engine: its gradient hooks on the parameters form
    reference cycles that keep the engine, the model and the optimizer states alive otherwise."""
    engine = getattr(trainer.strategy, "model", None)
    if hasattr(engine, "destroy"):
        engine.destroy()


@contextlib.contextmanager
def _isolated():
    """Leave no trace of a probe on the run around it: the random states (a probe seeds and trains,
    the run builds its model afterwards) and the environment (Lightning removes WORLD_SIZE and
    others when a run ends)."""
    env = dict(os.environ)
    states = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        os.environ.clear()
        os.environ.update(env)


class ProbeData(L.LightningDataModule):
    """``n`` micro-batches of this rank's shard of the probe's packs: random tokens drawn from the data's
    lengths, or with ``samples`` (a run with images or videos) the run's own samples the level holds, the
    first pack the densest in ``patches``. It carries the probe's level as HBPDataModule carries its
    levels (HBPStrategy reads them there), and builds the batches once the trainer knows the rank and the
    model its vocabulary."""

    def __init__(
        self, level: Level, lengths: np.ndarray, n: int, seed: int, samples=None, patches: np.ndarray | None = None
    ):
        super().__init__()
        self.levels = [level]
        self.lengths, self.n, self.seed = lengths, n, seed
        self.samples, self.patches = samples, patches
        self.tokens = 0.0

    def train_dataloader(self) -> DataLoader:
        lv = self.levels[0]
        sp_rank = sp_coords(self.trainer.global_rank, lv.sp)[1]
        rng = np.random.default_rng(self.seed)  # the same packs on every SP group
        held = np.where(np.asarray(self.lengths) <= lv.pack_len, self.lengths, 0)  # whole samples the level holds
        if self.samples is not None and held.any():
            packs = [densest_members(self.lengths, self.patches, lv.pack_len)]
            packs += [synthetic_members(held, lv.pack_len, rng) for _ in range(self.n - 1)]
            batches = [sample_batch(self.samples, members, lv, sp_rank) for members in packs]
        else:
            vocab = self.trainer.lightning_module.model.config.get_text_config().vocab_size
            batches = [
                synthetic_batch(
                    self.lengths, lv.pack_len, lv.sp, sp_rank, vocab, lv.ckpt_layers, rng, lv.sp_kind, lv.layout[1]
                )
                for _ in range(self.n)
            ]
        self.tokens = float(np.mean([b.n_tokens for b in batches])) / lv.sp  # real tokens per rank
        return DataLoader(batches, batch_size=None)


class ProbeTimer(L.Callback):
    """Times every micro-step after the first ``skip`` (device-synchronized) and tracks the peak
    memory from the start of training: on CUDA what the allocator reserved at most plus what the
    process holds outside it (CUDA context, NCCL buffers), comparable with the device's total."""

    def __init__(self, skip: int):
        self.skip = skip
        self.times: list[float] = []
        self.peak = math.nan
        self._start = 0.0
        self._outside = 0.0

    @property
    def seconds(self) -> float:
        return float(np.mean(self.times)) if self.times else math.inf

    def on_train_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            self._outside = float(total - free - torch.cuda.memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _reset_peak_rss()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _sync(trainer.strategy.root_device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync(trainer.strategy.root_device)
        if batch_idx >= self.skip:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self.peak = float(torch.cuda.max_memory_reserved(device)) + self._outside
        else:
            self.peak = _peak_rss()


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


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    except OSError:
        pass


def _peak_rss() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
