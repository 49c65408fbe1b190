"""Ulysses x context parallelism (CP): the ``cp`` SP kind, for degrees the heads cannot reach alone.

A level of degree sp = ulysses x cp splits its pack twice. The planner's ``split_pack``
(``lit_hbp.packing.context_split``) gives each of the cp CP ranks T / cp tokens of balanced causal
attention area, as document ranges (no padding to multiples of anything); each CP rank's shard is
then cut into ulysses contiguous pieces, one per rank of its Ulysses group (contiguous ranks, inside
a node; CP groups are strided across them, ``lit_hbp.parallel.topology``).

Attention of a layer:

1. Ulysses all-to-all inside the Ulysses group: [1, H, T/sp, D] -> [1, H/ulysses, T/cp, D], the CP
   rank's whole shard over its share of the heads (skipped at ulysses 1);
2. the all-gather K/V algorithm over the CP group (``_CPAttention``), kv heads a slice at a time so
   the gathered K/V of a slice stays about the size of the rank's own K/V (two slices are alive
   while the next one's gather is in flight): all-gather the slice, pick the keys the rank's query
   ranges see (``CPShard.key_index``: range [a, b) of a document sees keys [0, b)), one varlen call
   with separate query and key lengths (causal bottom-right), exact, keeping its output and LSE.
   The backward gathers each slice again and runs the kernel's backward from that output and LSE
   (flash-attn 2/3/4, torch's varlen, the CPU loops; Flex and attention dropout recompute the
   slice's forward instead), then reduce-scatters dK/dV to their owners while the next slice runs,
   summed in fp32 in a fixed order (``gathered_key_grad``) and cast once: the same micro-batch
   gives the same bits on every run. Nothing is merged across steps (no ring, no drift); the
   gathered K/V is never kept;
3. the Ulysses all-to-all back.

The shard's geometry (``CPShard``) is computed on the host by ``shard``, from the pack's document
lengths, and travels with the batch: the step reads nothing back from the device.
"""

from __future__ import annotations

import numpy as np
import torch

from lit_hbp.data.batch import CPShard, PackedBatch
from lit_hbp.data.collate import target_index
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.context_split import ContextSplit, split_pack
from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import Attend, SPKind
from lit_hbp.parallel.topology import heads_problem, kv_slice, layout_coords
from lit_hbp.parallel.ulysses import (
    Ulysses,
    all_gather_flat,
    gather_tokens,
    heads_to_seq,
    own_tokens,
    reduce_scatter_flat,
    replicate_kv,
    seq_to_heads,
    sum_own_tokens,
    sum_ranks,
)


def cp_shard_of(split: ContextSplit, rank: int) -> CPShard:
    """Rank ``rank``'s attention geometry, with its keys located in the rank-ordered all-gather."""
    cu_q, cu_k = split.cu_seqlens_q(rank), split.cu_seqlens_k(rank)
    key_index = split.inverse_permutation()[split.key_index(rank)]
    rounds = split.key_rounds(rank)
    if len(rounds) < 2:
        rounds = []  # every key distinct: nothing adds up
    return CPShard(
        cu_q=torch.from_numpy(cu_q),
        cu_k=torch.from_numpy(cu_k),
        key_index=torch.from_numpy(key_index),
        max_q=int(np.diff(cu_q).max(initial=0)),
        max_k=int(np.diff(cu_k).max(initial=0)),
        key_rounds=tuple((torch.from_numpy(r), torch.from_numpy(key_index[r])) for r in rounds),
    )


def gathered_key_grad(g: torch.Tensor, shard: CPShard, total: int) -> torch.Tensor:
    """The gradient of the all-gathered keys (or values) [1, h, total, D] in fp32 (or ``g``'s dtype
    when wider), from that of the keys the rank's ranges saw (``g``, [1, h, len(key_index), D]): the
    gradient of the index_select. Keys seen by several ranges of a document add up, round by round of
    distinct keys, so the sum has one order and one rounding on every run (an atomic bf16
    scatter-add has neither)."""
    acc = torch.promote_types(g.dtype, torch.float32)
    whole = g.new_zeros(1, g.shape[1], total, g.shape[3], dtype=acc)
    if not shard.key_rounds:
        return whole.index_copy_(2, shard.key_index, g.to(acc))
    for positions, keys in shard.key_rounds:
        whole.index_add_(2, keys, g.index_select(2, positions).to(acc))
    return whole


class _Gathered:
    """An all-gather of a kv-head slice of K and V over the CP group, started asynchronously so the
    kernel of the previous slice runs while it is in flight: [1, h, T/cp, D] of every CP rank ->
    [1, h, T, D], ranks in order (the permuted pack)."""

    def __init__(self, tensors: list[torch.Tensor], ctx: SPContext):
        self.shapes = [x.shape for x in tensors]
        self.srcs = [x.permute(1, 0, 2, 3).contiguous().flatten() for x in tensors]  # [1, h] -> rank-major
        self.bufs = [x.new_empty(ctx.size * x.numel()) for x in tensors]
        self.works = [all_gather_flat(b, x, group=ctx.group, async_op=True) for b, x in zip(self.bufs, self.srcs)]
        self.size = ctx.size

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return [
            buf.view(self.size, h, t, d).permute(1, 0, 2, 3).reshape(1, h, self.size * t, d)
            for buf, (_, h, t, d) in zip(self.bufs, self.shapes)
        ]


class _Scattered:
    """The gradient of ``_Gathered``: [1, h, T, D] of every rank, summed, each rank keeping its rows
    [1, h, T/cp, D]; started asynchronously, so the next slice's backward runs while it is in flight."""

    def __init__(self, x: torch.Tensor, ctx: SPContext):
        _, h, total, d = x.shape
        t = total // ctx.size
        self.src = x.view(h, ctx.size, t, d).permute(1, 0, 2, 3).contiguous().flatten()
        self.out = x.new_empty(h * t * d)
        self.work = reduce_scatter_flat(self.out, self.src, group=ctx.group, async_op=True)
        self.shape = (1, h, t, d)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out.view(self.shape)


class _CPAttention(torch.autograd.Function):
    """Attention of this CP rank's queries over the CP group's K/V, slice of kv heads by slice, the
    gather of slice j + 1 in flight while slice j's kernel runs. The forward keeps each slice's
    output and LSE (``Attend.forward``); the backward gathers each slice again, runs the backward
    kernel from them (``Attend.backward``; backends without one recompute the slice's forward) and
    reduce-scatters dK/dV while the next slice computes."""

    @staticmethod
    def forward(fctx, q, k, v, sinks, ctx: SPContext, shard: CPShard, attend: Attend):
        fctx.ctx, fctx.shard, fctx.attend = ctx, shard, attend
        fctx.seed = int(torch.randint(2**62, ()))  # the host generator: no device read
        slices = _CPAttention._slices(q, k, ctx)
        out = torch.empty_like(q)
        fctx.lse = []
        for i, (qh, _, keys, values) in enumerate(_CPAttention._gathered(k, v, slices, ctx, shard)):
            out[:, qh], lse = attend.forward(
                q[:, qh], keys, values, _heads(sinks, qh), fctx.seed + i, **_geometry(shard)
            )
            fctx.lse.append(lse)
        fctx.save_for_backward(q, k, v, sinks, out)
        return out

    @staticmethod
    def _slices(q, k, ctx: SPContext) -> list[tuple[slice, slice]]:
        """(query heads, kv heads) of every slice."""
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        s = kv_slice(hkv, ctx.size)
        return [(slice(j * group, (j + s) * group), slice(j, j + s)) for j in range(0, hkv, s)]

    @staticmethod
    def _gathered(k, v, slices, ctx: SPContext, shard: CPShard):
        """(query heads, kv heads, keys, values) of every slice: the keys and values its query ranges
        see, out of the slice's all-gather; the next slice's gather is started before this one is used.
        Runs inside the autograd function's forward and backward, where autograd records nothing."""
        pending = _Gathered([k[:, slices[0][1]], v[:, slices[0][1]]], ctx)
        for i, (qh, kh) in enumerate(slices):
            kv = pending.wait()
            if i + 1 < len(slices):
                nxt = slices[i + 1][1]
                pending = _Gathered([k[:, nxt], v[:, nxt]], ctx)
            yield (qh, kh, *(x.index_select(2, shard.key_index) for x in kv))

    @staticmethod
    def backward(fctx, grad):
        q, k, v, sinks, out = fctx.saved_tensors
        ctx, shard = fctx.ctx, fctx.shard
        dq = torch.empty_like(q)
        dsinks = torch.zeros_like(sinks) if sinks is not None else None
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        total = ctx.size * k.shape[2]
        in_flight = None  # the previous slice's dK/dV reduce-scatters: one slice's at a time

        def land(scattered) -> None:
            kh, parts = scattered
            dk[:, kh], dv[:, kh] = (x.wait() for x in parts)

        for i, (qh, kh, keys, values) in enumerate(
            _CPAttention._gathered(k, v, _CPAttention._slices(q, k, ctx), ctx, shard)
        ):
            dq[:, qh], dkeys, dvalues, ds = fctx.attend.backward(
                grad[:, qh], q[:, qh], keys, values, _heads(sinks, qh), out[:, qh], fctx.lse[i], fctx.seed + i,
                **_geometry(shard),
            )  # fmt: skip
            if dsinks is not None:
                dsinks[qh] = ds
            if in_flight is not None:
                land(in_flight)
            # The gradients of the index_select and of the gather, summed in fp32 and cast once on landing.
            wholes = [gathered_key_grad(g, shard, total) for g in (dkeys, dvalues)]
            in_flight = (kh, [_Scattered(x, ctx) for x in wholes])
        land(in_flight)
        return dq, dk, dv, dsinks, None, None, None


def _heads(sinks: torch.Tensor | None, heads: slice) -> torch.Tensor | None:
    return sinks[heads] if sinks is not None else None


def _geometry(shard: CPShard) -> dict:
    return dict(cu_q=shard.cu_q, cu_k=shard.cu_k, max_q=shard.max_q, max_k=shard.max_k)


@torch.compiler.disable  # collectives and host geometry: kept out of compiled graphs
def cp_attention(q, k, v, sinks, ctx: SPContext, shard: CPShard, attend: Attend) -> torch.Tensor:
    """Value heads narrower than the query-key heads (DeepSeek-V3's latent attention: 192 and 128) are zero-padded
    to their width for the slices' LSE kernels, which take one head size (torch's CPU flash kernel), and the output
    cut back: the padded columns are zero and take no gradient."""
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
    return _CPAttention.apply(q, k, v, sinks, ctx, shard, attend)[..., :width]


class ContextParallel(SPKind):
    """Ulysses inside a node x all-gather K/V context parallelism across, the pack split by the
    planner's balanced CP split."""

    name = "cp"

    def shard(self, batch: PackedBatch, sp: int, rank: int) -> PackedBatch:
        """Rank ``rank``'s tokens: its CP rank's balanced ranges, then its contiguous Ulysses piece of
        them; position ids, labels (pre-shifted) and per-sample counts travel with the tokens."""
        cp = int(batch.cp)
        if cp == 1:
            return Ulysses().shard(batch, sp, rank)
        total = batch.input_ids.shape[1]
        if total % sp:
            raise ValueError(f"micro-batch of {total} tokens cannot be split over sp {sp}: pad it to a multiple of sp")
        cp_rank, u_rank = layout_coords(rank, sp // cp)
        split = split_pack(np.diff(batch.cu_seqlens.numpy()).astype(np.int64), cp)
        size = total // sp
        index = torch.from_numpy(split.gather_index(cp_rank)[u_rank * size : (u_rank + 1) * size])
        cut = {key: getattr(batch, key)[:, index] for key in PackedBatch.TOKEN_FIELDS}
        return batch.replace(
            **cut,
            sp=sp,
            sp_rank=rank,
            target_index=target_index(cut["labels"]),
            pack_index=index,
            cp_shard=cp_shard_of(split, cp_rank),
            cp_imbalance=split.imbalance(),
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        ctx: SPContext,
        attend: Attend,
    ) -> torch.Tensor:
        if ctx.cp is None:
            return Ulysses().attend(query, key, value, sinks, ctx, attend)
        shard = attend.shard
        if shard is None:
            raise RuntimeError("context-parallel attention without the micro-batch's CP shard (hbp_cp_shard)")
        u = ctx.ulysses
        if u.size == 1:
            return cp_attention(query, key, value, sinks, ctx.cp, shard, attend)
        check_ulysses = heads_problem(query.shape[1], key.shape[1], u.size)
        if check_ulysses is not None:
            raise ValueError(check_ulysses)
        local = query.shape[1] // u.size
        if sinks is not None:
            sinks = sinks[u.rank * local : (u.rank + 1) * local]
        query = seq_to_heads(query, u)
        key, value = (seq_to_heads(replicate_kv(x, u.size), u) for x in (key, value))
        return heads_to_seq(cp_attention(query, key, value, sinks, ctx.cp, shard, attend), u)

    def mixer_problem(self, cp: int = 1) -> str | None:
        """Context parallelism splits a pack by attention area into document ranges per CP rank; a token
        mixer there is not built (its state would have to cross the CP ranks): refused."""
        if cp == 1:
            return None
        return (
            f"context parallelism (cp {cp}) splits a pack by attention area, and a token mixer's documents over "
            "it are not built: give the level cp: 1 (Ulysses alone, as many ranks as the attention heads allow)"
        )

    def gather_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        if ctx.cp is not None:
            raise ValueError(self.mixer_problem(ctx.cp.size))
        return gather_tokens(x, ctx, dim)

    def own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        return own_tokens(x, ctx, dim)

    def sum_own_tokens(self, x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
        if ctx.cp is not None:
            raise ValueError(self.mixer_problem(ctx.cp.size))
        return sum_own_tokens(x, ctx, dim)

    def sum_ranks(self, x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        if ctx.cp is not None:
            raise ValueError(self.mixer_problem(ctx.cp.size))
        return sum_ranks(x, ctx)

    def check(self, num_heads: int, num_kv_heads: int, sp: int, cp: int = 1) -> int:
        if cp < 1 or sp % cp:
            raise ValueError(f"cp {cp} must be >= 1 and divide sp {sp}")
        u = sp // cp
        problem = heads_problem(num_heads, num_kv_heads, u)
        if problem is not None:
            raise ValueError(f"{problem} (sp {sp} = ulysses {u} x cp {cp}; a larger cp needs fewer heads)")
        return 1 if num_kv_heads % u == 0 else u // num_kv_heads

    def comm_breakdown(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> dict[str, float]:
        """Bytes one rank sends in one layer's forward, per collective family: the Ulysses
        all-to-alls inside its Ulysses group, and the CP all-gather of K/V (bf16; a rank sends its
        own K/V to the cp - 1 others). The backward sends the CP part three times (the gather again,
        and the reduce-scatter of dK/dV in fp32, twice the bytes) and the Ulysses part once."""
        u = sp // cp
        kv = max(model.kv_heads, u)  # kv heads replicated up to the Ulysses degree
        return {
            "ulysses": Ulysses().comm_bytes_per_layer(model, tokens, u),
            "cp": 0.0 if cp == 1 else 2 * tokens * kv * (model.qk_width + model.v_width) * (cp - 1),
        }

    def comm_bytes_per_layer(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> float:
        return sum(self.comm_breakdown(model, tokens, sp, cp).values())

    def layouts(self, world: int, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
        """Every (sp, cp) of powers of two, sp dividing the world, whose Ulysses part the heads allow."""
        out = []
        sp = 1
        while sp <= world:
            if world % sp == 0:
                cp = 1
                while cp <= sp:
                    if heads_problem(num_heads, num_kv_heads, sp // cp) is None:
                        out.append((sp, cp))
                    cp *= 2
            sp *= 2
        return out
