"""Chunked cross-entropy and the loss normalizers (DESIGN.md section 5).

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

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NORMALIZERS = ("ave_token", "token_mean", "sample_mean", "sum")


def token_weights(batch: dict, normalizer: str) -> torch.Tensor:
    """Weight of each token's loss in ``batch`` (shape of labels; zero where labels == -100)."""
    labels = batch["labels"]
    sp = batch.get("sp", 1)
    if normalizer == "ave_token":
        w = torch.full(labels.shape, 1.0 / batch["loss_norm"], device=labels.device)
    elif normalizer == "token_mean":
        w = torch.full(labels.shape, sp / max(batch["n_targets"], 1), device=labels.device)
    elif normalizer == "sample_mean":
        w = sp / (max(batch["n_loss_samples"], 1) * batch["sample_targets"].clamp(min=1))
    elif normalizer == "sum":
        w = torch.full(labels.shape, float(sp), device=labels.device)
    else:
        raise ValueError(f"loss normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
    return torch.where(labels != -100, w, torch.zeros_like(w))


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of weight * CE, sum of CE (detached), number of supervised tokens) over ``hidden`` [T, H].

    Only supervised positions go through the LM head. With none, one position runs with weight 0
    so every rank's backward touches the same parameters (collective hooks stay matched).
    """
    sel = labels != -100
    n = int(sel.sum())
    if n == 0:
        sel = torch.zeros_like(sel)
        sel[0] = True
        target = torch.zeros(1, dtype=labels.dtype, device=labels.device)
        weight = torch.zeros(1, dtype=torch.float32, device=labels.device)
    else:
        target, weight = labels[sel], weights[sel].float()
    h = hidden[sel]

    def chunk_loss(h_chunk, y_chunk, w_chunk):
        logits = lm_head(h_chunk).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        ce = F.cross_entropy(logits, y_chunk, reduction="none")
        return (ce * w_chunk).sum(), ce.detach().sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    ce_sum = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        loss, ce = checkpoint(chunk_loss, h[part], target[part], weight[part], use_reentrant=False)
        total = total + loss
        ce_sum = ce_sum + ce
    return total, (ce_sum if n else ce_sum * 0), n
