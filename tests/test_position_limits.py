"""Llama 4's text layers take positions from the call's row (a chunked mask, queries scaled by row position): a
packed call gives them each document's own (``lit_hbp.model.position_limits``), so a pack of documents longer
than a chunk and past ``floor_scale`` trains like each document alone (loss and every gradient, one process and
Ulysses sp 2 on two); what it cannot give is refused in the packed call, whichever way the pack is called."""

import numpy as np
import pytest
import torch
from conftest import separate_loss
from test_packed_loss import assert_logits_alone
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model
from lit_hbp.model import position_limits

LLAMA4 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
              no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# Layers 0 and 2 chunked (RoPE, chunks of 4), 1 and 3 full attention without RoPE, queries scaled from position 3 on.
BOTH = dict(attention_chunk_size=4, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5)
CHUNKED = dict(attention_chunk_size=4, attn_temperature_tuning=False)
TEMPERATURE = dict(attention_chunk_size=None, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5)
LENGTHS = [13, 3, 9, 1, 6]  # documents longer than a chunk, shorter, one token; the last ends at row position 31


def pair(**kw):
    """The family's own model (eager attention, the reference) and a prepared copy with the same weights."""
    config = AutoConfig.for_model("llama4_text", **LLAMA4, **kw)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(reference.state_dict())
    return reference, prepare_model(model).eval()


def documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 96, n), np.ones(n, bool)) for n in lengths]


def assert_like_alone(model, reference, pairs, loss, ce: float | None = None) -> None:
    """The pack's summed CE (``ce``, else ``loss``'s) and every gradient ``loss.backward()`` left in ``model`` equal
    each document alone through ``reference`` (CE to 1e-5, gradients to 1e-4 of their scale)."""
    want = separate_loss(reference, dict(enumerate(pairs)))
    want.backward()
    got = float(loss.ce_sum) if ce is None else ce
    assert got == pytest.approx(float(want), rel=1e-5)
    scale = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("settings", [BOTH, CHUNKED, TEMPERATURE], ids=["both", "chunked", "temperature"])
def test_a_llama4_pack_past_its_chunk_and_floor_scale_trains_like_each_document_alone(settings):
    reference, model = pair(**settings)
    pairs = documents(LENGTHS)
    loss = packed_loss(model, pack_samples(pairs), "sum")
    loss.loss.backward()
    assert_like_alone(model, reference, pairs, loss)
    # A project's own call of the pack (boundaries on the device only) gives each document its logits alone.
    with torch.no_grad():
        assert_logits_alone(model(**pack_inputs(pack_samples(pairs))).logits[0], reference, pairs)
    # The limits are the model's: past them its logits are not those of full causal attention without them.
    ids = torch.as_tensor(documents([12])[0][0])[None]
    plain, _ = pair()  # the defaults' chunk and floor_scale (8192): neither binds on 12 tokens
    plain.load_state_dict(reference.state_dict())
    assert not torch.allclose(reference(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


def test_a_query_scale_computed_otherwise_than_lit_hbp_reads_it_is_refused_past_floor_scale(monkeypatch):
    """A release whose layers compute the scale otherwise than ``TEMPERATURE_SOURCE`` says: the ratio lit-hbp
    would apply is not known to be right, so a pack past ``floor_scale`` is refused, as before it was built."""
    monkeypatch.setattr(position_limits, "TEMPERATURE_SOURCE", ("a line no release has",))
    reference, model = pair(**TEMPERATURE)
    within = documents([14])
    got = packed_loss(model, pack_samples(within), "sum")
    assert float(got.ce_sum) == pytest.approx(float(separate_loss(reference, dict(enumerate(within)))), rel=1e-5)
    refusal = "a pack of 2 documents reaching row position 4 \\(the config's floor_scale: 4\\)"
    with pytest.raises(ValueError, match=refusal):
        packed_loss(model, pack_samples(documents([2, 3])), "sum")
    with pytest.raises(ValueError, match=refusal):  # a project's own call of the pack, without host boundaries
        model(**pack_inputs(pack_samples(documents([2, 3]))))


def test_a_context_parallel_shard_of_a_document_longer_than_a_chunk_is_refused():
    """CP's shards are cut by the planner's documents, not by chunks: refused there, naming the way out."""
    limits = position_limits.position_limits(AutoConfig.for_model("llama4_text", **LLAMA4, **CHUNKED))
    pack = {"cu_seq_lens_q": torch.tensor([0, 6, 9]), "hbp_cp_shard": object()}
    with pytest.raises(ValueError, match="a document of 6 tokens, longer than the config's attention_chunk_size"):
        position_limits.check_position_limits(limits, pack, (0, 6, 9), 2)
    within = {**pack, "cu_seq_lens_q": torch.tensor([0, 4, 7])}  # no document past a chunk: nothing to give
    assert position_limits.check_position_limits(limits, within, None, 2) == {}


def ulysses_rank(settings: dict, lengths: list[int]) -> tuple[float, dict]:
    """On each of 2 gloo ranks: the pack split by Ulysses at sp 2, its summed CE (all-reduced) and the gradients
    summed over the ranks."""
    import torch.distributed as dist

    from lit_hbp.data.collate import collate_packs
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.ulysses import Ulysses

    ctx = SPGroups([(2, 1)], 2, dist.get_rank())[(2, 1)]
    _, model = pair(**settings)
    docs = documents(lengths)
    whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=2, loss_norm=1.0)
    shard = Ulysses().shard(whole, 2, ctx.rank).replace(sp_group=SPCall.of(ctx, "ulysses"))
    loss = packed_loss(model, shard, weights=1.0)
    loss.loss.backward()
    ce = loss.ce_sum.detach().clone()
    dist.all_reduce(ce)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[name] = g
    return float(ce), grads


@pytest.mark.slow
def test_ulysses_sp_2_trains_a_llama4_pack_past_its_limits_like_each_document_alone(shared_pool2):
    """Each rank holds half the row: its layers number its half from 0 (the query scale's ratio is the shard's),
    and the chunked layers attend over the whole pack's chunks after the all-to-all."""
    results = shared_pool2.run(ulysses_rank, BOTH, LENGTHS)
    reference, model = pair(**BOTH)
    for ce, grads in results:
        for name, p in model.named_parameters():
            p.grad = grads[name]
        assert_like_alone(model, reference, documents(LENGTHS), None, ce)
        reference.zero_grad()


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("lens", [(8, 8), (5, 8), (16,), (3, 4, 1)])
def test_a_collated_pack_counts_its_documents_on_its_token_ids_whatever_its_sp(sp, lens):
    """The document count a packed call's checks read on the token ids (the position limits check every
    document but a padding segment) is the pack's, also on the whole pack of an SP level before its shards
    are cut, padded or not."""
    from lit_hbp.data.batch import DOCS_MARK
    from lit_hbp.data.collate import collate_packs

    tokens = [(np.arange(1, n + 1), np.ones(n, bool)) for n in lens]
    batch = collate_packs([np.arange(len(lens))], lambda i: tokens[i], sp=sp)
    assert batch.input_ids.__dict__[DOCS_MARK] == len(lens)
    if sp > 1:
        shard = batch.replace(input_ids=batch.input_ids[:, : batch.input_ids.shape[1] // sp])
        assert shard.input_ids.__dict__[DOCS_MARK] == len(lens)


def test_a_context_parallel_level_longer_than_a_chunk_is_refused_at_set_up_and_never_searched(monkeypatch):
    """A CP level longer than ``attention_chunk_size`` stopped at its first document past a chunk, after the levels
    before it trained (the packed call's refusal, above), and the level search chose such levels for Llama 4 (65,536
    tokens at 1 x cp 4 on 32 GPUs). Refused at set-up naming the level; a Ulysses level, a CP level within a chunk
    and a model without chunks pass; the search offers such a model no CP layout."""
    from dataclasses import replace

    from lit_hbp.autoselect import search
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.trained_model import refuse_cp_past_chunks
    from lit_hbp.model_spec import ModelSpec
    from lit_hbp.packing import Level

    _, model = pair(**CHUNKED)
    says = r"^data\.levels\[1\] \(pack_len 16, sp 4\): llama4_text's layers attend within chunks of "
    says += r"attention_chunk_size \(4\) .* \(cp 2\) does not cut: give the level cp: 1"
    with pytest.raises(ConfigError, match=says):
        refuse_cp_past_chunks(model, [Level(4), Level(16, 4, ulysses=2, cp=2)])
    refuse_cp_past_chunks(model, [Level(4, 2, ulysses=1, cp=2), Level(16, 4, ulysses=4, cp=1)])
    _, plain = pair(**TEMPERATURE)
    refuse_cp_past_chunks(plain, [Level(4), Level(16, 4, ulysses=2, cp=2)])

    class Tried(Exception):
        pass

    def tried(profiler, candidates, layouts, *rest):
        raise Tried(layouts)

    monkeypatch.setattr(search, "auto_select", tried)
    spec = ModelSpec("llama4-like", 48, 5120, 40, 8, 8192, 202048)
    offered = {}
    for name, s in (("plain", spec), ("chunked", replace(spec, attention_windows=(("chunked", 8192), ("full", 0))))):
        with pytest.raises(Tried) as e:
            search.select_levels(object(), np.array([1000, 70_000]), s, 64)
        offered[name] = e.value.args[0]
    assert any(cp > 1 for _, cp in offered["plain"])
    assert offered["chunked"] == [(sp, 1) for sp, cp in offered["plain"] if cp == 1]
