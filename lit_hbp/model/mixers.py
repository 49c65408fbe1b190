"""Token mixers other than attention: found by module, run document by document in a packed call, or
refused.

Attention keeps the documents of a pack apart through lit-hbp's varlen call (the boundaries travel
with the call). A layer that mixes tokens by a recurrence or a convolution along the sequence (Mamba's
selective scan, the gated delta rule, lightning/linear attention, RG-LRU, xLSTM, RWKV's token shift, a
short causal convolution) carries its state from the end of one document into the start of the next:
called once over a pack, it trains every document after the first on its neighbours' tokens, silently.

A mixer this module knows by its class (``KINDS``) whose forward takes the hidden states first, as
transformers' mixers do, runs in a packed call each document of the call's pack from its first token
(``install_per_document``), the documents as the rows of a few right-padded batches (``length_batches``):
its state starts from zero at every boundary, as each document alone, so the call is exact by construction
(the family tests check each family against each document alone). This is the pure-PyTorch path: a loop
over those batches in every mixer layer, over the boundaries the batch carries on the host
(``PackedBatch.bounds``, handed over by ``packed_loss``; a call
without them reads them back from the device once). On a GPU each batch takes the kernels the mixer's own
forward takes there (mamba_ssm, causal-conv1d, flash-linear-attention where installed): no kernel needs
the boundaries, a batch's rows are its documents. The cost model prices the batches' padding
(``mixer_share.mixer_tokens``).
On a Ulysses level (sp > 1) the SP kind gathers the whole pack's inputs of the mixer
(``SPKind.gather_tokens``); the ranks share the pack's documents, each run whole by one rank
(``document_owners``, balanced by length), where that shares the work evenly (``shares_evenly``); else a
mixer class that splits by heads (``mixer_heads.HEAD_SPLITS``: the gated delta rule, Kimi's delta attention, Mamba2,
lightning attention, RG-LRU, xLSTM's mLSTM; Mamba1 and short convolutions by channels; biased projections
too, the output's bias added by one share) runs every
document on the rank's share of its heads; the ranks' outputs (partial sums over the heads, or zeros at the
others' documents) are summed into each rank's shard (``SPKind.sum_own_tokens``).
A pack of fewer documents than ranks is run whole by every rank for a mixer that does not split, each
keeping its shard. A context-parallel level, whose ranges a document's state would have
to cross, is refused per level at set-up and in the call. Any other mixer (one found only by an
``A_log`` decay or a ``torch.nn.Conv1d`` inside a decoder layer, RWKV's, DeepSeek V4's compressors and
sparse-attention indexers, which mix keys over blocks or the whole row) makes ``prepare_model`` refuse
the model before anything else happens, naming the family, the layer, the module and the kind (design
record, section 12). A mixer this module does not recognise at all is still caught by the self-check,
the second line.

Found on the built model (the modules it runs) rather than from config fields, whose names differ by
family (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``, ...); the command line finds
the same on a model built from the checkpoint's config on the meta device, before the data is read.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lit_hbp.model import calls
from lit_hbp.model.mixer_heads import SHAPES, heads_part
from lit_hbp.packing import mixer_share
from lit_hbp.packing.mixer_share import document_owners, length_batches, shares_evenly
from lit_hbp.parallel.kind import resolve_sp_kind


@dataclass(frozen=True)
class MixerKind:
    """A kind of stateful token mixer: what the refusal calls it, the class names that are one, and
    whether a packed call may run it document by document (its module holds everything it mixes)."""

    name: str
    classes: re.Pattern
    per_document: bool = True


XLSTM = "an xLSTM recurrence"
KINDS = (
    MixerKind("the gated delta rule (a recurrent key-value state)", re.compile(r"DeltaNet|DeltaAttention|GatedDelta")),
    MixerKind("a Mamba state-space scan", re.compile(r"Mamba\d*(Mixer|Layer)$|Mixer$")),
    MixerKind("lightning/linear attention (a running key-value state)", re.compile(r"Lightning|LinearAttention")),
    MixerKind("an RG-LRU recurrence", re.compile(r"Rglru|RecurrentBlock")),
    MixerKind(XLSTM, re.compile(r"xLSTMLayer|[ms]LSTM")),
    MixerKind("RWKV's token shift and recurrence", re.compile(r"^Rwkv(SelfAttention|FeedForward)$"), False),
    MixerKind("a compressor pooling keys over blocks of positions", re.compile(r"Compressor$"), False),
    MixerKind("a sparse-attention indexer choosing keys over the whole row", re.compile(r"Indexer$"), False),
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
    Those found by what they hold are refused: their calling convention is unknown. A module whose attention
    goes through transformers' interface is attention, unless it holds a decay too (attention heads beside
    state-space heads, Hymba's layout: the varlen call keeps only the attention heads apart)."""
    name = type(module).__name__
    if _through_attention_interface(type(module)) and "A_log" not in module._parameters:
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
    ``ValueError`` (the ``refusal``) when any cannot be, or when their configured kernel cannot run a pack's
    documents (``mode_refusal``)."""
    mixers = stateful_mixers(decoder)
    refused = [m for m in mixers if not m.per_document]
    if refused:
        raise ValueError(refusal(family, refused))
    problem = mode_refusal(family, mixers, decoder.config)
    if problem is not None:
        raise ValueError(problem)
    modules = {m.path: decoder.get_submodule(m.path) for m in mixers}
    refuse_own_forwards(modules)
    refuse_uncalled_adapters(modules)
    return mixers


def holds_adapters(mixers: list[torch.nn.Module]) -> bool:
    """Whether a child of any of ``mixers`` is a peft LoRA layer (cheap: a packed call asks it every time)."""
    return any("lora_A" in child._modules for m in mixers for child in m._modules.values() if child is not None)


@functools.cache
def _calls_child(cls: type, name: str) -> bool:
    """Whether ``cls``'s source calls its submodule ``name`` as a module (no source: assumed so)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return True
    return re.search(rf"self\.{re.escape(name)}\(", source) is not None


def refuse_uncalled_adapters(mixers: dict[str, torch.nn.Module]) -> None:
    """Raise when an adapter (peft's LoRA layer) wraps a mixer's submodule that the mixer's class never calls:
    transformers' mixers read their convolution's weight directly (``self.conv1d.weight``), so the adapter would
    train nothing, in their own forward as in a packed call, without a word. Checked at ``prepare_model`` and at
    every packed call (adapters added after it, as ``HBPLitModule`` adds them)."""
    for path, mixer in mixers.items():
        for name, child in mixer.named_children():
            if "lora_A" in child._modules and not _calls_child(type(mixer), name):
                base = type(getattr(child, "base_layer", child)).__name__
                raise ValueError(
                    f"`{path}.{name}` ({base}) holds a LoRA adapter, but {type(mixer).__name__} never calls it as a "
                    f"module (it reads its weight), so the adapter would train nothing, in the model's own forward "
                    f"too: leave {name!r} out of LoRA's target_modules"
                )


def refuse_own_forwards(mixers: dict[str, torch.nn.Module]) -> None:
    """Raise when a mixer (path -> module) holds a forward of its own on the instance: kernels' ``kernelize``
    (``from_pretrained(..., use_kernels=True)``: Qwen3.5's Gated DeltaNet layer on some GPUs) or a patch sets one,
    and the module then never calls its class's forward, the one ``install_per_document`` runs once per document:
    called over the whole pack, its state would cross the documents silently. Checked at ``prepare_model`` and at
    every packed call (a model kernelized after it was prepared)."""
    for path, mixer in mixers.items():
        if "forward" in mixer.__dict__:
            by = mixer.__dict__.get("_kernel_repo")
            how = f"kernels put {by}'s forward on it" if by is not None else "a forward was set on the module itself"
            raise ValueError(
                f"`{path}` ({type(mixer).__name__}) is a stateful token mixer and {how}: lit-hbp runs the class's "
                "forward once per document of a pack, which this module no longer calls, so its state would cross "
                "the documents. Load the model without use_kernels (kernels' kernelize), or remove the patch"
            )


def mode_refusal(family: str, mixers: list[StatefulMixer], config: Any) -> str | None:
    """Why the mixers' configured kernel cannot run a pack's documents, or None: xLSTM's ``mode`` "train" takes
    only rows whose length is a multiple of ``chunk_size`` (the unprepared model refuses any other document alone,
    and a pack would train or stop by how its documents happen to batch), "train_with_padding" no row at all in
    transformers' layers (they ask for a last state it does not return); "inference" is the same math at any
    length."""
    mode = getattr(config, "mode", None)
    if not any(m.kind == XLSTM for m in mixers) or not isinstance(mode, str) or "train" not in mode:
        return None
    why = (
        "returns no last state, which transformers' xLSTM layers ask for, so the model runs no document at all"
        if "padding" in mode
        else f"takes only rows whose length is a multiple of chunk_size {getattr(config, 'chunk_size', '?')}, so "
        "the model refuses any other document alone and a pack would train or stop by how its documents batch"
    )
    fix = "set mode: inference (the same math, at any length)"
    return f"{family}: config mode {mode!r} runs xLSTM's chunkwise training kernel, which {why}: {fix}"


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
    every document on its share of the mixer's heads (``mixer_heads``), and the ranks' outputs are summed
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


def _each_document(run, bounds: list[int], args: tuple, kwargs: dict, name: str, only: list[int] | None = None):
    """``run`` on each document's slice of the per-token inputs (``only``: those documents, the others'
    outputs zeros shaped as a run document's), the outputs joined along the tokens. The documents run as the
    rows of a few batches (``length_batches``), each row one document from its first token, right-padded with
    copies of its last: a mixer is causal, so a row's padding changes nothing of the document before it, and
    the padded positions' outputs are dropped (as the document alone, in a handful of calls, not one a
    document)."""
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    docs = list(range(len(lengths))) if only is None else list(only)
    outs = {}
    for batch in length_batches([lengths[i] for i in docs], mixer_share.PAD_SLACK):
        rows = [docs[j] for j in batch]
        longest = lengths[rows[0]]
        if len(rows) == 1:  # a document alone: its slice, a view (a long level's one document is never copied)
            along = functools.partial(_narrow, start=bounds[rows[0]], length=longest)
        else:
            starts, ends = torch.tensor([bounds[i] for i in rows]), torch.tensor([bounds[i + 1] - 1 for i in rows])
            index = torch.minimum(starts[:, None] + torch.arange(longest), ends[:, None]).flatten()
            along = functools.partial(_rows, index=index, longest=longest)
        cut = functools.partial(_tokens, along=along, tokens=bounds[-1])
        out = run(*map(cut, args), **{k: cut(v) for k, v in kwargs.items()})
        for r, i in enumerate(rows):
            outs[i] = _row_of(out, r, len(rows), longest, lengths[i])
    if only is not None:
        shown, length = outs[only[0]], lengths[only[0]]
        outs = {i: outs[i] if i in outs else _zeros_for(shown, length, lengths[i]) for i in range(len(lengths))}
    return _join([outs[i] for i in range(len(lengths))], lengths, name)


def _narrow(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return x.narrow(dim, start, length)


def _rows(x: torch.Tensor, dim: int, index: torch.Tensor, longest: int) -> torch.Tensor:
    """The per-token tensor ``x`` (one row, tokens along ``dim``) as rows of ``longest`` tokens: ``index``'s
    tokens, its batch dimension (the one before ``dim``) the rows."""
    one = x.select(dim - 1, 0)
    return one.index_select(dim - 1, index.to(x.device)).unflatten(dim - 1, (-1, longest))


def _row_of(out: Any, row: int, rows: int, longest: int, length: int) -> Any:
    """Row ``row``'s document of a batch's output: its per-token tensors ([rows, longest, ...]) cut to the
    document's ``length`` tokens as one row; anything else (a final state: none of a packed call's) None."""
    if isinstance(out, torch.Tensor):
        per_token = out.dim() >= 2 and out.shape[0] == rows and out.shape[1] == longest
        return out[row : row + 1, :length] if per_token else None
    if isinstance(out, tuple):
        return tuple(_row_of(o, row, rows, longest, length) for o in out)
    return None


def _zeros_for(out: Any, length: int, tokens: int) -> Any:
    """Zeros standing for a document of ``tokens`` tokens that another rank runs, shaped as ``out`` (a run
    document's output of ``length`` tokens): its per-token tensors' shapes with ``tokens``, None for the rest
    (what ``_join`` drops anyway)."""
    if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[1] == length:
        return out.new_zeros((out.shape[0], tokens, *out.shape[2:]))
    if isinstance(out, tuple):
        return tuple(_zeros_for(o, length, tokens) for o in out)
    return None


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


CHUNK_SIZE = "max_inference_chunksize"  # xLSTM's: its eval forward runs a longer row in chunks of that many tokens
_chunks_lock = threading.Lock()
_chunks: dict[int, tuple[Any, int, list[int]]] = {}  # id(config) -> (config, its own value, rows of running calls)


@contextlib.contextmanager
def whole_rows(configs: list, *rows: Any) -> Iterator[None]:
    """For a packed call whose row (the first tensor of ``rows``: its token ids or positions, its last dimension;
    unknown: any length) is longer than a config's ``max_inference_chunksize``, that chunk size is the row's for
    the call. xLSTM's forward out of training cuts a longer row into chunks run one after the other (its state
    carried over, a memory saving), so its mixers would get a slice of the pack instead of its documents; run
    whole, each document starts from its own first token, as alone. The config's own value comes back after the
    last call that raised it (counted over threads, under a lock); a shorter row changes nothing."""
    row = next((r for r in rows if isinstance(r, torch.Tensor)), None)
    tokens = int(row.shape[-1]) if row is not None else sys.maxsize
    raised = []
    with _chunks_lock:
        for config, _ in configs:
            own = getattr(config, CHUNK_SIZE, None)
            if isinstance(own, bool) or not isinstance(own, int):
                continue
            entry = _chunks.get(id(config))
            if tokens <= (own if entry is None else entry[1]):
                continue
            entry = _chunks.setdefault(id(config), (config, own, []))
            entry[2].append(tokens)
            setattr(config, CHUNK_SIZE, max(entry[2]))
            raised.append(entry)
    try:
        yield
    finally:
        with _chunks_lock:
            for config, own, running in raised:
                running.remove(tokens)
                setattr(config, CHUNK_SIZE, max(running, default=own))
                if not running:
                    del _chunks[id(config)]
