"""Token mixers other than attention: the layers a pack cannot hold yet, found by module and refused.

Attention keeps the documents of a pack apart through lit-hbp's varlen call (the boundaries travel
with the call). A layer that mixes tokens by a recurrence or a convolution along the sequence (Mamba's
selective scan, the gated delta rule, lightning/linear attention, RG-LRU, xLSTM, RWKV's token shift, a
short causal convolution) carries its state from the end of one document into the start of the next:
a packed call through it trains every document after the first on its neighbours' tokens, silently.
Until a kind has a packed implementation whose state restarts at every boundary of the call,
``prepare_model`` refuses any model holding one, before anything else happens, naming the family, the
layer, the module and the kind (design record, section 12). A model whose mixer this module does not
recognise is still caught by the self-check, the second line.

Found on the built model (the modules it runs) rather than from config fields, whose names differ by
family (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``, ...); the command line finds
the same on a model built from the checkpoint's config on the meta device, before the data is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixerKind:
    """A kind of stateful token mixer: what the refusal calls it, and the class names that are one."""

    name: str
    classes: re.Pattern


KINDS = (
    MixerKind("the gated delta rule (a recurrent key-value state)", re.compile(r"DeltaNet|DeltaAttention|GatedDelta")),
    MixerKind("a Mamba state-space scan", re.compile(r"Mamba\d*(Mixer|Layer)$|Mixer$")),
    MixerKind("lightning/linear attention (a running key-value state)", re.compile(r"Lightning|LinearAttention")),
    MixerKind("an RG-LRU recurrence", re.compile(r"Rglru|RecurrentBlock")),
    MixerKind("an xLSTM recurrence", re.compile(r"xLSTMLayer|[ms]LSTM")),
    MixerKind("RWKV's token shift and recurrence", re.compile(r"^Rwkv(SelfAttention|FeedForward)$")),
    MixerKind("a short causal convolution", re.compile(r"ShortConv")),
)
DECAY = "a state-space decay (its A_log parameter)"
CONVOLUTION = "a convolution along the sequence (torch.nn.Conv1d)"
SUPPORTED = (
    "lit-hbp trains models whose every token mixer is attention through transformers' AttentionInterface "
    "(llama, qwen2/3, mistral, gemma, phi3, olmo2, mixtral, deepseek_v3, ...: docs/families.md)"
)


@dataclass(frozen=True)
class StatefulMixer:
    """One module that carries state across the documents of a pack."""

    path: str  # its name in the model, e.g. ``layers.0.mixer``
    cls: str  # its class name
    kind: str  # what it is (``MixerKind.name``, DECAY or CONVOLUTION)
    layer: int | None  # the decoder layer that holds it (None: outside the layers)


def kind_of(module: torch.nn.Module, in_layer: bool) -> str | None:
    """The stateful mixer ``module`` is, or None: by its class name, else, inside a decoder layer, by
    what it holds itself (an ``A_log`` decay parameter, or a ``torch.nn.Conv1d``: transformers'
    projections are Linear or GPT-2's ``Conv1D``; outside the layers a convolution is an audio or
    image encoder's, over its own input, not the pack)."""
    name = type(module).__name__
    for kind in KINDS:
        if kind.classes.search(name):
            return kind.name
    if not in_layer:
        return None
    if "A_log" in module._parameters:
        return DECAY
    if isinstance(module, torch.nn.Conv1d):
        return CONVOLUTION
    return None


def stateful_mixers(decoder: torch.nn.Module) -> list[StatefulMixer]:
    """Every stateful token mixer of a decoder (the outermost module of each, below the decoder layers
    and their lists), in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layer_of: dict[str, int] = {}
    found: list[StatefulMixer] = []
    taken: list[str] = []  # paths already reported: their submodules are part of them
    for path, module in decoder.named_modules():
        if module is decoder or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        if isinstance(module, GradientCheckpointingLayer):
            layer_of.setdefault(path, len(layer_of))
            continue
        if any(path.startswith(t + ".") for t in taken):
            continue
        layer = next((i for p, i in layer_of.items() if path.startswith(p + ".")), None)
        kind = kind_of(module, layer is not None)
        if kind is None:
            continue
        taken.append(path)
        found.append(StatefulMixer(path, type(module).__name__, kind, layer))
    return found


def refusal(family: str, mixers: list[StatefulMixer]) -> str:
    """The one-paragraph refusal of a model holding ``mixers``: the first by name, the rest counted."""
    first = mixers[0]
    where = f"layer {first.layer}'s" if first.layer is not None else "its"
    layers = len({m.layer for m in mixers})
    others = [k for k in dict.fromkeys(m.kind for m in mixers) if k != first.kind]
    also = "".join("; also " + k for k in others)
    more = f" ({len(mixers)} such modules in {layers} layers{also})" if mixers[1:] else ""
    return (
        f"{family}: {where} `{first.path}` ({first.cls}) is {first.kind}{more}. It carries its state from one "
        "document of a pack into the next, which lit-hbp cannot stop yet, so it refuses to train this model "
        f"rather than train it wrong. {SUPPORTED}"
    )


def refuse_stateful_mixers(decoder: torch.nn.Module, family: str) -> None:
    """Raise ``ValueError`` (the ``refusal``) when the decoder holds a stateful token mixer."""
    mixers = stateful_mixers(decoder)
    if mixers:
        raise ValueError(refusal(family, mixers))
