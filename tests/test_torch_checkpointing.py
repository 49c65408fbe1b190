"""torch's own activation checkpointing around decoder layers (``apply_activation_checkpointing`` /
``checkpoint_wrapper``, as FSDP set-ups apply it, and its composable ``checkpoint(module)``) recomputes a layer in
the backward after the packed call returned, over the whole pack: reentrant, the gradients were silently wrong;
non-reentrant, torch's CheckpointError. Refused at the packed call and by ``prepare_model``; outside a pack the
wrapped model computes what it computed before, and lit-hbp's own checkpointing (the level's ``ckpt_layers``)
trains the pack exactly. The reference is the unprepared model (eager attention), each document alone."""

import functools

import numpy as np
import pytest
import torch
from conftest import separate_loss
from test_mixers import reference_of, tiny
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model
from lit_hbp.model.packed_call import record_of

LENGTHS = (37, 5, 30)


def documents(vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(3, vocab, n), np.ones(n, bool)) for n in LENGTHS]


def wrap(net: torch.nn.Module, impl: CheckpointImpl) -> None:
    """torch's checkpoint wrapper around every decoder layer, as FSDP users apply it."""
    layer = type(net.model.layers[0])
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, layer))


def worst_gradient_error(net: torch.nn.Module, reference: torch.nn.Module) -> float:
    want = dict(reference.named_parameters())
    worst = 0.0
    for name, param in net.named_parameters():
        other = want[name.replace("._checkpoint_wrapped_module", "")].grad
        worst = max(worst, (param.grad - other).abs().max().item() / max(other.abs().max().item(), 1e-6))
    return worst


@pytest.mark.parametrize("impl", [CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT])
@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_torchs_checkpoint_wrapper_on_decoder_layers_is_refused_in_a_packed_call(family, impl):
    """Wrapped after ``prepare_model``: a packed call (``packed_loss``, ``model(**pack_inputs(batch))``) refuses
    in one line naming the wrapper and lit-hbp's checkpointing; a plain call of the same model, each document
    alone, still gives the unprepared model's gradients (the wrapper is the project's, outside packs)."""
    net = tiny(family).train()
    reference = reference_of(net).train()
    docs = documents(net.config.vocab_size)
    separate_loss(reference, dict(enumerate(docs))).backward()
    prepare_model(net)
    wrap(net, impl)
    batch = pack_samples(docs)
    with pytest.raises(ValueError, match=r"`model\.layers\.\d+` is torch's CheckpointWrapper.*ckpt_layers"):
        packed_loss(net, batch, "sum")
    with pytest.raises(ValueError, match="CheckpointWrapper"):
        net(**pack_inputs(batch))
    separate_loss(net, dict(enumerate(docs))).backward()  # a plain call: transformers' own attention, each alone
    assert worst_gradient_error(net, reference) < 1e-4


def test_prepare_model_refuses_torchs_checkpointing_already_on_the_layers_before_touching_the_model():
    """Wrapped (or the composable checkpoint applied) before ``prepare_model``: refused there, the model left
    unprepared; the level's ``ckpt_layers`` on the unwrapped model trains the pack as each document alone."""
    net = tiny("bamba").train()
    wrap(net, CheckpointImpl.REENTRANT)
    with pytest.raises(ValueError, match=r"`model\.layers\.0` is torch's CheckpointWrapper.*gradient_checkpointing"):
        prepare_model(net)
    assert record_of(net) is None
    net = tiny("bamba").train()
    composable_checkpoint(net.model.layers[1])
    with pytest.raises(ValueError, match=r"`model\.layers\.1` has torch's composable checkpoint"):
        prepare_model(net)
    assert record_of(net) is None


def test_torchs_composable_checkpoint_after_prepare_model_is_refused_and_ckpt_layers_is_exact():
    """The composable ``checkpoint(layer)`` applied after ``prepare_model`` is refused by the packed call; the
    level's ``ckpt_layers`` (lit-hbp's checkpointing, recomputing inside the call) gives the reference's gradients."""
    net = tiny("bamba").train()
    reference = reference_of(net).train()
    docs = documents(net.config.vocab_size)
    separate_loss(reference, dict(enumerate(docs))).backward()
    prepare_model(net)
    batch = pack_samples(docs)
    packed_loss(net, batch.replace(ckpt_layers=len(net.model.layers)), "sum").loss.backward()
    assert worst_gradient_error(net, reference) < 1e-4
    composable_checkpoint(net.model.layers[0])
    with pytest.raises(ValueError, match=r"`model\.layers\.0` has torch's composable checkpoint"):
        packed_loss(net, batch, "sum")


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_torchs_checkpoint_wrapper_inside_decoder_layers_is_refused_by_prepare_model(family):
    """The wrapper on a module inside a layer (its attention, its mixer) recomputes that module outside the packed
    call as well: with reentrant checkpointing a llama's self_attn gradients were 1.24 off each document alone,
    accepted; ``prepare_model`` refuses it naming the module, before touching the model."""
    net = tiny(family).train()
    inner = type(net.model.layers[0].self_attn if family == "llama" else net.model.layers[0].mamba)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, inner))
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.\w+` inside a decoder layer is torch's own"):
        prepare_model(net)
    assert record_of(net) is None


@pytest.mark.parametrize("how", ["wrapper", "composable"])
def test_torchs_checkpointing_inside_a_layer_after_prepare_model_is_refused_by_the_packed_call(how):
    """A wrapper on a module inside a decoder layer applied after ``prepare_model`` (its attention: reentrant, a
    llama's self_attn gradients were 1.24 off each document alone, unsaid) is seen by the next packed call, which
    walks inside the layers too."""
    net = tiny("llama").train()
    prepare_model(net)
    batch = pack_samples(documents(net.config.vocab_size))
    packed_loss(net, batch, "sum").loss.backward()  # prepared, unwrapped: trains
    if how == "wrapper":
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
        inner = type(net.model.layers[0].self_attn)
        apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, inner))
        match = r"`model\.layers\.0\.self_attn` inside a decoder layer is torch's own"
    else:
        composable_checkpoint(net.model.layers[1].mlp)
        match = r"`model\.layers\.1\.mlp` inside a decoder layer is torch's own"
    with pytest.raises(ValueError, match=match):
        packed_loss(net, batch, "sum")


def test_a_wrapper_deeper_in_a_layer_after_prepare_model_is_seen_two_levels_in_by_the_call_and_wholly_by_prepare():
    """A packed call looks two levels inside each layer (an attention's projection: ``self_attn.q_proj``); deeper,
    the next ``prepare_model`` (a prepared model too) walks the whole model and refuses it."""
    net = tiny("llama").train()
    prepare_model(net)
    batch = pack_samples(documents(net.config.vocab_size))
    composable_checkpoint(net.model.layers[0].self_attn.q_proj)
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.self_attn\.q_proj` inside a decoder layer"):
        packed_loss(net, batch, "sum")
    deeper = tiny("llama").train()
    prepare_model(deeper)
    inner = torch.nn.Sequential(torch.nn.Identity())
    deeper.model.layers[1].mlp.act_fn = torch.nn.Sequential(inner)  # three levels in: act_fn.0.0
    composable_checkpoint(inner[0])
    packed_loss(deeper, pack_samples(documents(deeper.config.vocab_size)), "sum")  # past the call's two levels
    with pytest.raises(ValueError, match=r"`model\.layers\.1\.mlp\.act_fn\.0\.0` inside a decoder layer"):
        prepare_model(deeper)
