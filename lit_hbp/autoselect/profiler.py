"""Profilers answer one question for the level search: how fast, and in how much memory, does the
model train packs of ``pack_len`` tokens at a given sp and number of checkpointed layers?

``AnalyticProfiler`` prices it with the cost model (no hardware needed); ``MeasuredProfiler`` runs
real micro-steps of the model on the real process group (CUDA peak memory, or peak RSS on CPU).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lit_hbp.costmodel import CostModel, pack_stats, synthetic_pack


@dataclass(frozen=True)
class Measurement:
    """seconds: one micro-step; memory: peak bytes per rank (an estimate may exceed the device;
    None when a real run ran out of memory); tokens: tokens each rank processes per micro-step;
    fits: whether it runs within the device's memory."""

    seconds: float
    memory: float | None
    tokens: float
    fits: bool = True

    @property
    def oom(self) -> bool:
        return not self.fits

    @property
    def tokens_per_second(self) -> float:
        """Per device: the measure candidates are compared by (a larger sp processes fewer tokens
        per rank per step, so raw step times are not comparable)."""
        return 0.0 if self.oom or self.seconds <= 0 else self.tokens / self.seconds


class Profiler(Protocol):
    capacity: float

    def measure(self, pack_len: int, sp: int, ckpt_layers: int) -> Measurement: ...


class AnalyticProfiler:
    """Cost-model profiler: packs filled from the dataset's length distribution. Candidates are
    compared at a fixed global batch (as the paper's profiles are), where the gradient sync costs
    every candidate the same per token, so a micro-step's time leaves it out."""

    def __init__(self, cost: CostModel, lengths, seed: int = 0):
        self.cost = cost
        self.lengths = np.asarray(lengths)
        self.seed = seed
        self.capacity = cost.hardware.memory_bytes
        self._stats: dict[int, tuple[float, float]] = {}

    def measure(self, pack_len: int, sp: int, ckpt_layers: int) -> Measurement:
        if pack_len not in self._stats:
            self._stats[pack_len] = pack_stats(self.lengths, pack_len, self.seed)
        tokens, sum_sq = self._stats[pack_len]
        memory = self.cost.memory_bytes(pack_len, sp, ckpt_layers)
        seconds = self.cost.micro_step(tokens / sp, sum_sq, sp, ckpt_layers)["total"]
        return Measurement(seconds, memory, tokens / sp, memory <= self.capacity)


class MeasuredProfiler:
    """Runs ``steps`` real micro-steps (forward, backward, gradient all-reduce, SGD update) of a
    copy of the model on synthetic packs drawn from the dataset's lengths, on the real world.

    Every rank of the process group must call ``measure`` with the same arguments (the SP groups
    are collectives). Memory is the peak CUDA allocation, or on CPU the peak resident set size
    (reset per measurement through /proc/self/clear_refs). ``capacity`` bounds what fits; the run's
    optimizer states are not allocated here (SGD), so subtract them from it (the data module does).
    ``forward_context`` is the training precision's context (e.g. bf16 autocast). Caveat: a CUDA
    out-of-memory inside an SP all-to-all leaves the group's other ranks waiting; give ``capacity``
    a margin so Algorithm 4's probes stay inside the device.
    """

    def __init__(
        self,
        module_factory,
        lengths,
        sp_groups,
        capacity: float,
        steps: int = 3,
        warmup: int = 1,
        seed: int = 0,
        vocab: int | None = None,
        forward_context=contextlib.nullcontext,
    ):
        self.module_factory = module_factory
        self.forward_context = forward_context
        self.lengths = np.asarray(lengths)
        self.sp_groups = sp_groups
        self.capacity = capacity
        self.steps, self.warmup, self.seed = steps, warmup, seed
        self.vocab = vocab

    def _batch(self, pack_len: int, sp: int, rng: np.random.Generator, vocab: int) -> dict:
        from lit_hbp.data.collate import collate_packs, shard

        take = synthetic_pack(self.lengths, pack_len, rng)
        docs = {i: (rng.integers(0, vocab, int(n)), np.ones(int(n), bool)) for i, n in enumerate(take)}
        batch = collate_packs(
            [np.arange(len(take))],
            docs.__getitem__,
            sp=sp,
            meta={"loss_norm": float(take.sum()), "level": 0, "ckpt_layers": 0},
        )
        return shard(batch, sp, self.sp_groups[sp].rank) if sp > 1 else batch

    def measure(self, pack_len: int, sp: int, ckpt_layers: int) -> Measurement:
        import torch
        import torch.distributed as dist

        from lit_hbp.parallel import context

        module = self.module_factory()
        device = next(module.parameters()).device
        vocab = self.vocab or module.model.config.vocab_size
        module.train()
        module.set_checkpointing(ckpt_layers)
        opt = torch.optim.SGD(module.parameters(), lr=0.0)
        rng = np.random.default_rng(self.seed)
        batch = {
            k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self._batch(pack_len, sp, rng, vocab).items()
        }
        _reset_peak_memory(device)
        context.activate(self.sp_groups[sp])
        seconds = math.inf
        oom = False
        try:
            times = []
            for i in range(self.warmup + self.steps):
                _sync(device)
                start = time.perf_counter()
                with self.forward_context():
                    loss = module(batch)[0]
                loss.backward()
                if dist.is_initialized() and dist.get_world_size() > 1:
                    for p in module.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(device)
                if i >= self.warmup:
                    times.append(time.perf_counter() - start)
            seconds = float(np.median(times))
        except torch.OutOfMemoryError:
            oom = True
        finally:
            context.activate(None)
        memory = None if oom else _peak_memory(device)
        # Every rank must agree on OOM and time (the slowest rank sets the pace).
        if dist.is_initialized() and dist.get_world_size() > 1:
            worst = [seconds, memory] if memory is not None else [math.inf, math.inf]
            t = torch.tensor(worst, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # any OOM is inf on that rank
            seconds, memory = float(t[0]), (None if math.isinf(t[1]) else float(t[1]))
        tokens = batch["input_ids"].shape[1]
        fits = memory is not None and memory <= self.capacity
        return Measurement(seconds if memory is not None else math.inf, memory, float(tokens), fits)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak resident set size (VmHWM)
        except OSError:
            pass


def _peak_memory(device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
