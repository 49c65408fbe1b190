"""How a call of a prepared model is recognised as packed, and what such a call refuses: its hooks.

The decoder's forward pre-hook opens a ``pack_scope`` for a call that carries a pack (its boundaries, or positions
that step other than +1 inside one row, as transformers' ``find_packed_sequence_indices`` reads them) with the
level's checkpointing, offload and tiles where the call's token ids are a ``PackedBatch``'s (``LEVEL_MARK``); the
model's own pre-hook checks the call as a whole (its loss, images attending both ways, batch statistics) and hands
its decoder the boundaries its forward drops. Arguments given by position are read by their names (a mask passed
second is a mask). ``model.forward(...)``, which PyTorch runs without hooks, has its loss checked by the decoder's
hook from the model's forward on the stack.

Refused instead of trained wrong: a pack's token ids (``PackedBatch.input_ids``, which carry the
pack's segment count, ``PACK_MARK``) called with neither boundaries nor positions, or with an attention
mask and no boundaries (transformers reads a masked row as one sequence); an attention mask
with zeros, or a KV cache, in a packed call; the model's own loss (``labels=``) on a pack whose labels
are lit-hbp's pre-shifted ones, whose documents' first labels are not the ignore index (the loss's shift would
train one document's last token on the next one's first), or under sequence parallelism; a model whose
forward drops a pack's positions before a decoder that takes them.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from lit_hbp.data.batch import LEVEL_MARK, PACK_MARK, SHIFTED_MARK, SP_MARK
from lit_hbp.model import calls
from lit_hbp.model.packed_call import PREPARED, Prepared, pack_scope
from lit_hbp.model.vision import (
    attends_both_ways,
    has_batch_norms,
    refuse_batch_statistics,
    refuse_bidirectional,
    without_unread_text_row,
)


def boundaries_from_positions(position_ids: torch.Tensor) -> dict | None:
    """``cu_seq_lens_q`` / ``max_length_q`` of a one-row pack whose positions restart (a step other
    than +1 starts a document, as transformers' ``find_packed_sequence_indices`` reads them), or None
    for one sequence. Reads the starts back from the device once."""
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # multimodal RoPE: row 0 is the text row
        position_ids = position_ids[0]
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    p = position_ids[0]
    starts = (torch.nonzero(torch.diff(p) != 1).flatten() + 1).tolist()
    if not starts:
        return None
    cu = [0, *starts, int(p.numel())]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=p.device)
    return dict(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=max(b - a for a, b in zip(cu, cu[1:])))


def _packed_keywords(kwargs: dict) -> dict | None:
    """The boundary keywords of a call (its arguments by name, ``_named``), given or read from restarting
    positions; None for a plain call (a batch of several rows whose positions restart as transformers
    broadcasts them: each row attends as one)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return {k: kwargs[k] for k in ("cu_seq_lens_q", "max_length_q") if k in kwargs}
    if kwargs.get("attention_mask") is not None or _cache_of(kwargs) is not None:
        return None  # a padded batch or a decoding step: transformers' own masks and cache
    pos = kwargs.get("position_ids")
    rows = kwargs.get("input_ids")
    rows = rows if rows is not None else kwargs.get("inputs_embeds")  # a VLM's language model: input_ids=None
    if isinstance(rows, torch.Tensor) and rows.dim() >= 2 and rows.shape[0] > 1:
        return None
    return boundaries_from_positions(pos) if isinstance(pos, torch.Tensor) else None


@functools.cache
def _positional(forward) -> tuple[str, ...] | None:
    """The names a forward's positional arguments take, in order (``self`` left out); None where some cannot be
    given by name (``*args``, positional-only)."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
        return None
    return tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)


def _named(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with the positional ones under their parameters' names: ``model(ids, mask)``'s mask is
    read as the attention mask it is (read as none, a row it pads was taken for a pack). As given where the
    forward's signature cannot name them."""
    if not args:
        return args, kwargs
    names = _positional(type(module).forward)
    if names is None or len(args) > len(names):
        return args, kwargs
    return (), {**dict(zip(names, args)), **kwargs}


def _cache_of(kwargs: dict):
    return kwargs.get("past_key_values", kwargs.get("cache"))


def _refuse_merged_documents(where: str, kwargs: dict) -> None:
    """A call taken as unpacked whose positions restart inside a row of real tokens (beside an all-ones
    ``attention_mask``, or in a batch of several rows: packs as padded rows, TRL's ``packing`` without padding-free):
    its documents would attend to each other as one sequence, as transformers runs it. Refused; rows a mask pads
    and decoding steps (a cache) are left alone. One read-back from the device, for such calls only."""
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if not isinstance(pos, torch.Tensor) or _cache_of(kwargs) is not None:
        return
    if pos.dim() == 3 and pos.shape[0] == 4:  # multimodal RoPE: row 0 is the text row
        pos = pos[0]
    plain_mask = mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == pos.shape)
    if pos.dim() != 2 or pos.shape[1] < 2 or not plain_mask or (mask is None and pos.shape[0] == 1):
        return
    restarts = (torch.diff(pos, dim=-1) <= 0).any(dim=-1)
    if mask is not None:
        restarts &= mask.bool().all(dim=-1)
    if not bool(restarts.any()):
        return
    rows = "a row" if pos.shape[0] == 1 else f"rows of a batch of {pos.shape[0]}"
    beside = " beside an all-ones attention_mask" if mask is not None else ""
    raise ValueError(
        f"{where}: the position_ids of {rows} restart (the documents of a pack){beside}, but the call runs each row "
        "as one sequence, so its documents would attend to each other: call a pack as one row without an "
        "attention_mask (**lit_hbp.pack_inputs(batch)), or give its boundaries (cu_seq_lens_q)"
    )


def _check_packed_call(where: str, kwargs: dict) -> None:
    """What a packed call cannot honour: a KV cache, an attention mask other than all ones (one that pads
    inside the pack, a 4-D or per-layer mask of the caller's own: the boundaries decide what attends)."""
    if kwargs.get("use_cache") is True:  # asked for: made of the pack, it would continue its documents as one row
        raise ValueError(
            f"{where}: a packed call (document boundaries) with use_cache=True: a pack's documents cannot be continued "
            "as one row, so no cache is made of it; call it with use_cache=False, or unpacked"
        )
    if kwargs.get("output_attentions"):  # families that take it as their own argument never pass it to attention
        raise ValueError(
            f"{where}: a packed call with output_attentions=True: the packed attention computes no weights (a "
            "family's own attention would return none or empty ones); call it unpacked, each document alone"
        )
    cache = _cache_of(kwargs)
    if cache is not None:  # one of earlier tokens, or an empty one the decoder would fill from the pack as one row
        earlier = not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0
        raise ValueError(
            f"{where}: a packed call (document boundaries) with a KV cache{' of earlier tokens' if earlier else ''}: "
            "a pack's documents start from nothing and no cache is made of them; call it without past_key_values"
        )
    if kwargs.get("cu_seq_lens_q") is not None:
        _check_boundaries(where, kwargs["cu_seq_lens_q"], kwargs.get("max_length_q"), _row_tokens(kwargs))
        k = kwargs.get("cu_seq_lens_k")
        cpu = isinstance(k, torch.Tensor) and k.device.type == "cpu" and kwargs["cu_seq_lens_q"].device.type == "cpu"
        if cpu and not torch.equal(k.long(), kwargs["cu_seq_lens_q"].long()):  # self-attention: the same documents
            raise ValueError(
                f"{where}: cu_seq_lens_k {k.tolist()} differs from cu_seq_lens_q: give the same boundaries"
            )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError(
            f"{where}: a packed call with an attention_mask that has zeros: the boundaries (cu_seq_lens_q) say where "
            "documents end, and a mask cannot pad inside a pack; drop the attention_mask"
        )
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        shape = f"a {mask.dim()}-D tensor" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise ValueError(
            f"{where}: a packed call with an attention_mask of its own ({shape}): lit-hbp's attention takes each "
            "document causally from the boundaries (cu_seq_lens_q) and would ignore it; drop the attention_mask"
        )


def _row_tokens(kwargs: dict) -> int | None:
    """The tokens of the call's row; None for a rank's shard of a pack under SP (the boundaries span the pack)."""
    if kwargs.get("hbp_sp") is not None or kwargs.get("hbp_cp_shard") is not None:
        return None
    rows = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None), None)
    return int(rows.shape[1]) if isinstance(rows, torch.Tensor) and rows.dim() >= 2 else None


def _restarting_positions(where: str, kwargs: dict) -> torch.Tensor:
    """Each document's positions from 0, for a caller's boundaries given without positions: the decoder would
    number the row as one sequence, which learned absolute positions (GPT-2, OPT) read as other tokens than each
    document alone. Computed on the boundaries' device (no read of it)."""
    tokens = _row_tokens(kwargs)
    if tokens is None:
        raise ValueError(
            f"{where}: a rank's shard of a pack with document boundaries but no position_ids: its positions cannot "
            "be told from the shard; call it with **lit_hbp.pack_inputs(batch)"
        )
    rows = next(kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
    cu = kwargs["cu_seq_lens_q"].long()
    step = torch.arange(tokens, device=cu.device)
    starts = cu[torch.searchsorted(cu[1:], step, right=True)]
    return (step - starts).to(rows.device).expand(rows.shape[0], tokens)


def _check_boundaries(where: str, cu, longest, tokens: int | None) -> None:
    """A caller's own ``cu_seq_lens_q``: a 1-D integer tensor rising from 0 to the row's tokens, ``max_length_q``
    at least its longest document (they failed deep in the model, or passed: a pack past the row's end). Its
    values are read where that is free, on the host (on a GPU the read would wait for the device)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        got = f"a {cu.dim()}-D {cu.dtype} tensor" if isinstance(cu, torch.Tensor) else f"a {type(cu).__name__}"
        raise ValueError(f"{where}: cu_seq_lens_q must be a 1-D int32 tensor of boundaries [0, ..., tokens], got {got}")
    if cu.device.type != "cpu":
        return
    b = cu.tolist()
    if b[0] != 0 or any(y < x for x, y in zip(b, b[1:])) or (tokens is not None and b[-1] != tokens):
        raise ValueError(
            f"{where}: cu_seq_lens_q {b if len(b) <= 8 else [*b[:4], '...', *b[-2:]]} must rise from 0 to the row's "
            f"{tokens} tokens (each document's start, then the row's end)"
        )
    widest = max(y - x for x, y in zip(b, b[1:]))
    if longest is not None and int(longest) < widest:
        raise ValueError(f"{where}: max_length_q {int(longest)} is below the longest document's {widest} tokens")


def install_call_hooks(prepared: Prepared) -> None:
    """The model's hooks: the decoder runs a call that carries a pack in a ``pack_scope`` (unless
    ``packed_loss`` opened one), and refuses a pack's token ids without boundaries or positions; the
    model refuses its own loss on a pack it would compute wrong, and hands a packed call's boundaries to its
    decoder where its forward does not (``_model_pack``)."""
    prepared.hooks = [
        prepared.decoder.register_forward_pre_hook(_enter_call, with_kwargs=True),
        prepared.decoder.register_forward_hook(_leave_call, with_kwargs=True, always_call=True),
        prepared.net.register_forward_pre_hook(_check_model_call, with_kwargs=True),
        prepared.net.register_forward_hook(_leave_model_call, with_kwargs=True, always_call=True),
    ]


def _takes(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s forward has a parameter ``name`` (not only ``**kwargs``)."""
    return name in _parameters(type(module).forward)[0]


@functools.cache
def _parameters(forward) -> tuple[frozenset[str], bool]:
    """A forward's named parameters, and whether it takes ``**kwargs``."""
    params = inspect.signature(forward).parameters.values()
    return frozenset(p.name for p in params), any(p.kind is p.VAR_KEYWORD for p in params)


def _model_pack(prepared: Prepared, positions: Any = None) -> dict | None:
    """The boundaries of the packed call of the whole model this thread is running, if any: what its decoder
    gets when the model's forward drops them (Mamba's, Mamba2's and FalconMamba's pass their backbone neither
    positions nor boundaries), or, given the ``positions`` the model was called with, what they were read as
    (read from the device once a call, not again by the decoder)."""
    entry = _model_entry(prepared)
    if entry is None or entry[1] is None:
        return None
    _, packed, called_with, _ = entry
    return packed if positions is None or positions is called_with else None


def _model_entry(prepared: Prepared) -> tuple | None:
    """What the model's own hook noted of the call of the whole model this thread is running (its boundaries,
    positions and the level's settings), if that call is of ``prepared``'s model and went through its hook."""
    pending = getattr(calls._local, "model_packs", None)
    if not pending or pending[-1] is None or pending[-1][0] is not prepared:
        return None
    return pending[-1]


def _forward_arguments(net: torch.nn.Module) -> dict | None:
    """The arguments of ``net``'s forward running on this thread's stack, by name (its ``**kwargs`` merged), found
    from its decoder's hook when the model ran without its own hooks (``model.forward(...)``); None when the
    decoder was called by itself."""
    frame = sys._getframe(1)
    for _ in range(64):  # the decoder's hook, torch's call machinery, the model's forward and its decorators
        if frame is None:
            return None
        local = frame.f_locals
        if local.get("self") is net and "labels" in local:
            extra = local.get("kwargs")
            return {**(extra if isinstance(extra, dict) else {}), **{k: v for k, v in local.items() if k != "kwargs"}}
        frame = frame.f_back
    return None


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _enter_call(decoder: torch.nn.Module, args: tuple, kwargs: dict):
    prepared: Prepared = decoder.__dict__[PREPARED]
    entered = getattr(calls._local, "hooked", None)
    if entered is None:
        entered = calls._local.hooked = []
    entered.append(None)  # what the forward hook closes, also when this hook raises
    if calls.current(prepared) is not None:  # packed_loss's scope, or a recomputation inside it
        return None
    args, kwargs = _named(decoder, args, kwargs)
    positions = kwargs.get("position_ids")
    packed = _model_pack(prepared, positions) if isinstance(positions, torch.Tensor) else None
    packed = packed or _packed_keywords(kwargs)
    if packed is None and (packed := _model_pack(prepared)) is not None:
        if _takes(decoder, "position_ids"):
            raise ValueError(
                f"{type(prepared.net).__name__} was called on a pack (restarting positions or document boundaries) "
                f"but its forward passed {type(decoder).__name__} neither, which would number the pack as one "
                "sequence: compute the loss with lit_hbp.packed_loss(model, batch)"
            )
    ids = kwargs.get("input_ids", args[0] if args else None)
    sp = ids.__dict__.get(SP_MARK, 1) if isinstance(ids, torch.Tensor) else 1  # a rank's shard of the pack
    if sp > 1 and kwargs.get("hbp_sp") is None and kwargs.get("hbp_cp_shard") is None:  # restarting or not
        raise ValueError(
            f"{type(decoder).__name__} was called on one rank's shard of a pack of sequence parallelism {sp} without "
            "its SP group, so the shard would attend only to itself: call the model with **lit_hbp.pack_inputs(batch)"
        )
    if packed is None:
        segments = ids.__dict__.get(PACK_MARK, 0) if isinstance(ids, torch.Tensor) else 0
        masked = kwargs.get("attention_mask") is not None  # transformers then attends over the row as one
        if segments > 1 and (kwargs.get("position_ids") is None or masked):
            without = "with an attention_mask but without their document boundaries"
            without = without if masked else "without their document boundaries or positions"
            raise ValueError(
                f"{type(decoder).__name__} was called on a packed micro-batch of {segments} segments {without}, so "
                "they would attend to each other: compute the loss with "
                "lit_hbp.packed_loss(model, batch), or call the model with **lit_hbp.pack_inputs(batch)"
            )
        _refuse_merged_documents(type(decoder).__name__, kwargs)
        return None
    _check_packed_call(type(decoder).__name__, kwargs)
    entry = _model_entry(prepared)
    if entry is None and (called := _forward_arguments(prepared.net)) is not None:
        _check_own_loss(called)  # model.forward(...): PyTorch ran none of the model's hooks
    level = ids.__dict__.get(LEVEL_MARK) if isinstance(ids, torch.Tensor) else None
    level = level or (entry[3] if entry is not None else None)
    if kwargs.get("position_ids") is None and "cu_seq_lens_q" in packed and _takes(decoder, "position_ids"):
        kwargs = {**kwargs, "position_ids": _restarting_positions(type(decoder).__name__, kwargs)}
    pack = {**kwargs, **packed}
    names, open_ended = _parameters(type(decoder).forward)
    kwargs = {**kwargs, **{k: v for k, v in packed.items() if open_ended or k in names}}
    kwargs.pop("attention_mask", None)
    if "use_cache" in names:  # a pack's documents cannot be continued as one row: no cache is made of it
        kwargs["use_cache"] = False
    if level is None:
        scope = pack_scope(decoder, pack=pack)
    else:  # a PackedBatch's ids: its level's settings, as packed_loss runs them (a smaller teacher: all its layers)
        ckpt_layers, offload, tiles = level
        scope = pack_scope(decoder, min(ckpt_layers, len(prepared.layers)), offload, tiles, pack=pack)
    scope.__enter__()
    entered[-1] = scope
    return args, kwargs


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _leave_call(decoder: torch.nn.Module, args: tuple, kwargs: dict, output):
    scope = calls._local.hooked.pop()
    if scope is not None:
        scope.__exit__(None, None, None)
    return None


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _check_model_call(net: torch.nn.Module, args: tuple, kwargs: dict):
    """A packed call of the model as a whole: images or a prefix where its family attends both ways among
    them (``lit_hbp.model.vision.attends_both_ways``) are refused, and so is its own loss where it would be wrong; a
    multimodal text row its language model would not strip is taken off (``without_unread_text_row``);
    its boundaries and a PackedBatch's level settings are kept for its decoder's call (``_model_pack``) and no
    cache is made of it."""
    pending = getattr(calls._local, "model_packs", None)
    if pending is None:
        pending = calls._local.model_packs = []
    pending.append(None)  # what _leave_model_call takes off, also when this hook raises
    args, kwargs = _named(net, args, kwargs)
    if attends_both_ways(net) is not None:
        if kwargs.get("hbp_sp") is not None or _packed_keywords(kwargs) is not None:
            refuse_bidirectional(net, kwargs)
    if has_batch_norms(net) and (kwargs.get("hbp_sp") is not None or _packed_keywords(kwargs) is not None):
        refuse_batch_statistics(net, kwargs)  # asked only of a model that has one: no read for any other
    _check_own_loss(kwargs)
    prepared = net.__dict__[PREPARED]
    axes = without_unread_text_row(net, kwargs.get("position_ids"))
    if axes is not None:  # HunYuan-VL's: a packed call's [text row, axes] as its language model reads them
        kwargs = {**kwargs, "position_ids": axes}
    if calls.current(prepared) is not None:
        return None if axes is None else (args, kwargs)
    packed = _packed_keywords(kwargs)
    ids = kwargs.get("input_ids")
    level = ids.__dict__.get(LEVEL_MARK) if isinstance(ids, torch.Tensor) else None
    pending[-1] = (prepared, packed, kwargs.get("position_ids"), level)
    if packed is None:
        return None
    _check_packed_call(type(net).__name__, {"use_cache": kwargs.get("use_cache")})  # asked for: refused
    if _takes(net, "use_cache"):
        return args, {**kwargs, "use_cache": False}
    return args, kwargs  # named: as called


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _leave_model_call(net: torch.nn.Module, args: tuple, kwargs: dict, output):
    calls._local.model_packs.pop()
    return None


def _check_own_loss(kwargs: dict):
    """The model's own loss (``labels=``) in a packed call: transformers shifts the labels by one over
    the whole row, which is each document's loss when the labels are ordinary (the token itself) and
    every document's first label is the ignore index (-100, or the call's ``ignore_index``), as
    ``DataCollatorWithFlattening`` makes them. lit-hbp's
    pre-shifted labels, other first labels, and any such loss under sequence parallelism (each rank would
    average its shard alone) are refused; a PackedBatch's labels are known by their mark (``SHIFTED_MARK``) also
    without the token ids to compare them with (``inputs_embeds``). One read-back from the device per call with
    labels. ``kwargs``: the call's arguments by name."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return None
    sp = kwargs.get("hbp_sp")
    packed = _packed_keywords(kwargs) if sp is None else {}
    if packed is None:
        return None
    if sp is not None:
        raise ValueError(
            f"the model's own loss under sequence parallelism {sp.ctx.size} would average each rank's shard of the "
            "pack separately, not per token over the pack: compute it with lit_hbp.packed_loss(model, batch)"
        )
    if kwargs.get("shift_labels") is not None:
        return None  # the targets of each position, as given
    if labels.__dict__.get(SHIFTED_MARK):
        _refuse_pre_shifted()
    ids = kwargs.get("input_ids")
    ignore = kwargs.get("ignore_index", -100)  # transformers' loss takes it as a keyword of the call
    cu = packed.get("cu_seq_lens_q")
    starts = cu[1:-1].long() if cu is not None else labels.new_zeros(0)
    row = labels[0]
    checks = [(row.index_select(0, starts.to(row.device)) == ignore).all()]
    if isinstance(ids, torch.Tensor) and ids.shape == labels.shape:
        ids = ids[0]
        checks.append(((row == ids) | (row == ignore)).all())
        checks.append(((row[:-1] == ids[1:]) | (row[:-1] == ignore)).all() & (row[-1] == ignore))
    verdict = torch.stack(checks).tolist()
    first_ok, ordinary, pre_shifted = (*verdict, True, False)[:3]
    if pre_shifted and not ordinary:
        _refuse_pre_shifted()
    if not first_ok:
        raise ValueError(
            f"labels= of this packed call: a document's first label is not the ignore index {ignore}, so transformers' "
            "loss, which shifts the labels over the whole row, would train the previous document's last token to "
            f"predict it; set the first label of every document to {ignore} (DataCollatorWithFlattening does), or "
            "pass shift_labels"
        )
    return None


def _refuse_pre_shifted():
    raise ValueError(
        "labels= of this packed call are pre-shifted (labels[t] is the target of position t, as lit-hbp's "
        "batches have them) and transformers' loss would shift them again: pass shift_labels=batch.labels too "
        "(the targets as they are), or compute the loss with lit_hbp.packed_loss(model, batch)"
    )
