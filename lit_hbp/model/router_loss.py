"""A mixture of experts' router loss in a packed call: the load-balancing loss the family's own forward adds when
``output_router_logits`` is set (its ``load_balancing_loss_func``, its weight), over the real tokens of the whole
pack, gathered over a sequence-parallel level's ranks; a family whose router loss lit-hbp does not know is refused
(``prepare_model``, and ``packed_loss`` for a flag set after it)."""

from __future__ import annotations

import math
import sys

import torch

from lit_hbp.data.batch import PackedBatch
from lit_hbp.moe_spec import EXPERT_COUNT, EXPERTS_PER_TOKEN
from lit_hbp.parallel.context import SPCall, sp_call


def _first(config, names):
    return next((getattr(config, n) for n in names if getattr(config, n, None)), None)


def experts_of_model(net: torch.nn.Module) -> tuple[int | None, int | None]:
    """(experts, experts per token) as the family's forward passes them to its router loss: the model's own
    ``num_experts`` / ``num_experts_per_tok`` where its ``__init__`` sets them (DBRX's from ``ffn_config``), else
    its config's."""
    config = net.config.get_text_config()
    own = [getattr(net, n, None) for n in ("num_experts", "num_experts_per_tok")]
    found = [_first(config, EXPERT_COUNT), _first(config, EXPERTS_PER_TOKEN)]
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) else f for v, f in zip(own, found))


ROUTER_CP = (
    "{family}: its router loss (output_router_logits) is a mean over the whole pack's tokens, which this level's SP "
    "kind ({kind}, cp {cp}) does not gather: give the level cp: 1 (Ulysses alone), or set output_router_logits: false"
)


def router_aux_loss(net: torch.nn.Module, router_logits, batch: PackedBatch) -> torch.Tensor:
    """The load-balancing loss the family's forward adds when ``output_router_logits`` is set (its own
    ``load_balancing_loss_func``), over the real tokens of ``batch``'s whole pack (not its padding segment). The
    loss is a product of two means over the tokens, so on a sequence-parallel level every rank computes it over
    the whole pack's router logits, gathered by the level's SP kind (differentiable: a rank's shard gets the sum
    of every rank's gradient of it, and the group's ranks average to the pack's own gradient). An empty pack (a
    level's completion pack, no real token) has none: 0, where the family's function divides 0 by 0 (a NaN loss
    and NaN gradients on every rank after the step's all-reduce)."""
    config = net.config.get_text_config()
    fn = sys.modules[type(net).__module__].load_balancing_loss_func
    if batch.n_tokens == 0:
        return sum(x.sum() for x in router_logits) * 0.0  # in the graph: every rank's parameters take a gradient
    sp = sp_call(batch)
    local = int(batch.input_ids.shape[1])
    if sp is not None:
        router_logits = tuple(_whole_pack(x, local, sp, config.model_type) for x in router_logits)
    whole = sp is not None  # the gathered logits are the whole pack's, in its order
    positions = torch.arange(local * sp.size, device=batch.input_ids.device) if whole else batch.positions_in_pack()
    real = (positions < batch.n_tokens)[None]
    aux = fn(router_logits, *experts_of_model(net), real)
    return _router_coefficient(net) * aux


def _router_coefficient(net: torch.nn.Module) -> float | None:
    """The router loss's weight as the family's forward takes it: the model's own attribute where its
    ``__init__`` sets one (DBRX's from ``ffn_config.moe_loss_weight``, JetMoE's ``aux_loss_coef``), else its
    config's."""
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        if isinstance(getattr(net, name, None), (int, float)):
            return getattr(net, name)
    return getattr(net.config.get_text_config(), "router_aux_loss_coef", None)


def _whole_pack(logits: torch.Tensor, local: int, sp: SPCall, family: str) -> torch.Tensor:
    """A layer's router logits of this rank's ``local`` tokens -> the whole pack's, in its order."""
    dim = next((d for d, n in enumerate(logits.shape[:-1]) if n == local), None)
    if dim is None or math.prod(logits.shape[:-1]) != local:
        raise ValueError(f"{family}: router logits of shape {tuple(logits.shape)} for a shard of {local} tokens")
    try:
        return sp.kind.gather_tokens(logits, sp.ctx, dim)
    except ValueError:
        raise ValueError(ROUTER_CP.format(family=family, kind=sp.kind.name, cp=sp.ctx.cp_size)) from None


def check_router_loss(net: torch.nn.Module) -> None:
    """A config asking for the router loss (a packed call's, its language model's) trains with it, or is refused
    here (``prepare_model``, and ``packed_loss`` for a flag set after it)."""
    config = net.config.get_text_config()
    if not getattr(config, "output_router_logits", False):
        return
    module = sys.modules[type(net).__module__]
    has = hasattr(module, "load_balancing_loss_func")
    experts, top_k = experts_of_model(net)
    if not (has and experts and top_k):
        why = "no load_balancing_loss_func in its modeling module" if not has else "no expert count found"
        raise ValueError(
            f"{net.config.model_type}: output_router_logits is set but lit-hbp does not know this family's router "
            f"loss ({why}); set output_router_logits: false"
        )
    if _router_coefficient(net) is None:
        raise ValueError(
            f"{net.config.model_type}: output_router_logits is set but lit-hbp finds no weight of its router loss "
            "(router_aux_loss_coef or aux_loss_coef on the model or its config); set output_router_logits: false"
        )
