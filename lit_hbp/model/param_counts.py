"""The parameters a run holds and trains, counted on its model as it is built (on the meta device: no weights,
no memory), for what the memory model prices as weights, gradients and Adam states (``CostModel.static_parts``).

Counted, not read off the config's formula, because the formula cannot see two things. A layer shared between
uses (Zamba's shared transformer block), looped (HRM's, Dory's recurrent layers) or nested in another layer (Zamba's
Mamba layer inside its hybrid layer) holds its parameters once: ``model.parameters()`` counts each tensor once, and
so does ``language_params`` (the FLOPs are priced per layer: ``ModelSpec.active_layer_params``). And a LoRA run trains
what peft adds to the model, its adapters (``rank`` times a matrix's input and output width, for every module it
targets) and the trained copies of ``modules_to_save``: ``lora_counts`` applies lit-hbp's own ``apply_lora``, the
function the run calls, to the model built from its config and counts what then takes a gradient.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from lit_hbp.errors import ConfigError
from lit_hbp.model.build import apply_lora, build_on_meta
from lit_hbp.model.checks import model_config
from lit_hbp.model_spec import ModelSpec

# The published architectures of ``model_spec.MODELS``: their family, whose modules (names and shapes) LoRA targets.
PRESET_FAMILIES = {"llama3.1-8b": "llama", "llama3.1-70b": "llama", "qwen2.5-32b": "qwen2", "qwen2.5-72b": "qwen2"}


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


def preset_source(spec: Any) -> dict | None:
    """The config mapping of a ``model_spec.MODELS`` preset (its family and shape), or None for another spec."""
    from lit_hbp.model_spec import MODELS

    family = PRESET_FAMILIES.get(spec.name)
    if family is None or MODELS.get(spec.name) != spec:
        return None
    return dict(
        model_type=family,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        tie_word_embeddings=spec.tied_embeddings,
    )


def lora_counts(source: Any, lora: Mapping) -> tuple[float, float] | None:
    """(parameters trained, parameters added) by LoRA with the settings ``lora`` (``HBPLitModule``'s ``lora``) on
    the model ``source`` describes (a config mapping or a checkpoint folder: a ``ModelSpec.source``), built on
    the meta device and wrapped by ``apply_lora``: what takes a gradient (the adapters, ``modules_to_save``'s
    copies, a bias peft trains) and what peft adds beside the model's own weights. None where the model cannot
    be built here."""
    if source is None:
        return None
    return _lora_counts(json.dumps(source, sort_keys=True, default=str), json.dumps(dict(lora), sort_keys=True))


@functools.lru_cache(maxsize=32)
def _lora_counts(source: str, lora: str) -> tuple[float, float] | None:
    """``lora_counts`` of JSON-written arguments (a search prices the same run many times: built once)."""
    config = model_config(json.loads(source))
    net = None if config is None else build_on_meta(config)
    if net is None:
        return None
    before = count(net.parameters())
    with torch.device("meta"):  # the adapters too: no memory, whatever the rank
        net = apply_lora(net, json.loads(lora))
    params = list(net.parameters())
    return float(count(p for p in params if p.requires_grad)), float(count(params) - before)


def lora_settings(spec: Any, lora: Mapping) -> dict[str, float]:
    """``trainable`` (the share of ``spec.params`` LoRA trains: its trained parameters' gradients and Adam states,
    their sync, their weight-gradient matmuls) and ``added_params`` (held beside the model's weights) of a LoRA
    run of the model ``spec`` (a ``ModelSpec``: its ``source``, or a preset's family and shape)."""
    counts = lora_counts(spec.source if spec.source is not None else preset_source(spec), lora)
    if counts is None:
        raise ConfigError(
            f"model.lora: the cost model counts LoRA's trained parameters on the model built from its config, and "
            f"{spec.name}'s cannot be built here: price it as a config mapping, a config.json or a checkpoint folder "
            "on this machine"
        )
    trained, added = counts
    return dict(trainable=trained / spec.params, added_params=added)


def wrapped_lora(net: torch.nn.Module, spec: Any) -> dict[str, float]:
    """``lora_settings`` of a model LoRA already wraps (``HBPLitModule.cost_model``, at fit), ``spec`` counted on it
    before (``causal_lm.model_spec``): what takes a gradient, and what it holds beyond the parameters counted then."""
    tower = 0.0 if spec.vision is None else spec.vision.params(spec.hidden)
    trained = count(p for p in net.parameters() if p.requires_grad)
    return dict(trainable=trained / spec.params, added_params=count(net.parameters()) - spec.params - tower)


def layer_matrices(layer: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``layer.named_parameters()`` but a norm's own: a norm's weights scale rows, no token passes them as a matmul,
    though one per expert is two-dimensional (Ergo's ``post_expert_norm``: experts x hidden)."""
    seen: set[int] = set()  # a tensor two of its modules hold: once, as named_parameters gives it
    for owner, module in layer.named_modules():
        norm = _is_norm(module)
        for name, p in module.named_parameters(prefix=owner, recurse=False):
            if id(p) not in seen and not norm:
                yield name, p
            seen.add(id(p))


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Norm") or isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))


def norm_values(layer: torch.nn.Module, spec: ModelSpec) -> float:
    """Values per token ``layer``'s norms normalize (each keeps an fp32 copy of its input and a normalized row for
    its backward): a norm of the hidden width one row of it, a query or key norm per head (Qwen 3's, Gemma 3's) the
    query's or the key-value heads' rows, one over its whole projection (OLMo 2's) that projection's width."""
    total = 0.0
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if not _is_norm(module) or (weight is not None and weight.dim() != 1):  # one norm per expert: not a row's
            continue
        shape = getattr(module, "normalized_shape", None)
        width = weight.numel() if weight is not None else (int(torch.Size(shape).numel()) if shape else 0)
        if spec.latent is not None and width in spec.latent[:2] and width != spec.hidden:
            continue  # latent attention's low-rank norms: in its saved set (``CostModel._attention_saved``)
        if width == spec.dim and width != spec.hidden:
            key = name.rsplit(".", 1)[-1].lower().startswith("k")
            width = (spec.kv_heads if key else spec.heads) * spec.dim
        total += width
    return total


def matmul_params(module: torch.nn.Module) -> float:
    """Parameters of ``module``'s matrices and convolutions (ZeRO-3's full shapes)."""
    shapes = (tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters())
    return float(sum(torch.Size(s).numel() for s in shapes if len(s) >= 2))
