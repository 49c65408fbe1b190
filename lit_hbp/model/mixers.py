"""Token mixers other than attention: found by module, run document by document in a packed call, or
refused.

Attention keeps the documents of a pack apart through lit-hbp's varlen call (the boundaries travel
with the call). A layer that mixes tokens by a recurrence or a convolution along the sequence (Mamba's
selective scan, the gated delta rule, lightning/linear attention, RG-LRU, xLSTM, RWKV's token shift, a
short causal convolution) carries its state from the end of one document into the start of the next:
called once over a pack, it trains every document after the first on its neighbours' tokens, silently.

A mixer this module knows by its class (``KINDS``) whose forward takes the hidden states first, as
transformers' mixers do, runs in a packed call once per document of the call's pack
(``install_per_document``): its state starts from zero at every boundary, as each document alone, so
the call is exact by construction (the family tests check each family against each document alone).
This is the pure-PyTorch path: a loop over the pack's documents in every mixer layer, over the
boundaries the batch carries on the host (``PackedBatch.bounds``, handed over by ``packed_loss``; a call
without them reads them back from the device once); the GPU kernels that take the boundaries themselves
are not wired yet.
On a Ulysses level (sp > 1) the SP kind gathers the whole pack's inputs of the mixer
(``SPKind.gather_tokens``); the ranks share the pack's documents, each run whole by one rank
(``document_owners``, balanced by length), where that shares the work evenly (``shares_evenly``); else a
mixer class that splits by heads (``HEAD_SPLITS``: the gated delta rule, Nemotron-H's Mamba2) runs every
document on the rank's share of its heads; the ranks' outputs (partial sums over the heads, or zeros at the
others' documents) are summed into each rank's shard (``SPKind.sum_own_tokens``).
A pack of fewer documents than ranks is run whole by every rank for a mixer that does not split, each
keeping its shard. A context-parallel level, whose ranges a document's state would have
to cross, is refused per level at set-up and in the call. Any other mixer (one found only by an
``A_log`` decay or a ``torch.nn.Conv1d`` inside a decoder layer, RWKV's) makes ``prepare_model`` refuse
the model before anything else happens, naming the family, the layer, the module and the kind (design
record, section 12). A mixer this module does not recognise at all is still caught by the self-check,
the second line.

Found on the built model (the modules it runs) rather than from config fields, whose names differ by
family (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``, ...); the command line finds
the same on a model built from the checkpoint's config on the meta device, before the data is read.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import torch

from lit_hbp.model import calls
from lit_hbp.packing.mixer_share import document_owners, shares_evenly, splits
from lit_hbp.parallel.kind import resolve_sp_kind


@dataclass(frozen=True)
class MixerKind:
    """A kind of stateful token mixer: what the refusal calls it, the class names that are one, and
    whether a packed call may run it document by document (its module holds everything it mixes)."""

    name: str
    classes: re.Pattern
    per_document: bool = True


KINDS = (
    MixerKind("the gated delta rule (a recurrent key-value state)", re.compile(r"DeltaNet|DeltaAttention|GatedDelta")),
    MixerKind("a Mamba state-space scan", re.compile(r"Mamba\d*(Mixer|Layer)$|Mixer$")),
    MixerKind("lightning/linear attention (a running key-value state)", re.compile(r"Lightning|LinearAttention")),
    MixerKind("an RG-LRU recurrence", re.compile(r"Rglru|RecurrentBlock")),
    MixerKind("an xLSTM recurrence", re.compile(r"xLSTMLayer|[ms]LSTM")),
    MixerKind("RWKV's token shift and recurrence", re.compile(r"^Rwkv(SelfAttention|FeedForward)$"), False),
    MixerKind("a short causal convolution", re.compile(r"ShortConv")),
)
DECAY = "a state-space decay (its A_log parameter)"
CONVOLUTION = "a convolution along the sequence (torch.nn.Conv1d)"
HIDDEN = ("hidden_states", "input_states", "x")  # what transformers' mixers call the [batch, tokens, width] input
SUPPORTED = (
    "lit-hbp trains models whose token mixers are attention through transformers' AttentionInterface, or "
    "mixers it runs document by document (Mamba, Mamba2, the gated delta rule, lightning attention, RG-LRU, "
    "short convolutions: docs/families.md)"
)


@dataclass(frozen=True)
class StatefulMixer:
    """One module that carries state across the documents of a pack."""

    path: str  # its name in the model, e.g. ``layers.0.mixer``
    cls: str  # its class name
    kind: str  # what it is (``MixerKind.name``, DECAY or CONVOLUTION)
    layer: int | None  # the decoder layer that holds it (None: outside the layers)
    per_document: bool = False  # whether a packed call runs it document by document (else: refused)


def _hidden_first(module: torch.nn.Module) -> bool:
    """Whether the module's forward takes the hidden states ([batch, tokens, width]) first."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) > 1 and params[1] in HIDDEN


def kind_of(module: torch.nn.Module, in_layer: bool) -> tuple[str, bool] | None:
    """(the stateful mixer ``module`` is, whether a packed call runs it document by document), or None:
    by its class name, else, inside a decoder layer, by what it holds itself (an ``A_log`` decay
    parameter, or a ``torch.nn.Conv1d``: transformers' projections are Linear or GPT-2's ``Conv1D``;
    outside the layers a convolution is an audio or image encoder's, over its own input, not the pack).
    Those found by what they hold are refused: their calling convention is unknown."""
    name = type(module).__name__
    if _through_attention_interface(type(module)):
        return None  # softmax attention named after its family (Kimi Linear's MLA): lit-hbp's varlen attention runs it
    for kind in KINDS:
        if kind.classes.search(name):
            return kind.name, kind.per_document and _hidden_first(module)
    if not in_layer:
        return None
    if "A_log" in module._parameters:
        return DECAY, False
    if isinstance(module, torch.nn.Conv1d):
        return CONVOLUTION, False
    return None


@functools.cache
def _through_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' attention functions (``ALL_ATTENTION_FUNCTIONS``): softmax
    attention, whatever its class is called (Kimi Linear's ``KimiLinearAttention`` is MLA)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


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
        found_kind = kind_of(module, layer is not None)
        if found_kind is None:
            continue
        taken.append(path)
        found.append(StatefulMixer(path, type(module).__name__, *found_kind[:1], layer, found_kind[1]))
    return found


def refusal(family: str, mixers: list[StatefulMixer]) -> str:
    """The one-paragraph refusal of a model holding ``mixers`` that no packed call can run: the first by
    name, the rest counted."""
    first = mixers[0]
    where = f"layer {first.layer}'s" if first.layer is not None else "its"
    layers = len({m.layer for m in mixers})
    others = [k for k in dict.fromkeys(m.kind for m in mixers) if k != first.kind]
    also = "".join("; also " + k for k in others)
    more = f" ({len(mixers)} such modules in {layers} layers{also})" if mixers[1:] else ""
    return (
        f"{family}: {where} `{first.path}` ({first.cls}) is {first.kind}{more}. It carries its state from one "
        "document of a pack into the next, and lit-hbp cannot run it document by document, so it refuses to "
        f"train this model rather than train it wrong. {SUPPORTED}"
    )


def refuse_stateful_mixers(decoder: torch.nn.Module, family: str) -> list[StatefulMixer]:
    """The decoder's stateful mixers, every one of which a packed call runs document by document; raises
    ``ValueError`` (the ``refusal``) when any cannot be."""
    mixers = stateful_mixers(decoder)
    refused = [m for m in mixers if not m.per_document]
    if refused:
        raise ValueError(refusal(family, refused))
    return mixers


def sp_refusal(family: str, mixers: list[StatefulMixer], level: Any, where: str) -> str | None:
    """Why ``level`` (laid out: ``Level.layout`` filled in) cannot train a model holding ``mixers``, or
    None: a level with sequence parallelism needs an SP kind that gives a mixer each document whole
    (``SPKind.gather_tokens``: Ulysses)."""
    if not mixers or level.sp == 1:
        return None
    problem = resolve_sp_kind(level.sp_kind).mixer_problem(level.layout[1])
    if problem is None:
        return None
    first = mixers[0]
    return f"{where}: {family}'s `{first.path}` ({first.cls}) is {first.kind}, run document by document: {problem}"


# ---- document by document, in a packed call --------------------------------------------------------------

CALL_OF = "_hbp_mixer_call"  # on a mixer instance: the function giving its model's packed call on this thread
OWN = "_hbp_mixer_own"  # on the class's per-document forward: the class's own forward
SHAPES = "_hbp_head_shapes"  # on a mixer instance: its 1/parts-of-the-heads twin per degree (meta, no weights)
PACK_ONLY = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "hbp_sp", "hbp_cp_shard"})


def install_per_document(mixer: torch.nn.Module, call_of) -> None:
    """Make ``mixer`` run document by document in its model's packed calls (``call_of()``: that call on
    this thread, or None): its class's forward becomes the per-document one (once per class; the class
    keeps it, other models share it), which runs the class's own forward for any other call."""
    cls = type(mixer)
    if getattr(cls.forward, OWN, None) is None:
        cls.forward = _per_document_forward(cls.forward)
    mixer.__dict__[CALL_OF] = call_of


def uninstall_per_document(mixer: torch.nn.Module) -> None:
    mixer.__dict__.pop(CALL_OF, None)
    mixer.__dict__.pop(SHAPES, None)


def _per_document_forward(own):
    @functools.wraps(own)
    def forward(self, *args, **kwargs):
        call_of = self.__dict__.get(CALL_OF)
        call = call_of() if call_of is not None else None
        if call is None:
            return own(self, *args, **kwargs)
        return by_document(self, functools.partial(own, self), call, type(self).__name__, args, kwargs)

    setattr(forward, OWN, own)
    return forward


@torch.compiler.disable  # a loop over the pack's documents, from host numbers: no graph to trace
def by_document(mixer: torch.nn.Module, run, call: calls.PackCall, name: str, args: tuple, kwargs: dict) -> Any:
    """``run`` (``mixer``'s own forward) once per document of ``call``'s pack, each on that document's
    slice of every per-token input, the outputs joined along the tokens: the mixer's state starts from
    nothing at every document, as the document alone. Under sequence parallelism each rank holds a
    shard of the pack: its SP kind gathers the whole pack's inputs (``SPKind.gather_tokens``), the rank
    runs its share of the documents (``document_owners``) where they share evenly (``shares_evenly``), else
    every document on its share of the mixer's heads (``HEAD_SPLITS``), and the ranks' outputs are summed
    into each rank's shard (``SPKind.sum_own_tokens``); a mixer that does not split runs unevenly shared
    documents as they fall, and with fewer documents than ranks runs them all on every rank."""
    pack = call.pack
    hidden = args[0] if args else next((kwargs[k] for k in HIDDEN if k in kwargs), None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"{name}: a packed call gave this token mixer no [batch, tokens, width] hidden states")
    if hidden.shape[0] != 1:
        raise ValueError(f"{name}: a packed call has one row, this one has {hidden.shape[0]}")
    kwargs = {k: v for k, v in kwargs.items() if k not in PACK_ONLY}
    if call.host.get("zero3") is None:  # looked at once a call
        call.host["zero3"] = zero3_partitioned(call.prepared.mixers)
    if call.host["zero3"]:
        raise ValueError(f"{name}: {ZERO3_REFUSAL}")
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise ValueError(f"{name}: a packed call with an attention mask of shape {tuple(mask.shape)}: drop it")
    sp = pack.get("hbp_sp")
    if sp is None and pack.get("hbp_cp_shard") is None:
        return _each_document(run, _bounds(call, hidden.shape[1], name), args, kwargs, name)
    problem = "a context-parallel shard without its SP group" if sp is None else sp.kind.mixer_problem(sp.ctx.cp_size)
    if problem is not None:
        raise ValueError(f"{name}: a token mixer lit-hbp runs document by document cannot run on this level: {problem}")
    local, total = hidden.shape[1], hidden.shape[1] * sp.size
    whole = functools.partial(_tokens, along=lambda x, dim: sp.kind.gather_tokens(x, sp.ctx, dim), tokens=local)
    args, kwargs = tuple(map(whole, args)), {k: whole(v) for k, v in kwargs.items()}
    bounds = _bounds(call, total, name)
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if "owners" not in call.host:
        call.host["owners"] = document_owners(lengths, sp.size)
    owners = call.host["owners"]
    part = None if shares_evenly(lengths, owners, sp.size) else heads_part(mixer, sp.ctx.rank, sp.size, sp)
    if part is not None:  # every document on this rank's heads: the ranks' outputs are partial sums
        out = _each_document(part, bounds, args, kwargs, name)
        return _tokens(out, lambda x, dim: sp.kind.sum_own_tokens(x, sp.ctx, dim), total)
    if owners is None:  # fewer documents than ranks: every rank runs them all, keeps its shard
        out = _each_document(run, bounds, args, kwargs, name)
        return _tokens(out, lambda x, dim: sp.kind.own_tokens(x, sp.ctx, dim), total)
    mine = [i for i, rank in enumerate(owners) if rank == sp.ctx.rank]
    out = _each_document(run, bounds, args, kwargs, name, only=mine)
    return _tokens(out, lambda x, dim: sp.kind.sum_own_tokens(x, sp.ctx, dim), total)


ZERO3_REFUSAL = (
    "a stateful token mixer under DeepSpeed ZeRO-3, which gathers a module's weights only where it is called as a "
    "module: transformers' mixers read their convolution's weight directly (partitioned, empty), and lit-hbp runs "
    "each mixer once per document; train a hybrid with ZeRO stage 0-2 (HBPStrategy stage: 2)"
)


def zero3_partitioned(mixers: list[torch.nn.Module]) -> bool:
    """Whether any of ``mixers`` holds a weight DeepSpeed ZeRO-3 partitions (its ``ds_id``)."""
    return any(hasattr(p, "ds_id") for m in mixers for p in m.parameters())


# ---- split by heads, on a Ulysses level -----------------------------------------------------------------


def _span(n: int, part: int, parts: int) -> slice:
    """Part ``part`` of ``parts`` equal, contiguous shares of ``n`` rows."""
    return slice(part * n // parts, (part + 1) * n // parts)


def _rows(x: torch.Tensor, *spans: slice, dim: int = 0) -> torch.Tensor:
    """``x``'s rows (or ``dim``'s entries) in ``spans``, joined: a view when there is one."""
    pieces = [x.narrow(dim, s.start, s.stop - s.start) for s in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _gated_delta_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a gated-delta-rule mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        hidden_size=m.hidden_size, linear_num_value_heads=m.num_v_heads // parts,
        linear_num_key_heads=m.num_k_heads // parts, linear_key_head_dim=m.head_k_dim,
        linear_value_head_dim=m.head_v_dim, linear_conv_kernel_dim=m.conv_kernel_size, hidden_act=m.activation,
        rms_norm_eps=m.layer_norm_epsilon, layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _gated_delta_common(m: torch.nn.Module, part: int, parts: int) -> tuple[dict, slice, slice]:
    """The weights every gated-delta-rule layout splits alike: the convolution's q, k and v channels of the
    part's key heads and their value heads, the per-value-head decay and step, the output projection's
    columns of those value heads, and the gated norm (shared by every head, whole)."""
    k, v = _span(m.num_k_heads, part, parts), _span(m.num_v_heads, part, parts)
    dk, dv = m.head_k_dim, m.head_v_dim
    q_ch = slice(k.start * dk, k.stop * dk)
    k_ch = slice(m.key_dim + k.start * dk, m.key_dim + k.stop * dk)
    v_ch = slice(2 * m.key_dim + v.start * dv, 2 * m.key_dim + v.stop * dv)
    weights = {
        "conv1d.weight": _rows(m.conv1d.weight, q_ch, k_ch, v_ch),
        "A_log": m.A_log[v],
        "dt_bias": m.dt_bias[v],
        "norm.weight": m.norm.weight,
        "out_proj.weight": _rows(m.out_proj.weight, slice(v.start * dv, v.stop * dv), dim=1),
    }
    return weights, k, v


def _qwen3_next_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` hold each key head's group of rows together."""
    weights, k, _ = _gated_delta_common(m, part, parts)
    per_v = m.num_v_heads // m.num_k_heads
    qkvz = 2 * m.head_k_dim + 2 * m.head_v_dim * per_v
    weights["in_proj_qkvz.weight"] = _rows(m.in_proj_qkvz.weight, slice(k.start * qkvz, k.stop * qkvz))
    weights["in_proj_ba.weight"] = _rows(m.in_proj_ba.weight, slice(k.start * 2 * per_v, k.stop * 2 * per_v))
    return weights


def _qwen3_5_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Qwen3.5: ``in_proj_qkv`` holds all queries, then all keys, then all values (the convolution's
    channels); ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` a block per value head."""
    weights, k, v = _gated_delta_common(m, part, parts)
    dk, dv = m.head_k_dim, m.head_v_dim
    weights["in_proj_qkv.weight"] = _rows(
        m.in_proj_qkv.weight, slice(k.start * dk, k.stop * dk),
        slice(m.key_dim + k.start * dk, m.key_dim + k.stop * dk),
        slice(2 * m.key_dim + v.start * dv, 2 * m.key_dim + v.stop * dv),
    )  # fmt: skip
    weights["in_proj_z.weight"] = _rows(m.in_proj_z.weight, slice(v.start * dv, v.stop * dv))
    weights["in_proj_b.weight"] = m.in_proj_b.weight[v]
    weights["in_proj_a.weight"] = m.in_proj_a.weight[v]
    return weights


def _mamba2_heads(m: torch.nn.Module) -> int:
    """What an SP degree must divide for a Mamba2 mixer to split: its groups (a share is whole groups with their
    heads, the gated norm per group within it), or, with one group, its heads (every share reads the group's
    B and C, and the norm spans the shares: ``_SharedGatedNorm``)."""
    return m.n_groups if m.n_groups > 1 else m.num_heads


def _mamba2_groups(m: torch.nn.Module, parts: int) -> int:
    """The groups a Mamba2 mixer of 1/``parts`` of ``m``'s heads holds (see ``_mamba2_heads``)."""
    return m.n_groups // parts if m.n_groups > 1 else 1


def _mamba2_shape(m: torch.nn.Module, parts: int) -> Any:
    """The config a Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from (Nemotron-H's: a copy of its own)."""
    config = copy.copy(m.config)
    config.mamba_num_heads, config.n_groups = m.num_heads // parts, _mamba2_groups(m, parts)
    return config


def _bamba_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Bamba or Granite 4.0-H mixer of 1/``parts`` of ``m``'s heads is built from (its own fields:
    it keeps no config; its width is ``int(mamba_expand * hidden_size)``, exact through a fraction)."""
    return SimpleNamespace(
        mamba_proj_bias=m.use_bias, mamba_n_heads=m.num_heads // parts, hidden_size=m.hidden_size,
        mamba_d_state=m.ssm_state_size, mamba_d_conv=m.conv_kernel_size,
        mamba_expand=Fraction(m.intermediate_size // parts, m.hidden_size), mamba_conv_bias=m.use_conv_bias,
        hidden_act=m.activation, rms_norm_eps=m.layer_norm_epsilon, mamba_n_groups=_mamba2_groups(m, parts),
        mamba_d_head=m.head_dim, mamba_chunk_size=m.chunk_size, time_step_limit=m.time_step_limit,
        layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _zamba2_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Zamba2 Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from: its config's fields (a
    strict dataclass, whose integer ``mamba_expand`` cannot say half the width), the width's through a fraction."""
    c = m.config
    return SimpleNamespace(
        n_mamba_heads=m.num_heads // parts, hidden_size=m.hidden_size, mamba_d_state=m.ssm_state_size,
        mamba_d_conv=m.conv_kernel_size, mamba_expand=Fraction(m.intermediate_size // parts, m.hidden_size),
        use_conv_bias=m.use_conv_bias, mamba_ngroups=_mamba2_groups(m, parts), mamba_headdim=m.head_dim,
        chunk_size=m.chunk_size, time_step_min=c.time_step_min, add_bias_linear=c.add_bias_linear,
        layer_types={m.layer_idx: m.layer_type}, use_mamba_kernels=True,
    )  # fmt: skip


def _plain_mamba2_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Mamba2 model's mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        num_heads=m.num_heads // parts, hidden_size=m.hidden_size, state_size=m.ssm_state_size,
        conv_kernel=m.conv_kernel_size, expand=Fraction(m.intermediate_size // parts, m.hidden_size),
        time_step_rank=m.time_step_rank, use_conv_bias=m.use_conv_bias, hidden_act=m.activation,
        layer_norm_epsilon=m.layer_norm_epsilon, n_groups=_mamba2_groups(m, parts), head_dim=m.head_dim,
        chunk_size=m.chunk_size, time_step_limit=m.time_step_limit, time_step_min=m.time_step_min,
        time_step_max=m.time_step_max, time_step_floor=m.time_step_floor, use_bias=m.use_bias,
        layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _falcon_h1_heads(m: torch.nn.Module) -> int | None:
    """Falcon-H1's Mamba2 splits as the others (``_mamba2_heads``) unless its optional gated norm spans the heads
    of one group: that norm may normalize before the gate, which ``_SharedGatedNorm`` does not do."""
    return None if m.n_groups == 1 and m.mamba_rms_norm else _mamba2_heads(m)


def _falcon_h1_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Falcon-H1 Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        hidden_act=m.activation, hidden_size=m.hidden_size, layer_types={m.layer_idx: m.layer_type},
        mamba_chunk_size=m.chunk_size, mamba_conv_bias=m.use_conv_bias, mamba_d_conv=m.conv_kernel_size,
        mamba_d_head=m.head_dim, mamba_d_ssm=m.intermediate_size // parts, mamba_d_state=m.ssm_state_size,
        mamba_expand=None, mamba_n_groups=_mamba2_groups(m, parts), mamba_n_heads=m.num_heads // parts,
        mamba_norm_before_gate=getattr(m.norm, "norm_before_gate", True), mamba_proj_bias=m.use_bias,
        mamba_rms_norm=m.mamba_rms_norm, projectors_bias=m.out_proj.bias is not None,
        rms_norm_eps=m.layer_norm_epsilon, ssm_in_multiplier=m.ssm_in_multiplier, time_step_limit=m.time_step_limit,
    )  # fmt: skip


def _mamba2_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """A Mamba2 mixer (Nemotron-H's, Bamba's, Granite 4.0-H's, Zamba2's, Mamba2's): ``in_proj`` gives the gate,
    the convolution's input (x, then B and C per group of heads) and the step per head; a share is its heads
    with their groups (whole groups, or the one group every share reads)."""
    h = _span(m.num_heads, part, parts)
    g = _span(m.n_groups, part, parts) if m.n_groups > 1 else slice(0, 1)
    inner, state, conv = m.intermediate_size, m.ssm_state_size, m.conv_dim
    x = slice(h.start * m.head_dim, h.stop * m.head_dim)
    b = slice(inner + g.start * state, inner + g.stop * state)
    c = slice(inner + m.n_groups * state + g.start * state, inner + m.n_groups * state + g.stop * state)
    shifted = [slice(inner + s.start, inner + s.stop) for s in (x, b, c)]  # in in_proj: after the gate
    rows = (x, *shifted, slice(inner + conv + h.start, inner + conv + h.stop))
    weights = {
        "in_proj.weight": _rows(m.in_proj.weight, *rows),
        "conv1d.weight": _rows(m.conv1d.weight, x, b, c),
        "dt_bias": m.dt_bias[h],
        "A_log": m.A_log[h],
        "D": m.D[h],
        "out_proj.weight": _rows(m.out_proj.weight, x, dim=1),
    }
    if isinstance(getattr(m.norm, "weight", None), torch.Tensor):  # Falcon-H1's is optional
        weights["norm.weight"] = m.norm.weight[x]
    if isinstance(getattr(m, "mup_vector", None), torch.Tensor):  # Falcon-H1's muP multipliers of in_proj's rows
        weights["mup_vector"] = _rows(m.mup_vector, *rows, dim=2)
    if m.in_proj.bias is not None:
        weights["in_proj.bias"] = _rows(m.in_proj.bias, *rows)
    if m.conv1d.bias is not None:
        weights["conv1d.bias"] = _rows(m.conv1d.bias, x, b, c)
    return weights


class _SharedGatedNorm(torch.nn.Module):
    """A Mamba2 mixer's gated RMSNorm (transformers' ``...RMSNormGated`` of one group: ``weight * y *
    rsqrt(mean(y^2) + eps)``, ``y = x * silu(gate)``) over the whole width, on a rank holding a share of the
    heads: each rank's sum of squares summed over the SP group (``SPKind.sum_ranks``), divided by the whole
    width. Built for one call (it holds the call's SP group); its weight, on the meta device, is the share's
    through ``functional_call``."""

    def __init__(self, norm: torch.nn.Module, width: int, sp: Any):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.eps, self.width, self.sp = norm.variance_epsilon, width, sp

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        y = hidden_states.to(torch.float32)
        if gate is not None:
            y = y * torch.nn.functional.silu(gate.to(torch.float32))
        squares = self.sp.kind.sum_ranks(y.pow(2).sum(-1, keepdim=True), self.sp.ctx)
        return self.weight * (y * torch.rsqrt(squares / self.width + self.eps)).to(dtype)


@dataclass(frozen=True)
class HeadSplit:
    """How a mixer class runs on a share of its heads: ``heads(m)`` the count that the SP degree must
    divide, ``shape(m, parts)`` the config of a mixer of 1/parts of them (built from ``m``'s own
    fields), ``part(m, part, parts)`` the slices of ``m``'s weights that one holds (by parameter name:
    views where they can be, so their gradients reach ``m``'s weights). Each part's output is that part's
    heads' share of the output projection: the parts' outputs sum to the whole mixer's."""

    heads: Callable[[torch.nn.Module], int | None]
    shape: Callable[[torch.nn.Module, int], Any]
    part: Callable[[torch.nn.Module, int, int], dict[str, torch.Tensor]]
    shared_norm: Callable[[torch.nn.Module], bool] = lambda m: False
    """Whether the mixer's gated norm spans the shares (a Mamba2 mixer of one group): its twin then normalizes
    over the ranks (``_SharedGatedNorm``) and runs its unfused path (a fused kernel would normalize within
    the share)."""


def _one_group(m: torch.nn.Module) -> bool:
    return m.n_groups == 1


HEAD_SPLITS = {  # by class: exact against one process in tests/test_mixers.py, each at sp 2
    "Qwen3NextGatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_next_part),
    "Qwen3_5GatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_5_part),
    "Qwen3_5MoeGatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_5_part),
    "NemotronHMamba2Mixer": HeadSplit(_mamba2_heads, _mamba2_shape, _mamba2_part, _one_group),
    "BambaMixer": HeadSplit(_mamba2_heads, _bamba_shape, _mamba2_part, _one_group),
    "GraniteMoeHybridMambaLayer": HeadSplit(_mamba2_heads, _bamba_shape, _mamba2_part, _one_group),
    "Zamba2MambaMixer": HeadSplit(_mamba2_heads, _zamba2_shape, _mamba2_part, _one_group),
    "Mamba2Mixer": HeadSplit(_mamba2_heads, _plain_mamba2_shape, _mamba2_part, _one_group),
    "FalconH1Mixer": HeadSplit(_falcon_h1_heads, _falcon_h1_shape, _mamba2_part),
}


def split_heads(mixer: torch.nn.Module) -> int | None:
    """The heads ``mixer`` splits by on a Ulysses level (an SP degree must divide them), or None where it does
    not split: its class has no ``HEAD_SPLITS`` entry, or it holds a weight or buffer the split does not know
    (a bias, whose share is not a partial sum; LoRA's adapters), which a share would leave out."""
    split = HEAD_SPLITS.get(type(mixer).__name__)
    if split is None:
        return None
    named = set(split.part(mixer, 0, 1))
    if named != {n for n, _ in mixer.named_parameters()} | {n for n, _ in mixer.named_buffers()}:
        return None
    return split.heads(mixer)


def heads_part(mixer: torch.nn.Module, part: int, parts: int, sp: Any = None):
    """A function running ``mixer`` on part ``part`` of ``parts`` equal shares of its heads (its own forward,
    on its twin of that shape with the share's weights), or None where it does not split so
    (``split_heads``, ``mixer_share.splits``; a mixer whose norm spans the shares without ``sp``, the call's
    SP group, to sum it over)."""
    if not splits(split_heads(mixer), parts):
        return None
    split = HEAD_SPLITS[type(mixer).__name__]
    shared = parts > 1 and split.shared_norm(mixer)
    if shared and sp is None:
        return None
    weights = split.part(mixer, part, parts)
    shapes = mixer.__dict__.setdefault(SHAPES, {})
    if parts not in shapes:
        with torch.device("meta"):
            shapes[parts] = twin = type(mixer)(split.shape(mixer, parts), mixer.layer_idx)
        for name in weights.keys() - dict(twin.named_parameters()).keys() - dict(twin.named_buffers()).keys():
            twin.register_buffer(name, weights[name].to("meta"), persistent=False)  # one its model registers
    twin = shapes[parts]
    if shared:  # this call's twin: the cached one's modules, its norm summed over the call's SP group
        twin = copy.copy(twin)
        twin._modules = {**twin._modules, "norm": _SharedGatedNorm(twin.norm, mixer.intermediate_size, sp)}
        twin.training = False
    return lambda *args, **kwargs: torch.func.functional_call(twin, weights, args, kwargs, strict=True)


def _each_document(run, bounds: list[int], args: tuple, kwargs: dict, name: str, only: list[int] | None = None):
    """``run`` on each document's slice of the per-token inputs (``only``: those documents, the others'
    outputs zeros shaped as a run document's), the outputs joined along the tokens."""
    outs, lengths = {}, [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    runs = None if only is None else set(only)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if runs is not None and i not in runs:
            continue
        along = functools.partial(_narrow, start=start, length=end - start)
        cut = functools.partial(_tokens, along=along, tokens=bounds[-1])
        outs[i] = run(*map(cut, args), **{k: cut(v) for k, v in kwargs.items()})
    if only is not None:
        shown, length = next(iter(outs.values())), lengths[only[0]]
        outs = {i: outs[i] if i in outs else _zeros_for(shown, length, lengths[i]) for i in range(len(lengths))}
    return _join([outs[i] for i in range(len(lengths))], lengths, name)


def _zeros_for(out: Any, length: int, tokens: int) -> Any:
    """Zeros standing for a document of ``tokens`` tokens that another rank runs, shaped as ``out`` (a run
    document's output of ``length`` tokens): its per-token tensors' shapes with ``tokens``, None for the rest
    (what ``_join`` drops anyway)."""
    if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[1] == length:
        return out.new_zeros((out.shape[0], tokens, *out.shape[2:]))
    if isinstance(out, tuple):
        return tuple(_zeros_for(o, length, tokens) for o in out)
    return None


def _narrow(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return x.narrow(dim, start, length)


def _bounds(call: calls.PackCall, tokens: int, name: str) -> list[int]:
    """The pack's document boundaries as host numbers: the call's (``packed_loss`` hands over the batch's),
    else read from the device once per call."""
    bounds = call.host.get("bounds")
    if bounds is None:
        cu = call.pack.get("cu_seq_lens_q")
        if cu is None:
            raise ValueError(f"{name}: a packed call without its documents' boundaries (cu_seq_lens_q)")
        bounds = call.host["bounds"] = [int(b) for b in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"{name}: the pack's boundaries end at {bounds[-1]}, its hidden states hold {tokens} tokens")
    return bounds


def _tokens(value: Any, along, tokens: int) -> Any:
    """``along(tensor, dim)`` applied to a per-token value of ``tokens`` tokens, along its tokens: tensors
    [batch, tokens, ...] or [batch, tokens] along dim 1, positions with the tokens last ([rows, batch,
    tokens]: multimodal RoPE) along them, tuples and lists of them each; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens:
        return along(value, 1)
    positions = isinstance(value, torch.Tensor) and value.dim() == 3 and not value.is_floating_point()
    if positions and value.shape[-1] == tokens:
        return along(value, value.dim() - 1)
    if isinstance(value, (tuple, list)):
        return type(value)(_tokens(v, along, tokens) for v in value)
    return value


def _join(outs: list, lengths: list[int], name: str) -> Any:
    """The per-document outputs as one: the hidden states (the output, or a tuple's first element)
    joined along the tokens; a tuple's other elements joined where they are per token, else None (a
    mixer's final state or attention weights, which a packed call, without a cache, has no use for: a
    caller that reads one fails loudly on None instead of using one document's)."""
    first = outs[0]
    if isinstance(first, tuple) and all(isinstance(o, tuple) and len(o) == len(first) for o in outs):
        head = _per_token([o[0] for o in outs], lengths)
        if head is None:
            raise ValueError(f"{name}: its forward's first output is not per token, which a packed call cannot join")
        return (head, *(_per_token(list(parts), lengths) for parts in list(zip(*outs))[1:]))
    joined = _per_token(outs, lengths)
    if joined is None:
        raise ValueError(f"{name}: its forward's output ({type(first).__name__}) is not per token: it cannot be joined")
    return joined


def _per_token(parts: list, lengths: list[int]) -> torch.Tensor | None:
    """Tensors [batch, tokens, ...] of each document joined along the tokens, or None when they are not."""
    if all(isinstance(p, torch.Tensor) and p.dim() >= 2 and p.shape[1] == n for p, n in zip(parts, lengths)):
        return torch.cat(parts, dim=1)
    return None
