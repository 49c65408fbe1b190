"""The parameters a run holds, counted on its model as it is built (on the meta device: no weights, no memory), for
what the memory model prices as weights, gradients and Adam states (``CostModel.static_parts``).

Counted, not read off the config's formula, because the formula cannot see it: a layer shared between
uses (Zamba's shared transformer block), looped (HRM's, Dory's recurrent layers) or nested in another layer (Zamba's
Mamba layer inside its hybrid layer) holds its parameters once: ``model.parameters()`` counts each tensor once, and
so does ``language_params`` (the FLOPs are priced per layer: ``ModelSpec.active_layer_params``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def numel(p: torch.Tensor) -> int:
    """A parameter's elements, at its full shape under ZeRO-3 (which keeps a rank's partition in ``p``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def count(params: Iterable[torch.Tensor]) -> int:
    """Elements of ``params``, each tensor once (a tensor shared by several modules, a tied head)."""
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return sum(numel(p) for p in seen.values())


def language_params(net: torch.nn.Module, tower: float = 0.0) -> float:
    """The language model's parameters, each tensor once: all of ``net``'s less a vision-language model's
    ``tower`` (its encoder and projectors as ``VisionSpec.params`` prices them: the two add up to what the model
    holds, wherever its family keeps its tower)."""
    return float(count(net.parameters())) - tower
