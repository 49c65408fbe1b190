"""Packing levels: one pack length with its own sequence-parallel degree and checkpointing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_hbp.errors import ConfigError  # pure Python: the planner still imports numpy only

LAYOUT_KINDS = ("ulysses", "cp")
"""The built-in SP kinds whose levels have a (ulysses, cp) layout: ``cp`` runs every cp > 1."""


@dataclass(frozen=True)
class Level:
    """A packing group of HBP.

    pack_len: tokens a pack of this level may hold.
    sp: sequence-parallel degree; the world splits into world_size / sp groups of contiguous ranks.
    ckpt_layers: decoder layers (counted from the first) run under activation checkpointing.
    packs_per_rank: packs each SP group holds per micro-step (the paper's local batch B).
    sp_kind: how a pack is split over its SP group when sp > 1: ``ulysses`` (default), ``cp``
        (Ulysses x context parallelism) or the class path of an ``lit_hbp.parallel.kind.SPKind``
        subclass. The plan does not depend on it.
    offload: keep the inputs of the checkpointed layers in host memory (pinned, copied on a side stream)
        from their forward to their recompute, instead of on the device: for levels whose
        checkpointed inputs alone fill the device. Needs ckpt_layers > 0.
    mlp_tiles: run each decoder layer's MLP over the rank's tokens in this many tiles, recomputing a
        tile's intermediate in the backward, so a layer's working set stops growing with the pack
        (1: untiled).
    ulysses, cp: the layout of sp = ulysses x cp for the built-in kinds: Ulysses all-to-all over
        ``ulysses`` ranks (inside a node), context parallelism over ``cp`` (across). Give one, both or
        neither: by default (``resolve_layout``, once the model is known) Ulysses takes the largest
        degree the model's heads allow and CP the rest. A level with cp > 1 runs the ``cp`` kind.
    """

    pack_len: int
    sp: int = 1
    ckpt_layers: int = 0
    packs_per_rank: int = 1
    sp_kind: str = "ulysses"
    ulysses: int | None = None
    cp: int | None = None
    offload: bool = False
    mlp_tiles: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.sp_kind, str) or not self.sp_kind:
            raise TypeError(f"Level.sp_kind must be a non-empty string, got {self.sp_kind!r}")
        if not isinstance(self.offload, bool):
            raise TypeError(f"Level.offload must be true or false, got {self.offload!r}")
        for name in ("pack_len", "sp", "ckpt_layers", "packs_per_rank", "ulysses", "cp", "mlp_tiles"):
            value = getattr(self, name)
            if value is None and name in ("ulysses", "cp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Level.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.pack_len < 1:
            raise ConfigError(f"Level.pack_len must be >= 1, got {self.pack_len}")
        if self.sp < 1:
            raise ConfigError(f"Level.sp must be >= 1, got {self.sp}")
        if self.ckpt_layers < 0:
            raise ConfigError(f"Level.ckpt_layers must be >= 0, got {self.ckpt_layers}")
        if self.packs_per_rank < 1:
            raise ConfigError(f"Level.packs_per_rank must be >= 1, got {self.packs_per_rank}")
        if self.mlp_tiles < 1:
            raise ConfigError(f"Level.mlp_tiles must be >= 1, got {self.mlp_tiles}")
        if self.offload and self.ckpt_layers == 0:
            raise ConfigError(
                "Level.offload keeps the checkpointed layers' inputs on the host, and this level checkpoints none "
                "(ckpt_layers 0): give ckpt_layers (offload usually goes with every layer checkpointed)"
            )
        if self.pack_len < self.sp:
            raise ConfigError(f"Level.pack_len ({self.pack_len}) is smaller than its sp degree ({self.sp})")
        if self.mlp_tiles > self.pack_len // self.sp:
            raise ConfigError(
                f"Level.mlp_tiles ({self.mlp_tiles}) exceeds the tokens of a rank ({self.pack_len} / sp {self.sp})"
            )
        self._fill_layout()

    def _fill_layout(self) -> None:
        """Complete (ulysses, cp) from sp when one is given, check their product, and name the ``cp``
        kind for a level with cp > 1 (frozen: set through object.__setattr__, once, here)."""
        u, cp = self.ulysses, self.cp
        for name, value in (("ulysses", u), ("cp", cp)):
            if value is not None and (value < 1 or self.sp % value):
                raise ConfigError(f"Level.{name} ({value}) must be >= 1 and divide sp ({self.sp})")
        if u is not None and cp is None:
            cp = self.sp // u
        elif cp is not None and u is None:
            u = self.sp // cp
        if u is not None and u * cp != self.sp:
            raise ConfigError(f"Level.ulysses ({u}) x Level.cp ({cp}) must equal sp ({self.sp})")
        if u is None and self.sp_kind == LAYOUT_KINDS[1] and self.sp > 1:  # the default layout may have no CP
            raise ConfigError(
                f"Level(pack_len {self.pack_len}, sp {self.sp}): sp_kind 'cp' without its layout would train the "
                "default one, Ulysses first, maybe without context parallelism: give cp (and ulysses), e.g. "
                f"cp: {self.sp}"
            )
        if cp is not None and cp > 1 and self.sp_kind not in LAYOUT_KINDS:
            raise ConfigError(f"Level.cp ({cp}) needs sp_kind {LAYOUT_KINDS[1]!r}, not {self.sp_kind!r}")
        kind = LAYOUT_KINDS[1] if cp is not None and cp > 1 else self.sp_kind
        if u is not None and cp == 1 and self.sp_kind == LAYOUT_KINDS[1]:
            kind = LAYOUT_KINDS[0]
        for name, value in (("ulysses", u), ("cp", cp), ("sp_kind", kind)):
            object.__setattr__(self, name, value)

    @property
    def layout_note(self) -> str:
        """`` (ulysses U x cp C)`` for a level with context parallelism, else empty: for logs."""
        u, cp = self.layout
        return f" (ulysses {u} x cp {cp})" if cp > 1 else ""

    @property
    def memory_note(self) -> str:
        """`` offload`` / `` mlp_tiles N`` where the level has them, else empty: for logs."""
        return (" offload" if self.offload else "") + (f" mlp_tiles {self.mlp_tiles}" if self.mlp_tiles > 1 else "")

    @property
    def layout(self) -> tuple[int, int]:
        """(ulysses, cp) of the level (cp 1 until ``resolve_layout`` fills in a default one)."""
        return (self.ulysses, self.cp) if self.cp is not None else (self.sp, 1)

    @classmethod
    def parse(cls, spec: str) -> Level:
        """Parse ``PACK_LEN[:SP[:CKPT_LAYERS[:PACKS_PER_RANK]]]``, e.g. ``131072:8:28``; K/M suffixes allowed."""
        parts = spec.split(":")
        if not 1 <= len(parts) <= 4 or any(p == "" for p in parts):
            raise ConfigError(f"bad level spec {spec!r}: expected PACK_LEN[:SP[:CKPT_LAYERS[:PACKS_PER_RANK]]]")
        try:
            values = [_parse_count(p) for p in parts]
        except ValueError as e:
            raise ConfigError(f"bad level spec {spec!r}: {e}") from None
        return cls(*values)


def _parse_count(text: str) -> int:
    text = text.strip()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not (digits.isascii() and digits.isdigit()):
        raise ConfigError(f"{text!r} is not a non-negative integer")
    return int(digits) * scale


LEVEL_FIELDS = ("pack_len", "sp", "ckpt_layers", "packs_per_rank", "sp_kind", "ulysses", "cp", "offload", "mlp_tiles")
COUNT_FIELDS = ("pack_len", "sp", "ckpt_layers", "packs_per_rank", "ulysses", "cp", "mlp_tiles")


def as_level(spec: Level | dict | str | int, label: str = "level") -> Level:
    """Accept the ways configs write a level: a Level, a mapping (counts as integers or with a K/M
    suffix, ``{pack_len: 4K}``), ``"16K:1"`` or a bare pack length. A bad one is a ConfigError naming
    ``label`` (``data.levels[1]``), the field and what it takes."""
    if isinstance(spec, Level):
        return spec
    if isinstance(spec, str):
        try:
            return Level.parse(spec)
        except ConfigError as e:
            raise ConfigError(f"{label}: {e}") from None
    if isinstance(spec, int) and not isinstance(spec, bool):
        return Level(spec)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(LEVEL_FIELDS))
        if unknown:
            raise ConfigError(f"{label}: unknown level field(s) {unknown}; a level takes {', '.join(LEVEL_FIELDS)}")
        values = dict(spec)
        for key in COUNT_FIELDS:
            value = values.get(key)
            if isinstance(value, str):
                try:
                    values[key] = _parse_count(value)
                except ConfigError:
                    value = None
            if values.get(key) is not None and (isinstance(values[key], bool) or not isinstance(values[key], int)):
                raise ConfigError(
                    f"{label}: {key} must be a whole number (e.g. 4096, or 4K = 4096, 1M = 1048576), got {spec[key]!r}"
                )
        try:
            return Level(**values)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{label}: {e}") from None
    raise ConfigError(
        f"{label}: cannot read a level from {spec!r}: give PACK_LEN[:SP[:CKPT_LAYERS[:PACKS_PER_RANK]]] "
        "(e.g. 16K:1) or a mapping {pack_len, sp, ckpt_layers, ...}"
    )


class LevelSelector(ABC):
    """Chooses a run's levels at set-up from its sample lengths (``HBPDataModule(levels=selector)``).
    Selection sits above the data side: implementations (``lit_hbp.autoselect.AnalyticSelector``,
    ``MeasuredSelector``) read the model and the world from the trainer and hand back levels."""

    @abstractmethod
    def levels_for(self, lengths: np.ndarray, trainer: Any, vision: Any = None) -> tuple[Level, ...]:
        """The levels for samples of ``lengths`` in the run ``trainer`` is setting up; ``vision``: a
        vision-language run's images and videos per sample (``lit_hbp.packing.VisionLoad``), None for
        text (a selector that cannot count the tower's work and memory refuses it)."""


def validate_levels(levels: Sequence[Level | dict | str | int], world_size: int) -> tuple[Level, ...]:
    """Check a level list against the world; return it as a tuple of Level.

    Levels must be strictly increasing in pack_len (a config typo otherwise silently reorders data),
    and every sp must divide the world size so the SP groups tile the ranks.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    out = tuple(as_level(x, f"levels[{i}]") for i, x in enumerate(levels))
    if not out:
        raise ConfigError("no levels given: at least one Level(pack_len, sp) is needed")
    lens = [lv.pack_len for lv in out]
    for i in range(1, len(lens)):
        if lens[i] <= lens[i - 1]:
            raise ConfigError(
                f"levels must be strictly increasing in pack_len, got {lens}: "
                f"level {i} ({lens[i]}) <= level {i - 1} ({lens[i - 1]})"
            )
    for i, lv in enumerate(out):
        if lv.sp > world_size:
            raise ConfigError(f"level {i} (pack_len {lv.pack_len}) has sp {lv.sp} > world_size {world_size}")
        if world_size % lv.sp:
            raise ConfigError(
                f"world_size {world_size} is not divisible by sp {lv.sp} of level {i} (pack_len {lv.pack_len})"
            )
    return out


def sp_coords(rank: int, sp: int) -> tuple[int, int]:
    """(SP group index, rank inside the group) of a global rank under degree ``sp``."""
    return rank // sp, rank % sp
