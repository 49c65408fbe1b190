"""What a family's own code does that a packed call cannot see, refused by ``prepare_model`` before anything is
done to the model.

A packed call keeps documents apart through three things only: transformers' AttentionInterface (lit-hbp's
varlen attention, given the window, sinks and soft-cap the attention call passes), each document's own positions
handed to the decoder, and the output layer the packed loss runs on the decoder's hidden states. A family that
computes attention in its own module, applies its sliding window through the mask alone, numbers positions
itself or runs weights between its decoder and output layer would train silently wrong through ``prepare_model``
+ ``packed_loss`` (the self-check at the start of ``fit`` caught it there, but nothing on the public core did).
These are read from the family's source code and the built model, as transformers' own code is written; a source
that cannot be read counts as fine, and the self-check stays the second line.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

import torch

from lit_hbp.model.vision import tower_beside_language_model

INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "eager_attention_forward")
"""What a module's code names when its attention goes through transformers' AttentionInterface."""
RENUMBERED = re.compile(r"^(?P<indent>\s*)position_ids\s*=\s*torch\.arange\(", re.M)


@functools.cache
def _source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return None


def _names(cls: type, words: tuple[str, ...]) -> bool:
    """Whether the code of ``cls`` or of a class it inherits from names any of ``words``: the family's classes,
    not transformers' machinery (``PreTrainedModel`` names everything) nor torch's; an unreadable source counts
    as naming them."""
    for klass in cls.__mro__:
        where = klass.__module__
        if where.startswith(("torch.", "builtins")) or (
            where.startswith("transformers.") and not where.startswith("transformers.models.")
        ):
            continue
        src = _source(klass)
        if src is None or any(w in src for w in words):
            return True
    return False


def _attention_modules(decoder: torch.nn.Module, mixers: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """The decoder's modules named as attention (``...Attention``), outside its stateful mixers."""
    out = []
    for path, module in decoder.named_modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        if any(path == m or path.startswith(m + ".") for m in mixers):
            continue
        out.append((path, module))
    return out


def _own_attention(module: torch.nn.Module) -> bool:
    """Whether neither ``module`` nor any module inside it goes through the AttentionInterface."""
    return not any(_names(type(m), INTERFACE) for m in module.modules())


@functools.cache
def _passed_keywords(cls: type) -> dict[str, bool]:
    """The keywords the family's own ``forward`` of ``cls`` passes to its attention function by name (``keyword:
    whether the code may pass None``: the name it passes is assigned None somewhere in its class, as MiniMax-M3's
    ``block_indices`` without an indexer), read from the source once per class; empty when it cannot be read."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers.models.") or "forward" not in vars(klass):
            continue
        src = _source(klass)
        try:
            tree = ast.parse(textwrap.dedent(src)) if src is not None else None
        except SyntaxError:
            tree = None
        if tree is None:
            return {}
        nones = {
            t.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value is None
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        out = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "attention_interface":
                for k in n.keywords:
                    if k.arg is not None:
                        out[k.arg] = (isinstance(k.value, ast.Constant) and k.value.value is None) or (
                            isinstance(k.value, ast.Name) and k.value.id in nones
                        )
        return out
    return {}


def _unimplemented_keywords(module: torch.nn.Module) -> list[str]:
    """The keywords ``module``'s code always hands its attention function (a relative position bias, sinks of
    another name) that lit-hbp's varlen attention does not implement; its call refuses them at run time, this
    before the model is touched."""
    from lit_hbp.model.attention import CHECKED, IGNORED, varlen_attention

    known = set(inspect.signature(varlen_attention).parameters) | IGNORED | CHECKED
    return sorted(k for k, maybe_none in _passed_keywords(type(module)).items() if k not in known and not maybe_none)


ENCODER_STATES = ("encoder_attn", "crossattention")
"""What an encoder-decoder family's decoder calls its attention over the encoder's states, which runs only when a
call passes them (a packed call never does)."""


def _bidirectional(path: str, module: torch.nn.Module, text: bool) -> bool:
    """Whether ``module`` lets a token see later ones (``is_causal=False``): an encoder's self-attention (BERT's
    without ``is_decoder``), or a text model's cross-attention between positions of its own row (BLT's between
    bytes and patches). Not one: attention over an encoder's states, nor a vision-language model's over its
    images."""
    parts = path.split(".")
    if getattr(module, "is_causal", True) is not False or any(p in ENCODER_STATES for p in parts):
        return False
    cross = "Cross" in type(module).__name__ or any("cross" in p for p in parts)
    return text or not cross


def _window_in_mask_only(module: torch.nn.Module, decoder: torch.nn.Module, config) -> int | None:
    """The config's sliding window when it can bind (narrower than the positions), the decoder's code builds a mask
    with it and ``module``'s code never names it: the window is then the mask's alone, which a packed call does not
    build (a config field neither names is not used at all)."""
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or isinstance(window, bool) or (longest is not None and window >= longest):
        return None
    if not _names(type(decoder), ("sliding_window",)):
        return None
    return None if any(_names(type(m), ("sliding_window",)) for m in module.modules()) else window


def _renumbers_positions(decoder: torch.nn.Module) -> bool:
    """Whether the decoder's forward sets ``position_ids`` to ``torch.arange`` over the row outside an ``if
    position_ids is None:`` block (the BART family's decoders), so a packed call's positions would count on across
    its documents."""
    try:
        src = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    lines = src.splitlines()
    for match in RENUMBERED.finditer(src):
        at, indent = src.count("\n", 0, match.start()), len(match["indent"])
        opener = next((line for line in reversed(lines[:at]) if line.strip() and _indent(line) < indent), "")
        if "position_ids is None" not in opener:  # not inside ``if position_ids is None:``
            return True
    return False


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _outside_weights(net: torch.nn.Module, decoder: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's own modules beside its decoder and output layer that hold weights: its forward runs them
    (ModernBERT decoder's prediction head before its output layer) and the packed loss does not."""
    head = net.get_output_embeddings()
    ran = {id(p) for m in (decoder, head) if m is not None for p in m.parameters()}
    out = []
    for name, child in net.named_children():
        if any(m is decoder for m in child.modules()):
            continue
        if any(id(p) not in ran for p in child.parameters()):  # frozen too: packed_loss's logits would skip them
            out.append((name, child))
    return out


def refuse_unseen(net: torch.nn.Module, decoder: torch.nn.Module, family: str, mixers: set[str], text: bool) -> None:
    """Raise ``ValueError`` naming the first thing of ``net``'s family a packed call cannot reproduce (see the
    module's docstring); ``mixers``: the paths of the decoder's stateful mixers (run document by document);
    ``text``: a text-only model (a vision-language model's tower and projector sit beside its decoder)."""
    end = "so a pack's documents would train differently than each alone: refused (docs/families.md)"
    config = net.config.get_text_config()
    for path, module in _attention_modules(decoder, mixers):
        where = f"{family}: its `{path}` ({type(module).__name__})"
        if _own_attention(module):
            raise ValueError(
                f"{where} computes attention in its own code, not through transformers' AttentionInterface, where "
                f"lit-hbp's varlen attention would keep each document to itself, {end}"
            )
        unknown = _unimplemented_keywords(module)
        if unknown:
            raise ValueError(
                f"{where} hands its attention function {', '.join(map(repr, unknown))}, which lit-hbp's varlen "
                f"attention does not implement, {end}"
            )
        if _bidirectional(path, module, text):
            kind = (
                "a cross-attention between positions of its own row"
                if "Cross" in type(module).__name__
                else "an encoder's attention; a decoder built from an encoder family needs is_decoder=True in its "
                "config"
            )
            raise ValueError(
                f"{where} is not causal (is_causal=False: each token sees the later ones: {kind}), while lit-hbp's "
                f"attends causally within each document, {end}"
            )
        window = _window_in_mask_only(module, decoder, config)
        if window is not None:
            raise ValueError(
                f"{where} applies the config's sliding_window ({window}) through the attention mask only, which a "
                f"packed call does not build, {end}"
            )
    if getattr(config, "alibi", False) is True:
        raise ValueError(
            f"{family}: its config sets alibi (ALiBi position biases, which its model adds to the attention mask a "
            f"packed call does not build), {end}"
        )
    if _renumbers_positions(decoder):
        raise ValueError(
            f"{family}: its `{type(decoder).__name__}` numbers a call's positions itself (torch.arange over the row) "
            f"instead of taking each document's own, {end}"
        )
    if text and (beside := tower_beside_language_model(net)) is not None:
        raise ValueError(_layout_refusal(net, decoder, family, *beside))
    if text:
        for name, child in _outside_weights(net, decoder):
            raise ValueError(
                f"{family}: its `{name}` ({type(child).__name__}) holds weights its forward runs between the decoder "
                f"and the output layer, which lit-hbp's packed loss does not, {end}"
            )


def _layout_refusal(net: torch.nn.Module, decoder: torch.nn.Module, family: str, name: str, tower) -> str:
    """Why a model holding its vision tower beside its language model on the top module is refused, and what of
    it lit-hbp can train: that language model, prepared alone, where it is a causal LM of its own."""
    holder = next((n for n, c in net.named_children() if any(m is decoder for m in c.modules())), None)
    lm = net.get_submodule(holder) if holder is not None else None
    alone = (
        f"; to train its text, prepare its `{holder}` ({type(lm).__name__}) alone"
        if lm is not None and lm is not net and getattr(lm, "get_output_embeddings", lambda: None)() is not None
        else ""
    )
    return (
        f"{family}: its `{name}` ({type(tower).__name__}) sits beside its language model on the top module, "
        "with no inner `model` that encodes images (get_image_features): a vision-language layout lit-hbp does "
        f"not run, for images or text: refused (docs/families.md){alone}"
    )
