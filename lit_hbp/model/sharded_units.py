"""FSDP2 (``torch.distributed.fsdp.fully_shard``) units that a packed call would never gather.

``packed_loss`` calls the model's decoder and its output layer, not the model's own forward: a unit's forward
hook gathers its sharded weights, so a weight that only the whole model's unit holds (``fully_shard`` on each
decoder layer, then on the whole causal LM: the embedding, the final norm, the head) stays sharded, and the
packed call stopped inside the embedding ("got mixed torch.Tensor and DTensor"). Refused by name, with the
layout that works: the decoder and the head as units of their own.
"""

from __future__ import annotations

import sys

import torch


def refuse_whole_model_shards(net: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """Raise where ``net`` is an FSDP2 unit holding sharded weights that no unit of ``decoder`` or ``head`` (what
    the packed call runs) gathers; nothing without FSDP2 (its module not imported, or ``net`` not sharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    unit = getattr(fsdp, "FSDPModule", None)
    if unit is None or not isinstance(net, unit):
        return
    from torch.distributed.tensor import DTensor

    gathered = {
        id(p)
        for part in (decoder, head)
        if part is not None
        for m in part.modules()
        if isinstance(m, unit)
        for p in m.parameters()
    }
    left = [n for n, p in net.named_parameters() if isinstance(p, DTensor) and id(p) not in gathered]
    if left:
        kind = next(c for c in type(net).__mro__ if not issubclass(c, unit)).__name__  # not FSDP's subclass
        names = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        raise ValueError(
            f"{kind} is sharded by fully_shard as a whole, and packed_loss calls its decoder and "
            f"output layer, not its forward: {names} would never be gathered. Shard the decoder and the output "
            "layer as units of their own (after the decoder's layers): fully_shard(model.model), "
            "fully_shard(model.lm_head), then fully_shard(model) (docs/lightning.md)"
        )
