"""Profilers answer one question for the level search: how fast, and in how much memory, does the
model train packs of ``pack_len`` tokens at a given sp and number of checkpointed layers?

``AnalyticProfiler`` prices it with the cost model (no hardware needed); ``MeasuredProfiler``
(lit_hbp.autoselect.measured) trains a few real steps of the model through HBPStrategy. A ``Candidate``
is one setting the search asked about, with the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.run_settings import refusal
from lit_hbp.cost.sample_packs import pack_mixer_tokens, pack_stats
from lit_hbp.packing.vision_load import VisionLoad


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


@dataclass(frozen=True)
class Candidate:
    """A setting the search priced or probed (pack length, (sp, cp) layout, checkpointed layers, offload,
    MLP tiles) and what the profiler answered."""

    pack_len: int
    sp: int
    ckpt_layers: int | None
    measurement: Measurement | None
    note: str = ""
    cp: int = 1
    offload: bool = False
    tiles: int = 1

    @property
    def layout(self) -> str:
        return str(self.sp) if self.cp == 1 else f"{self.sp}={self.sp // self.cp}x{self.cp}"

    @property
    def memory_note(self) -> str:
        return (" offload" if self.offload else "") + (f" tiles {self.tiles}" if self.tiles > 1 else "")

    @property
    def tokens_per_second(self) -> float:
        return self.measurement.tokens_per_second if self.measurement is not None else 0.0


class Profiler(Protocol):
    capacity: float

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, cp: int = 1) -> Measurement: ...


class MemoryProfiler:
    """The cost model's memory alone, for questions that need no step time: does a level fit, and
    with which lever (``search.fit_anywhere``). ``capacity`` defaults to the GPU's memory;
    ``memory_settings`` False leaves offload and MLP tiles out of the search (a measured search
    probes checkpointing only)."""

    def __init__(self, cost: CostModel, capacity: float | None = None, memory_settings: bool = True):
        self.cost = cost
        self.capacity = cost.hardware.memory_bytes if capacity is None else capacity
        self.memory_settings = memory_settings
        self.tiles_allowed = refusal("mlp_tiles", cost) is None  # set-up refuses them under ZeRO-3

    def measure(
        self, pack_len: int, sp: int, ckpt_layers: int, cp: int = 1, offload: bool = False, tiles: int = 1
    ) -> Measurement:
        memory = self.cost.memory_bytes(pack_len, sp, ckpt_layers, 1, offload, tiles, cp)
        fits = memory <= self.capacity and (not offload or self.cost.host_fits(pack_len, sp, ckpt_layers))
        return Measurement(1.0, memory, pack_len / sp, fits)


class AnalyticProfiler:
    """Cost-model profiler: packs filled from the dataset's length distribution (a vision-language
    run's with their images' encoding, ``vision``: its cost model then carries the most patches a token
    brings, ``with_vision``). Candidates are compared at a fixed global batch (as the paper's profiles
    are), where the gradient sync costs every candidate the same per token, so a micro-step's time leaves
    it out."""

    def __init__(self, cost: CostModel, lengths, seed: int = 0, vision: VisionLoad | None = None):
        self.cost = cost
        self.lengths = np.asarray(lengths)
        self.seed = seed
        self.vision = vision
        self.memory = MemoryProfiler(cost)
        self.capacity = self.memory.capacity
        self.tiles_allowed = self.memory.tiles_allowed
        self._stats: dict[tuple[int, int, int], tuple[float, float, float]] = {}
        self._mixers: dict[tuple[int, int], float] = {}
        self._packs: dict = {}  # pack_stats' packs and splits, drawn once for all layouts of a length

    memory_settings = True
    """It prices offload and MLP tiles too (``search.fit_memory`` tries them)."""

    def measure(
        self, pack_len: int, sp: int, ckpt_layers: int, cp: int = 1, offload: bool = False, tiles: int = 1
    ) -> Measurement:
        """Memory first: a candidate that does not fit is not timed (``seconds`` inf), so the layouts
        a long level runs out of memory in cost no synthetic packs."""
        m = self.memory.measure(pack_len, sp, ckpt_layers, cp, offload, tiles)
        if not m.fits:
            return replace(m, seconds=math.inf)
        key = (pack_len, sp, cp) if cp > 1 else (pack_len, 1, 1)  # only CP splits depend on the layout
        if key not in self._stats:
            work = None if self.vision is None else self.vision.work
            self._stats[key] = pack_stats(
                self.lengths, pack_len, self.seed, sp=key[1], cp=key[2], extra_work=work, model=self.cost.model,
                memo=self._packs,
            )  # fmt: skip
        tokens, sum_sq, vision = self._stats[key]
        mixer = None
        if self.cost.model.mixing:  # a hybrid's mixers: what the busiest rank runs of each pack, padding included
            if (pack_len, sp) not in self._mixers:
                heads = self.cost.model.mixer_heads
                self._mixers[pack_len, sp] = pack_mixer_tokens(self.lengths, pack_len, sp, heads, self.seed)
            mixer = self._mixers[pack_len, sp]
        step = self.cost.micro_step(tokens / sp, sum_sq, sp, ckpt_layers, cp, offload, tiles, vision, mixer)
        seconds = step["total"]
        return Measurement(seconds, m.memory, tokens / sp, True)
