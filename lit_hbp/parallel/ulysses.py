"""Ulysses sequence parallelism: all-to-all between sequence shards and head shards.

Each rank of an SP group of size sp holds a contiguous 1/sp of the pack's tokens with all heads.
``seq_to_heads`` gives every rank 1/sp of the heads over the whole pack, so attention runs on the
full varlen sequence with the pack's global cu_seqlens; ``heads_to_seq`` turns the output back.
Each is the other's gradient. Heads must split over sp; kv heads fewer than sp are replicated.

A token mixer that carries state along a document (``lit_hbp.model.mixers``) has no heads to split
here: ``gather_tokens`` gives every rank the whole pack's inputs of the layer (its gradient: the sum
over the group of each rank's, reduce-scattered), each rank runs the mixer over every document, and
``own_tokens`` keeps its shard of the output. Exact, at the price of the mixer's work done sp times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.collate import target_index
from lit_hbp.model_spec import ModelSpec
from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import Attend, SPKind
from lit_hbp.parallel.topology import heads_problem

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _a2a(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """all_to_all over dim 0 (one chunk per rank of the group)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=ctx.group)
    return out


def _seq_to_heads(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """[1, H, T/sp, D] -> [1, H/sp, T, D]."""
    _, h, t, d = x.shape
    chunks = _a2a(x.reshape(ctx.size, h // ctx.size, t, d), ctx)  # [source rank, H/sp, T/sp, D]
    return chunks.permute(1, 0, 2, 3).reshape(1, h // ctx.size, ctx.size * t, d)


def _heads_to_seq(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """[1, H/sp, T, D] -> [1, H, T/sp, D]."""
    _, h, t, d = x.shape
    chunks = x.reshape(h, ctx.size, t // ctx.size, d).permute(1, 0, 2, 3)  # [dest rank, H/sp, T/sp, D]
    return _a2a(chunks, ctx).reshape(1, h * ctx.size, t // ctx.size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx):
        fctx.sp = ctx
        return _seq_to_heads(x, ctx)

    @staticmethod
    def backward(fctx, grad):
        return _heads_to_seq(grad, fctx.sp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx):
        fctx.sp = ctx
        return _heads_to_seq(x, ctx)

    @staticmethod
    def backward(fctx, grad):
        return _seq_to_heads(grad, fctx.sp), None


@torch.compiler.disable  # a collective into a preallocated buffer: kept out of compiled graphs
def seq_to_heads(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    return _SeqToHeads.apply(x, ctx)


@torch.compiler.disable
def heads_to_seq(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    return _HeadsToSeq.apply(x, ctx)


def _gather(x: torch.Tensor, ctx: SPContext, dim: int) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim`` in rank order."""
    lead = x.movedim(dim, 0).contiguous()
    out = lead.new_empty((ctx.size * lead.shape[0], *lead.shape[1:]))
    all_gather_flat(out, lead, group=ctx.group)
    return out.movedim(0, dim)


def _scatter(x: torch.Tensor, ctx: SPContext, dim: int) -> torch.Tensor:
    """``x`` summed over the ranks, each keeping its 1/size along ``dim``."""
    lead = x.movedim(dim, 0).contiguous()
    out = lead.new_empty((lead.shape[0] // ctx.size, *lead.shape[1:]))
    reduce_scatter_flat(out, lead, group=ctx.group)
    return out.movedim(0, dim)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim):
        fctx.sp, fctx.dim = ctx, dim
        return _gather(x, ctx, dim)

    @staticmethod
    def backward(fctx, grad):
        return _scatter(grad, fctx.sp, fctx.dim), None, None


@torch.compiler.disable
def gather_tokens(x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of a per-token tensor -> the whole pack's, along ``dim``; the
    gradient of a rank's shard is the sum of every rank's gradient of it."""
    if x.is_floating_point() and x.requires_grad:
        return _GatherTokens.apply(x, ctx, dim)
    return _gather(x, ctx, dim)


class _SumOwnTokens(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim):
        fctx.sp, fctx.dim = ctx, dim
        return _scatter(x, ctx, dim)

    @staticmethod
    def backward(fctx, grad):
        return _gather(grad.contiguous(), fctx.sp, fctx.dim), None, None


@torch.compiler.disable
def sum_own_tokens(x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
    """Every rank's whole-pack per-token tensor summed, this rank keeping its contiguous shard along ``dim``;
    the gradient of a rank's tensor is every rank's gradient of its shard, gathered."""
    if x.is_floating_point() and x.requires_grad:
        return _SumOwnTokens.apply(x, ctx, dim)
    return _scatter(x, ctx, dim)


class _SumRanks(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx):
        fctx.sp = ctx
        out = x.clone()
        dist.all_reduce(out, group=ctx.group)
        return out

    @staticmethod
    def backward(fctx, grad):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=fctx.sp.group)
        return out, None


@torch.compiler.disable
def sum_ranks(x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """``x`` summed over the ranks, every rank keeping the sum; the gradient of a rank's ``x`` is every
    rank's gradient of the sum, summed (each rank's loss uses it)."""
    if x.is_floating_point() and x.requires_grad:
        return _SumRanks.apply(x, ctx)
    out = x.clone()
    dist.all_reduce(out, group=ctx.group)
    return out


def own_tokens(x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of a whole pack's per-token tensor."""
    size = x.shape[dim] // ctx.size
    return x.narrow(dim, ctx.rank * size, size)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """Raise unless heads split evenly over sp (kv heads may be replicated up to sp); return how
    many times each kv head is replicated (1: none)."""
    problem = heads_problem(num_heads, num_kv_heads, sp)
    if problem is not None:
        raise ValueError(problem)
    return 1 if num_kv_heads % sp == 0 else sp // num_kv_heads


def replicate_kv(x: torch.Tensor, sp: int) -> torch.Tensor:
    """[1, Hkv, T, D] with Hkv < sp -> [1, sp, T, D]: each kv head repeated for the query heads that
    use it, so every rank receives the kv head of its query heads."""
    hkv = x.shape[1]
    return x if hkv % sp == 0 else x.repeat_interleave(sp // hkv, dim=1)


class Ulysses(SPKind):
    """DeepSpeed-Ulysses: contiguous token shards, all-to-all to head shards around attention."""

    name = "ulysses"

    def shard(self, batch: PackedBatch, sp: int, rank: int) -> PackedBatch:
        """The contiguous 1/sp slice of the token tensors. ``cu_seqlens``/``max_seqlen`` stay global:
        attention runs over the whole pack after the all-to-all."""
        total = batch.input_ids.shape[1]
        if total % sp:
            raise ValueError(f"micro-batch of {total} tokens cannot be split over sp {sp}: pad it to a multiple of sp")
        size = total // sp
        cut = {key: getattr(batch, key)[:, rank * size : (rank + 1) * size] for key in PackedBatch.TOKEN_FIELDS}
        return batch.replace(**cut, sp=sp, sp_rank=rank, target_index=target_index(cut["labels"]))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        ctx: SPContext,
        attend: Attend,
    ) -> torch.Tensor:
        sp = ctx.size
        self.check(query.shape[1], key.shape[1], sp)
        local = query.shape[1] // sp
        if sinks is not None:  # one per query head: this rank's heads
            sinks = sinks[ctx.rank * local : (ctx.rank + 1) * local]
        query = seq_to_heads(query, ctx)
        key, value = (seq_to_heads(replicate_kv(x, sp), ctx) for x in (key, value))
        return heads_to_seq(attend(query, key, value, sinks), ctx)

    def mixer_problem(self, cp: int = 1) -> str | None:
        return None if cp == 1 else f"the ulysses kind has no context parallelism (cp {cp})"

    def gather_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        return gather_tokens(x, ctx, dim)

    def own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        return own_tokens(x, ctx, dim)

    def sum_own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        return sum_own_tokens(x, ctx, dim)

    def sum_ranks(self, x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        return sum_ranks(x, ctx)

    def check(self, num_heads: int, num_kv_heads: int, sp: int, cp: int = 1) -> int:
        if cp != 1:
            raise ValueError(f"the ulysses kind has no context parallelism (cp {cp}): use sp_kind 'cp'")
        return check_heads(num_heads, num_kv_heads, sp)

    def comm_bytes_per_layer(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> float:
        """The four all-to-alls (q, k, v, output) in bf16, at the heads' query-key and value widths; a rank keeps
        1/sp of what it holds."""
        if sp == 1:
            return 0.0
        kv = max(model.kv_heads, sp)  # kv heads are replicated up to sp
        per_token = 2 * (model.heads + kv) * (model.qk_width + model.v_width)
        return tokens * per_token * (sp - 1) / sp
