"""A second sequence-parallel kind, written the way a user would add one (one module, one class):
every rank all-gathers the whole pack's q, k and v, runs attention over it, and keeps its own rows.
Wasteful (each rank computes all of attention) but simple and exact, so it shows the seam carries a
kind that is not Ulysses: no head divisibility, different traffic."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_hbp.data.batch import PackedBatch
from lit_hbp.model_spec import ModelSpec
from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import Attend, SPKind
from lit_hbp.parallel.ulysses import Ulysses


class _Gather(torch.autograd.Function):
    """[1, H, T/sp, D] shards -> the whole [1, H, T, D]; backward: sum the ranks' gradients and keep
    this rank's rows (a reduce-scatter, written with all_reduce so gloo runs it in a subgroup)."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        fctx.sp = ctx
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        ctx = fctx.sp
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = grad.shape[2] // ctx.size
        return grad[:, :, ctx.rank * size : (ctx.rank + 1) * size], None


class GatherAll(SPKind):
    name = "gather_all"

    def shard(self, batch: PackedBatch, sp: int, rank: int) -> PackedBatch:
        return Ulysses().shard(batch, sp, rank)  # contiguous shards, like Ulysses

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        ctx: SPContext,
        attend: Attend,
    ) -> torch.Tensor:
        whole = [_Gather.apply(x, ctx) for x in (query, key, value)]
        out = attend(*whole, sinks)
        size = query.shape[2]
        return out[:, :, ctx.rank * size : (ctx.rank + 1) * size]

    def check(self, num_heads: int, num_kv_heads: int, sp: int, cp: int = 1) -> int:
        return 1

    def comm_bytes_per_layer(self, model: ModelSpec, tokens: float, sp: int, cp: int = 1) -> float:
        if sp == 1:
            return 0.0
        return tokens * 2 * (model.heads + 2 * model.kv_heads) * model.dim * (sp - 1)
