"""What a strategy checks of the model a LightningModule trains, before its levels run: the Hugging Face model
inside it (``trained_model``), the levels that model cannot run (stateful token mixers under context parallelism or
ZeRO-3, a router loss or chunked attention under context parallelism), and the frozen models it holds unprepared
(``guard_frozen``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle

from lit_hbp.data.batch import PACK_MARK, SP_MARK
from lit_hbp.errors import ConfigError
from lit_hbp.model.build import family_of
from lit_hbp.model.mixers import ZERO3_REFUSAL, sp_refusal, stateful_mixers
from lit_hbp.model.packed_call import record_of
from lit_hbp.model.position_limits import position_limits
from lit_hbp.model.router_loss import ROUTER_CP
from lit_hbp.packing.levels import Level
from lit_hbp.parallel.kind import resolve_sp_kind


def trained_model(module: torch.nn.Module, levels: list[Level]) -> torch.nn.Module:
    """The Hugging Face model a LightningModule trains (the outermost one with trainable parameters:
    HBPLitModule's, or the one a module of one's own holds), checked against the levels: sequence
    parallelism runs inside lit-hbp's attention, so at a level with sp > 1 a trainable model that
    ``prepare_model`` did not prepare would train each rank's shard alone. A frozen model the module
    holds (a teacher, a reference) may stay as it is while it never sees a pack (``guard_frozen``)."""
    from transformers import PreTrainedModel

    found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    nets = [(n, m) for n, m in found if not any(m is not o and m in set(o.modules()) for _, o in found)]
    if not nets:
        raise ValueError(
            f"HBPStrategy: {type(module).__name__} holds no Hugging Face model (a transformers PreTrainedModel), whose "
            "decoder lit-hbp's attention and levels need"
        )
    trainable = [(n, m) for n, m in nets if any(p.requires_grad for p in m.parameters())]
    sp_levels = [lv for lv in levels if lv.sp > 1]
    for name, net in trainable:
        if sp_levels and record_of(net) is None:
            lv = sp_levels[0]
            raise ValueError(
                f"HBPStrategy: the level of {lv.pack_len} tokens has sp {lv.sp}, but {_path(name)} "
                f"({type(net).__name__}) is not prepared for packs and would attend within each rank's shard only: "
                f"call lit_hbp.prepare_model({_path(name)}) in your module's configure_model (HBPLitModule does)"
            )
    return (trainable or nets)[0][1]


def refuse_sp_over_mixers(net: torch.nn.Module, levels: Sequence[Level]) -> None:
    """A level (laid out) whose SP kind cannot give a model's document-by-document token mixers
    (``lit_hbp.model.mixers``) each document whole is refused at set-up, naming the level."""
    record = record_of(net)
    if record is None or not record.mixers:
        return
    mixers = stateful_mixers(record.decoder)
    for i, lv in enumerate(levels):
        problem = sp_refusal(family_of(net), mixers, lv, f"data.levels[{i}] (pack_len {lv.pack_len}, sp {lv.sp})")
        if problem is not None:
            raise ConfigError(problem)


def refuse_cp_under_router_loss(net: torch.nn.Module, levels: Sequence[Level]) -> None:
    """A level (laid out) whose SP kind does not gather a pack's tokens (context parallelism) with a model trained on
    its router loss (``output_router_logits``: a mean over the whole pack) is refused at set-up, naming the level,
    rather than at its first micro-batch, after the levels before it trained (``packed_loss`` refuses it there)."""
    if not getattr(net.config.get_text_config(), "output_router_logits", False):
        return
    for i, lv in enumerate(levels):
        kind = resolve_sp_kind(lv.sp_kind)
        if kind.mixer_problem(lv.layout[1]) is not None:
            said = ROUTER_CP.format(family=family_of(net), kind=kind.name, cp=lv.layout[1])
            raise ConfigError(f"data.levels[{i}] (pack_len {lv.pack_len}, sp {lv.sp}): {said}")


def refuse_cp_past_chunks(net: torch.nn.Module, levels: Sequence[Level]) -> None:
    """A level (laid out) with context parallelism longer than the chunks a model's layers attend within (Llama 4's
    ``attention_chunk_size``: each document cut every so many positions, which a CP shard's ranges do not cut) is
    refused at set-up, naming the level, rather than at its first long document (``position_limits``)."""
    chunks = [lim for lim in position_limits(net.config.get_text_config()) if lim.field == "attention_chunk_size"]
    for i, lv in enumerate(levels):
        for lim in chunks:
            if lv.layout[1] > 1 and lv.pack_len > lim.length:
                raise ConfigError(
                    f"data.levels[{i}] (pack_len {lv.pack_len}, sp {lv.sp}): {family_of(net)}'s layers attend within "
                    f"chunks of attention_chunk_size ({lim.length}) positions of each document, which context "
                    f"parallelism (cp {lv.layout[1]}) does not cut: give the level cp: 1 (Ulysses alone), or a "
                    f"pack_len <= {lim.length}"
                )


def refuse_mixers_under_zero3(net: torch.nn.Module, stage: int) -> None:
    """A model with stateful token mixers under ZeRO stage 3 is refused at set-up (``mixers.ZERO3_REFUSAL``),
    before DeepSpeed partitions it; packed calls refuse it too, on every path."""
    record = record_of(net)
    if stage == 3 and record is not None and record.mixers:
        raise ConfigError(f"HBPStrategy stage 3: {family_of(net)} holds {ZERO3_REFUSAL}")


def _path(name: str) -> str:
    """A submodule's attribute path as the module's own code names it."""
    return f"self.{name}" if name else "the module"


def guard_frozen(module: torch.nn.Module) -> list[RemovableHandle]:
    """Hooks on each frozen Hugging Face model ``module`` holds unprepared (a teacher, a reference) that
    refuse, naming the attribute, a packed call it would compute wrong: under SP (it would attend within one
    rank's shard), with boundaries and its KV cache on (documents would attend to each other), a pack's ids
    without boundaries or positions, any packed call of a model with a stateful token mixer
    (``lit_hbp.model.mixers``). Outside a pack, and on ``pack_inputs`` at sp 1 with the cache off
    (transformers' own packed path), such a model runs as it always did."""
    from transformers import PreTrainedModel

    handles = []
    for name, net in module.named_modules():
        if not isinstance(net, PreTrainedModel) or record_of(net) is not None:
            continue
        if any(p.requires_grad for p in net.parameters()):
            continue
        mixers = stateful_mixers(net)
        stateful = None
        if mixers:
            m = mixers[0]
            stateful = (
                f"{family_of(net)}'s `{m.path}` ({m.cls}) is {m.kind}, whose state transformers' packed path carries "
                f"from one document into the next: call lit_hbp.prepare_model({_path(name)}), whose packed calls run "
                "it document by document"
            )
        hook = partial(_refuse_pack, _path(name), stateful)
        handles.append(net.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _refuse_pack(path: str, stateful: str | None, net, args: tuple, kwargs: dict):
    ids = kwargs.get("input_ids", args[0] if args else None)
    marked = isinstance(ids, torch.Tensor) and ids.__dict__.get(PACK_MARK, 0) > 1
    sharded = isinstance(ids, torch.Tensor) and ids.__dict__.get(SP_MARK, 1) > 1  # a rank's shard of the pack
    boundaries = kwargs.get("cu_seq_lens_q") is not None
    positions = marked and kwargs.get("position_ids") is not None  # transformers reads them as the documents
    why = None
    if stateful is not None and (marked or boundaries):
        raise ValueError(f"{path} is called on a packed micro-batch, but {stateful}")
    if kwargs.get("hbp_sp") is not None or kwargs.get("hbp_cp_shard") is not None or sharded:
        why = "under sequence parallelism its ranks' shards would attend only to themselves"
    elif (boundaries or positions) and kwargs.get("use_cache", net.config.use_cache) is not False:
        why = "with its KV cache on, transformers lets the documents of the pack attend to each other"
    elif marked and not boundaries and kwargs.get("position_ids") is None:
        why = "without boundaries or positions its documents would attend to each other"
    elif marked and not boundaries and kwargs.get("attention_mask") is not None:
        why = "with an attention mask and no boundaries transformers attends over the pack as one sequence"
    if why is not None:
        raise ValueError(
            f"{path} ({type(net).__name__}) is called on a packed micro-batch but is not prepared for packs: {why}; "
            f"call lit_hbp.prepare_model({path}) in configure_model and call it with **lit_hbp.pack_inputs(batch)"
        )
    return None
