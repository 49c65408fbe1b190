"""The output layer as the family's own forward applies it: ``packed_loss`` calls the decoder and computes the
logits itself (in chunks, over the supervised positions only), so every scale or cap a family's forward puts on
its logits has to be applied here too, or the pack trains on other logits than the model's own.

The scales and caps are read from the config fields the forward names, with the operator its source applies
(Granite divides by ``logits_scaling``, HyperCLOVAX multiplies by it); ``check_output_head`` then runs the
model's own forward on hidden states of its choosing (the decoder stood in for) and refuses, at
``prepare_model``, a family whose logits are not those (a multiplier under a name lit-hbp does not know, a layer
between the decoder and the head)."""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch

# Fields a family's forward multiplies or divides the logits by: Cohere's logit_scale, Granite's and HyperCLOVAX's
# logits_scaling, Falcon-H1's lm_head_multiplier (on its decoder: ``self.model.lm_head_multiplier``), output_multiplier.
SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")
# Gemma 2/3's name, xLSTM's and RecurrentGemma's: cap * tanh(logits / cap) in each family's forward
CAPS = ("final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap")


# ``self.lm_head(hidden_states.to(self.lm_head.weight.dtype))``: the forward of Mamba, Mamba2, FalconMamba, xLSTM and
# HY-V4 (the first three's decoders return fp32 hidden states beside bf16 weights)
CAST = re.compile(r"hidden_states\.to\(\s*(?:dtype\s*=\s*)?self\.lm_head\.weight\.dtype\s*\)")


@dataclass(frozen=True)
class OutputHead:
    """logits = softcap(scale * linear(hidden)), as the family's forward computes them; ``cast``: its forward
    casts the hidden states to the layer's weight dtype first."""

    linear: torch.nn.Module
    scale: float = 1.0
    softcap: float | None = None
    cast: bool = False

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states as the layer takes them."""
        return hidden.to(self.linear.weight.dtype) if self.cast else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.linear(self.inputs(hidden))
        out = out.to(torch.promote_types(out.dtype, torch.float32))  # fp32 at least: float64 stays float64
        if self.scale != 1.0:
            out = out * self.scale
        if self.softcap:
            out = self.softcap * torch.tanh(out / self.softcap)
        return out


def output_head(net: torch.nn.Module) -> OutputHead:
    """The head as the model's own forward applies it: a setting of its (language model's) config counts
    only where the forward reads it (Aya Vision's forward leaves its Cohere 2 language model's
    ``logit_scale`` unapplied), by the operator the forward applies."""
    config = net.config.get_text_config()  # a vision-language model's head settings are its language model's
    source = _forward_source(type(net))
    scale = 1.0
    for name in SCALES:
        value = getattr(config, name, None)
        if value is None or (source is not None and name not in source):
            continue
        scale = scale / float(value) if _operator(type(net), name) == "/" else scale * float(value)
    softcap = next(
        (float(getattr(config, n)) for n in CAPS if getattr(config, n, None) and (source is None or n in source)), None
    )
    cast = source is not None and CAST.search(source) is not None
    return OutputHead(net.get_output_embeddings(), scale, softcap, cast)


@functools.cache
def _forward_source(cls: type) -> str | None:
    """``cls.forward``'s source (None where unreadable: every config field then counts, as its config says)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


@functools.cache
def _operator(cls: type, name: str) -> str:
    """``*`` or ``/``: how ``cls.forward`` applies the field ``name`` to the logits (``check_output_head``
    catches a forward that applies it otherwise)."""
    ops = set(re.findall(rf"([*/])=?\s*self\.[\w.]*\b{name}\b", _forward_source(cls) or ""))
    if len(ops) == 1:
        return ops.pop()
    return "/" if name == "logits_scaling" else "*"  # unread: Granite's divisor, the others' multipliers


class _Outputs(dict):
    """A decoder's outputs by name and by index, None for any the stand-in does not produce."""

    def __getattr__(self, name: str):
        return self.get(name)

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else dict.__getitem__(self, key)


class _Decoder(torch.nn.Module):
    """Stands in for the model's decoder for one call: returns ``hidden`` as its last hidden states; every other
    attribute is the decoder's (Falcon-H1's forward reads its multiplier from it)."""

    def __init__(self, decoder: torch.nn.Module, hidden: torch.Tensor):
        super().__init__()
        object.__setattr__(self, "_decoder", decoder)
        object.__setattr__(self, "_hidden", hidden)

    def forward(self, *args, **kwargs) -> _Outputs:
        return _Outputs(last_hidden_state=self._hidden)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_decoder"), name)


def check_output_head(net: torch.nn.Module, runner: torch.nn.Module) -> None:
    """Refuse a model whose own forward computes other logits from the decoder's hidden states than
    ``output_head`` does: the model's forward runs once on a few positions with ``runner`` (the decoder it
    calls) standing in, returning random hidden states. No verdict (the self-check stays the second line) where
    that forward does not run so: a head partitioned by ZeRO-3 or on the meta device, a forward needing more."""
    head = output_head(net)
    weight = getattr(head.linear, "weight", None)
    if weight is None or weight.device.type == "meta" or weight.numel() == 0 or hasattr(weight, "ds_id"):
        return
    owner = next(((m, n) for m in net.modules() for n, c in m.named_children() if c is runner), None)
    if owner is None:
        return
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    module, name = owner
    ids = torch.zeros(1, 4, dtype=torch.long, device=weight.device)
    modes = [(m, m.training) for m in net.modules()]
    try:
        setattr(module, name, _Decoder(runner, hidden))
        net.eval()  # no dropout (a LoRA adapter's on the head): both sides the same function of the states
        with torch.no_grad():
            got = net(input_ids=ids, use_cache=False).logits
            want = head.logits(hidden)
    except Exception:  # a forward that needs more than token ids: the self-check judges it
        return
    finally:
        setattr(module, name, runner)
        for m, training in modes:
            m.training = training
    got = got.to(want.dtype)
    tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 2e-2
    gap = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if gap > tol * max(1.0, float(want.abs().max())):
        raise ValueError(
            f"{net.config.model_type}: its forward computes other logits from the decoder's hidden states than "
            f"lit-hbp's packed loss would (output layer scaled by {head.scale}, soft cap {head.softcap}: largest "
            f"difference {gap:.3g}), so a pack would train on other logits than the model's; train another family "
            "(docs/families.md)"
        )
