"""The sequence-parallel seam: what a way of splitting one pack over an SP group must provide.

A level names its kind (``Level.sp_kind``, default ``"ulysses"``); everything that depends on how
a pack is split asks the kind: the data loader (``shard``), attention (``attend``), the strategy's
set-up checks (``check``), the cost model (``comm_bytes_per_layer``, ``comm_breakdown``) and the
level search (``layouts``). The built-in kinds are ``ulysses`` (all-to-all over heads) and ``cp``
(Ulysses x context parallelism, ``lit_hbp.parallel.context_parallel``), whose levels have a layout
sp = ulysses x cp; a kind of one's own (ring attention) is one new module with a subclass, named in
a level by its class path (``sp_kind: mypkg.ring.Ring``), and runs levels with cp 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, ClassVar, Protocol

from lit_hbp.errors import did_you_mean
from lit_hbp.packing.levels import validate_levels
from lit_hbp.parallel.topology import resolve_layout

if TYPE_CHECKING:
    import torch

    from lit_hbp.data.batch import PackedBatch
    from lit_hbp.model_spec import ModelSpec
    from lit_hbp.parallel.groups import SPContext

BUILTIN = {"ulysses": "lit_hbp.parallel.ulysses.Ulysses", "cp": "lit_hbp.parallel.context_parallel.ContextParallel"}


class Attend(Protocol):
    """The layer's attention kernel as a kind receives it (``lit_hbp.model.attention.Attend``)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """The single-device varlen kernel over the whole pack's documents (differentiable)."""

    def forward(self, q, k, v, sinks, seed: int, **geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Over query ranges against key prefixes of their own (``geometry``: ``cu_q, cu_k, max_q,
        max_k``; causal bottom-right), outside autograd: the output and the LSE ``backward`` needs."""

    def backward(self, grad, q, k, v, sinks, out, lse, seed: int, **geometry) -> tuple:
        """(dq, dk, dv, dsinks or None) of ``forward``'s output, from its saved output and LSE."""


class SPKind(ABC):
    """One way of running a pack over ``sp`` ranks. Stateless: one instance serves every level."""

    name: ClassVar[str]

    @abstractmethod
    def shard(self, batch: PackedBatch, sp: int, rank: int) -> PackedBatch:
        """The part of the whole (collated, unsharded) micro-batch that SP rank ``rank`` trains."""

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        ctx: SPContext,
        attend: Attend,
    ) -> torch.Tensor:
        """Attention of this rank's shard, [1, H, T/sp, D] in and out (key/value with the model's kv
        heads, not repeated), with ``attend(q, k, v, sinks)`` the single-device varlen kernel over
        the whole pack's ``cu_seqlens``."""

    @abstractmethod
    def check(self, num_heads: int, num_kv_heads: int, sp: int, cp: int = 1) -> int:
        """Raise ValueError naming the problem unless the model's heads can run at ``sp`` (laid out
        as (sp / cp) x cp); return how many copies of each kv head a rank needs (1: none)."""

    @abstractmethod
    def comm_bytes_per_layer(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> float:
        """Bytes one rank sends over the SP group in one layer's forward for ``tokens`` tokens of
        its shard (the cost model prices the passes: forward, backward, recomputation)."""

    def mixer_problem(self, cp: int = 1) -> str | None:
        """Why this kind cannot run a token mixer that carries state along a document
        (``lit_hbp.model.mixers``) at a layout with ``cp``, or None when ``gather_tokens`` can."""
        return f"the {self.name} kind cannot give a token mixer its documents whole (SPKind.gather_tokens)"

    def gather_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a per-token tensor -> the whole pack's, in the pack's order along ``dim``,
        differentiable (a rank's gradient: the sum of every rank's gradient of its shard), so a token
        mixer runs each document whole."""
        raise ValueError(self.mixer_problem())

    def own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a whole pack's per-token tensor (the inverse of ``gather_tokens``)."""
        raise ValueError(self.mixer_problem())

    def sum_own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        """Every rank's whole-pack per-token tensor summed, this rank keeping its shard, differentiable (a
        rank's gradient: every rank's shard of it, gathered): the ranks' parts of a mixer's output, each
        rank having run some of the pack's documents (zeros at the others')."""
        raise ValueError(self.mixer_problem())

    def sum_ranks(self, x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """``x`` summed over the ranks, every rank keeping the sum, differentiable: a reduction over a mixer's
        heads that the ranks share (a gated norm spanning them)."""
        raise ValueError(self.mixer_problem())

    def comm_breakdown(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> dict[str, float]:
        """``comm_bytes_per_layer`` by collective family (reports print them side by side)."""
        return {self.name: self.comm_bytes_per_layer(model, tokens, sp, cp)}

    def layouts(self, world: int, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
        """The (sp, cp) layouts the level search tries: sp a power of two dividing the world, cp 1,
        where ``check`` passes."""
        out, sp = [], 1
        while sp <= world:
            if world % sp == 0:
                try:
                    self.check(num_heads, num_kv_heads, sp)
                    out.append((sp, 1))
                except ValueError:
                    pass
            sp *= 2
        return out

    def degrees(self, world: int, num_heads: int, num_kv_heads: int) -> list[int]:
        """The sp degrees of ``layouts``."""
        return sorted({sp for sp, _ in self.layouts(world, num_heads, num_kv_heads)})


@cache
def resolve_sp_kind(name: str) -> SPKind:
    """The kind a level names: a built-in (``ulysses``) or the class path of an ``SPKind`` subclass."""
    path = BUILTIN.get(name, name)
    module, _, cls = path.rpartition(".")
    try:
        kind = getattr(import_module(module), cls) if module else None
    except ImportError as e:
        raise ValueError(f"sp_kind {name!r}: cannot import {module!r} ({e})") from None
    if not (isinstance(kind, type) and issubclass(kind, SPKind)):
        raise ValueError(
            f"unknown sp_kind {name!r}{did_you_mean(name, BUILTIN)}: use one of {sorted(BUILTIN)} or the class path "
            "of an lit_hbp.parallel.kind.SPKind subclass"
        )
    return kind()


def validate_sp_setup(
    levels, world_size: int, num_heads: int, num_kv_heads: int, num_layers: int, node_size: int | None = None
) -> list[int]:
    """Everything about the levels that can fail before the first step, with the offending level;
    returns how many copies of each kv head each level's SP kind needs (1: none). Levels without a
    (ulysses, cp) layout get the default one for nodes of ``node_size`` ranks (``resolve_layout``)."""
    levels = validate_levels(levels, world_size)
    replication = []
    for i, lv in enumerate(levels):
        lv = resolve_layout(lv, num_heads, num_kv_heads, node_size)
        try:
            replication.append(resolve_sp_kind(lv.sp_kind).check(num_heads, num_kv_heads, lv.sp, lv.layout[1]))
        except ValueError as e:
            raise ValueError(f"level {i} (pack_len {lv.pack_len}, sp {lv.sp}): {e}") from None
        if lv.ckpt_layers > num_layers:
            raise ValueError(
                f"level {i} (pack_len {lv.pack_len}) checkpoints {lv.ckpt_layers} layers but the model has "
                f"{num_layers} decoder layers"
            )
    return replication
