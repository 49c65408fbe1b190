"""Chunked cross-entropy and the loss normalizers (docs/design.md section 5).

Logits of 16K tokens x 128K vocabulary do not fit in memory, so the LM head and the
cross-entropy run chunk by chunk over the supervised positions only, each chunk under
non-reentrant checkpointing: its logits are freed after the forward and recomputed in backward.

Every normalizer is a per-token weight on the summed cross-entropy, computed from counts of the
whole micro-batch (not the shard), so sequence-parallel shards add up to the same loss:
- ``ave_token`` (default, HBP's Ave-Token): 1 / loss_norm, loss_norm = supervised tokens of the
  optimizer step / (N * A). With gradients averaged over N ranks and A micro-steps the update is
  the token mean over the whole step, however it is split over DP, SP and accumulation.
- ``token_mean``: mean over the micro-batch's supervised tokens.
- ``sample_mean``: mean over the micro-batch's samples of each sample's token mean.
- ``sum``: summed token losses of the micro-batch.
The last three are per micro-batch as in the paper's Table 11; they are scaled by sp so that,
after averaging over all N ranks, each SP group counts as one data-parallel replica.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_hbp.data.batch import PackedBatch

NORMALIZERS = ("ave_token", "token_mean", "sample_mean", "sum")


def token_scale(batch: PackedBatch, normalizer: str) -> float | None:
    """The weight of every supervised token of ``batch`` when it is one number (all normalizers
    but ``sample_mean``, whose weight depends on the token's sample), else None."""
    sp = batch.sp
    if normalizer == "ave_token":
        if batch.loss_norm is None:
            raise ValueError(
                "the ave_token loss weighs a token by the optimizer step's supervised tokens over all ranks and "
                "micro-batches, which HBPDataModule's plan knows before the step; this micro-batch has no loss_norm "
                "(your own DataLoader): use the token_mean or sum loss, or pass loss_norm to pack_samples "
                "(lit_hbp.step_loss_norm(the_steps_micro_batches) gives it; batch.replace(loss_norm=norm) sets it)"
            )
        norm = batch.loss_norm
        if isinstance(norm, torch.Tensor):
            raise TypeError(
                f"loss_norm must be a Python number (float(...) of it: the step's supervised tokens per rank and "
                f"micro-batch, step_loss_norm), got a tensor {norm!r}: a tensor's value would be read from the "
                "device on every micro-batch"
            )
        if isinstance(norm, bool) or not isinstance(norm, numbers.Real) or not 0 < norm < float("inf"):
            raise ValueError(
                f"loss_norm must be a finite number > 0 (the step's supervised tokens per rank and micro-batch: "
                f"step_loss_norm), got {norm!r}: 0, negative or NaN would divide by nothing or ascend the loss"
            )
        return 1.0 / norm
    if normalizer == "token_mean":
        return sp / max(batch.n_targets, 1)
    if normalizer == "sum":
        return float(sp)
    if normalizer == "sample_mean":
        return None
    raise ValueError(f"loss normalizer must be one of {NORMALIZERS}, got {normalizer!r}")


def step_loss_norm(micro_batches: Sequence[PackedBatch], group: torch.distributed.ProcessGroup | None = None) -> float:
    """The ``ave_token`` normalizer of one optimizer step over your own data: ``micro_batches`` are this
    rank's micro-batches of the step (the same count on every rank), their supervised tokens summed
    over the ranks of ``group`` (torch.distributed's world when it is initialized), divided by ranks x
    micro-batches. Set it on each (``batch.replace(loss_norm=...)``, or ``pack_samples(..., loss_norm=)``):
    with gradients averaged over the ranks and the accumulated micro-batches, the update is the token
    mean over the whole step. Sequence-parallel levels take it from HBPDataModule's plan instead."""
    batches = list(micro_batches)
    if not batches:
        raise ValueError("step_loss_norm needs this rank's micro-batches of the step, got none")
    if any(int(b.sp) != 1 for b in batches):
        raise ValueError("step_loss_norm counts whole packs per rank: levels with sp > 1 take HBPDataModule's plan")
    total = float(sum(b.n_targets for b in batches))
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size(group)
        nccl = torch.distributed.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        counts = torch.tensor([total, float(len(batches))], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(counts, group=group)
        total, micro = counts.tolist()
        if micro != len(batches) * world:
            raise ValueError(
                f"step_loss_norm: this rank has {len(batches)} micro-batches in the step but the ranks have "
                f"{int(micro)} in all: every rank must run the same number"
            )
    return max(total, 1.0) / (world * len(batches))


def token_weights(batch: PackedBatch, normalizer: str) -> torch.Tensor:
    """Weight of each token's loss in ``batch`` (shape of labels; zero where labels == -100)."""
    labels = batch.labels
    scale = token_scale(batch, normalizer)
    if scale is not None:
        w = torch.full(labels.shape, scale, device=labels.device)
    else:
        # sample_targets is an integer tensor (exact under any precision plugin); the weights are fp32.
        w = batch.sp / (max(batch.n_loss_samples, 1) * batch.sample_targets.clamp(min=1).float())
    return torch.where(labels != -100, w, torch.zeros_like(w))


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    weights: torch.Tensor | float,
    index: torch.Tensor | None = None,
    chunk_size: int = 1024,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of weight * CE, sum of CE (detached), number of supervised tokens) over ``hidden`` [T, H];
    ``head`` maps hidden states to logits of fp32 at least (``lit_hbp.model.head.OutputHead.logits``).

    Only supervised positions go through the LM head: ``index`` lists them (the collate step
    computes it on the host, so nothing is read back from the device here); found from ``labels``
    when None. With none, one position runs with weight 0 so every rank's backward touches the same
    parameters (collective hooks stay matched). ``weights`` is per token, or one number for all.
    ``recompute=False`` keeps each chunk's logits for the backward instead of recomputing them.
    """
    if index is None:
        index = torch.nonzero(labels != -100).flatten()
    n = index.shape[0]
    h, target = _supervised(hidden, labels, index)
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least; a float64 run's loss stays float64
    if n == 0:
        weight = torch.zeros(1, dtype=acc, device=hidden.device)
    elif torch.is_tensor(weights):
        weight = weights.index_select(0, index).to(acc)
    else:
        weight = torch.full((n,), float(weights), dtype=acc, device=hidden.device)

    def chunk_loss(h_chunk, y_chunk, w_chunk):
        logits = head(h_chunk).to(acc)
        ce = F.cross_entropy(logits, y_chunk, reduction="none")
        return (ce * w_chunk).sum(), ce.detach().sum()

    total = hidden.new_zeros((), dtype=acc)
    ce_sum = hidden.new_zeros((), dtype=acc)
    for start in range(0, h.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        args = (h[part], target[part], weight[part])
        loss, ce = checkpoint(chunk_loss, *args, use_reentrant=False) if recompute else chunk_loss(*args)
        total = total + loss
        ce_sum = ce_sum + ce
    return total, ce_sum, n


def _supervised(hidden, labels, index):
    """(hidden rows, targets) of the supervised positions; one dummy position when there is none."""
    if index.shape[0] == 0:
        index = torch.zeros(1, dtype=torch.long, device=hidden.device)
        return hidden.index_select(0, index), torch.full((1,), -100, dtype=labels.dtype, device=labels.device)
    return hidden.index_select(0, index), labels.index_select(0, index)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    head,
    labels: torch.Tensor,
    weight: float,
    index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``chunked_cross_entropy`` with one weight for all tokens, through Liger's fused linear
    cross-entropy kernel (CUDA, Triton): the LM head and the loss in one pass, logits never stored,
    the head's gradient accumulated in fp32. ``head`` is an OutputHead without a bias when it scales
    its logits (the scale goes on the input). Liger reads two values on the host per call (the
    supervised count in forward, ``grad_output == 1`` in backward): two syncs per micro-step."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h, target = _supervised(hidden, labels, index)
    h = head.inputs(h)
    if head.scale != 1.0:
        h = h * head.scale
    linear = head.linear
    ce = liger_fused_linear_cross_entropy(
        h,
        linear.weight,
        target,
        getattr(linear, "bias", None),
        reduction="sum",
        softcap=head.softcap,
        accum_dtype=torch.float32,  # the LM head's gradient summed over chunks in fp32, not bf16
    )
    return ce * weight, ce.detach(), index.shape[0]


def check_loss_function(net: torch.nn.Module) -> None:
    """Refuse a model whose own loss is not transformers' causal-LM cross-entropy (``model.loss_function = fn``,
    or a ``loss_type`` naming another): ``packed_loss`` computes that cross-entropy from the hidden states and
    would train without the replacement (``prepare_model``, and ``packed_loss`` for one made after it). A forward
    that never calls ``loss_function`` is not changed by it."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    from lit_hbp.model.head import _forward_source

    causal = LOSS_MAPPING["ForCausalLM"]
    own = net.__dict__.get("_loss_function")  # what transformers' loss_function setter stores
    loss_type = getattr(net, "loss_type", None)
    if (own if own is not None else LOSS_MAPPING.get(loss_type, causal)) is causal:
        return
    source = _forward_source(type(net))
    if source is not None and "loss_function" not in source:
        return
    what, fix = (
        (f"loss_function = {getattr(own, '__qualname__', type(own).__name__)}", "del model._loss_function")
        if own is not None
        else (f"loss_type {loss_type!r}", "model.loss_type = 'ForCausalLM'")
    )
    raise ValueError(
        f"{type(net).__name__}: its own loss is replaced ({what}), which packed_loss does not compute (it trains "
        f"the supervised tokens' cross-entropy): restore the model's own ({fix}), or compute that loss yourself"
    )
