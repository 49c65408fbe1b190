"""The output layer as each family's own forward applies it (``lit_hbp.model.head``), the router loss's weight by
the family's own name for it, and the public ``packed_loss``'s keywords: a pack trains on the model's own
logits and loss, or the model is refused by ``prepare_model``."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model, unprepare_model
from lit_hbp.model import head

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
FALCON_H1 = dict(SMALL, hidden_size=64, intermediate_size=96, head_dim=16, mamba_n_heads=8, mamba_d_head=16,
                 mamba_d_state=16, mamba_chunk_size=16, mamba_d_ssm=128, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)  # fmt: skip
JETMOE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, kv_channels=8,
              num_local_experts=4, num_experts_per_tok=2)  # fmt: skip


def pair(model_type: str, **kw):
    """The unprepared model (eager attention) and a prepared copy of it, both in eval mode (no dropout)."""
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(reference.state_dict())
    return reference, prepare_model(model).eval()


def documents(vocab: int, lengths=(9, 3, 6, 12), seed: int = 3):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = np.zeros(n, bool)
        mask[n // 2 :] = True
        out.append((rng.integers(3, vocab, n), mask))
    return out


def assert_trains_like_each_document_alone(reference, model, pairs) -> None:
    """CE sum (1e-5) and every parameter's gradient (1e-4 of its largest) against each document alone."""
    want = 0.0
    for ids, mask in pairs:
        ids = torch.as_tensor(ids)
        labels = torch.where(torch.as_tensor(mask[1:]), ids[1:], -100)
        want = want + F.cross_entropy(reference(input_ids=ids[None]).logits[0, :-1].float(), labels, reduction="sum")
    want.backward()
    got = packed_loss(model, pack_samples(pairs), "sum")
    got.loss.backward()
    assert float(got.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * float(q.grad.abs().max()), msg=name)


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("falcon_h1", dict(FALCON_H1, lm_head_multiplier=0.25)),  # logits * self.model.lm_head_multiplier
        ("hyperclovax", dict(SMALL, logits_scaling=4.0)),  # logits * logits_scaling
        ("granite", dict(SMALL, logits_scaling=4.0)),  # logits / logits_scaling
        ("cohere", dict(SMALL, logit_scale=0.5)),
    ],
)
def test_a_pack_trains_on_the_logits_the_familys_forward_computes(model_type, kw):
    """Falcon-H1's multiplier was left out and HyperCLOVAX's scaling divided by where its forward multiplies."""
    reference, model = pair(model_type, **kw)
    assert_trains_like_each_document_alone(reference, model, documents(kw["vocab_size"]))


def test_a_forward_scaling_its_logits_by_a_field_lit_hbp_does_not_know_is_refused(monkeypatch):
    """The stand-in decoder's probe: with Falcon-H1's multiplier unknown to lit-hbp, prepare_model refuses the
    model instead of training it on logits 4 times the model's; at a multiplier of 1 there is nothing to refuse."""
    monkeypatch.setattr(head, "SCALES", tuple(n for n in head.SCALES if n != "lm_head_multiplier"))
    with pytest.raises(ValueError, match=r"falcon_h1: its forward computes other logits .* largest difference"):
        pair("falcon_h1", **dict(FALCON_H1, lm_head_multiplier=0.25))
    reference, model = pair("falcon_h1", **dict(FALCON_H1, lm_head_multiplier=1.0))
    assert_trains_like_each_document_alone(reference, model, documents(96))


def test_the_router_loss_is_weighted_by_the_familys_own_coefficient():
    """JetMoE names its weight ``aux_loss_coef`` (packed_loss read ``router_aux_loss_coef`` and raised): the
    pack's loss is its CE sum plus that weight times the load-balancing loss the model's own forward computes."""
    _, model = pair("jetmoe", **dict(JETMOE, output_router_logits=True, aux_loss_coef=0.7))
    pack = pack_samples([(ids, np.ones(len(ids), bool)) for ids, _ in documents(96, lengths=(9, 3, 6, 14))])
    assert pack.n_tokens == pack.input_ids.shape[1]  # no padding: the model's own call sees the same tokens
    got = packed_loss(model, pack, "sum")
    own = model(**pack_inputs(pack), output_router_logits=True)
    assert float(own.aux_loss) > 0
    assert float(got.loss) == pytest.approx(float(got.ce_sum) + 0.7 * float(own.aux_loss), rel=1e-6)


def test_dbrx_trains_with_its_router_loss_as_its_own_forward_computes_it():
    """DBRX keeps its expert count and top-k in ``ffn_config`` (its forward reads them off the model, set by its
    ``__init__``): prepare_model refused its router loss, saying its module had no load-balancing loss. The loss and
    every gradient of a pack of one document are the unprepared model's own (``labels=``, eager)."""
    reference, model = pair(
        "dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=96, output_router_logits=True,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2, moe_loss_weight=0.37),
    )  # fmt: skip
    ids = torch.as_tensor(documents(96, lengths=(23,))[0][0])[None]
    own = reference(input_ids=ids, labels=ids, use_cache=False)
    assert 0.37 * float(own.aux_loss) > 0.1  # the router loss is there to be lost
    own.loss.backward()
    got = packed_loss(model, pack_samples([(ids[0].numpy(), np.ones(ids.shape[1], bool))]), "token_mean")
    got.loss.backward()
    assert got.loss.item() == pytest.approx(own.loss.item(), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * float(q.grad.abs().max()), msg=name)


def test_packed_loss_takes_a_normalizer_or_weights_not_both():
    """``weights`` replace the normalizer: one named beside them was dropped without a word."""
    _, model = pair("llama", **SMALL)
    pack = pack_samples(documents(96))
    with pytest.raises(ValueError, match="a normalizer \\(loss='token_mean'\\) or weights, not both"):
        packed_loss(model, pack, "token_mean", weights=1.0)
    assert float(packed_loss(model, pack, weights=1.0).loss) == pytest.approx(
        float(packed_loss(model, pack, "sum").loss)
    )


def test_a_config_returning_tuples_trains_a_pack_as_one_returning_outputs():
    """``return_dict: false`` in a checkpoint's config: the decoder's outputs are read by name all the same."""
    reference, model = pair("llama", **SMALL)
    pairs = documents(96)
    want = float(packed_loss(model, pack_samples(pairs), "sum").ce_sum)
    model.config.return_dict = False
    assert float(packed_loss(model, pack_samples(pairs), "sum").ce_sum) == want


def test_a_batch_of_rows_with_broadcast_restarting_positions_is_a_plain_call_as_unprepared():
    """Positions of shape [1, T] restarting mid-row for a batch of 3 rows: transformers broadcasts them and
    runs a plain batch; the prepared model read them as one row's pack and raised. One row stays a pack."""
    reference, model = pair("llama", **SMALL)
    reference.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 96, (3, 10), generator=torch.Generator().manual_seed(0))
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        want = reference(input_ids=ids, position_ids=restart, use_cache=False).logits
        torch.testing.assert_close(model(input_ids=ids, position_ids=restart, use_cache=False).logits, want)
        embeds = model.get_input_embeddings()(ids)  # as a vision-language model calls its language model
        torch.testing.assert_close(
            model(input_ids=None, inputs_embeds=embeds, position_ids=restart, use_cache=False).logits, want
        )
        one = model(input_ids=ids[:1], position_ids=restart, use_cache=False).logits
        alone = [reference(input_ids=ids[:1, a:b]).logits for a, b in ((0, 4), (4, 7), (7, 10))]
    torch.testing.assert_close(one, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)


def test_the_head_check_runs_without_dropout_and_leaves_each_modules_mode():
    """A LoRA adapter on the output layer with dropout: the check's two sides drew different dropout masks in
    train mode and refused a model that trains exactly. It runs in eval mode now, every module's mode restored."""
    from peft import LoraConfig, get_peft_model

    config = AutoConfig.for_model("llama", **SMALL)
    torch.manual_seed(0)
    net = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["lm_head", "q_proj"]),
    )
    net.train()
    base = net.base_model.model
    base.model.layers[0].eval()  # a mode of a project's own
    before = {name: m.training for name, m in base.named_modules()}
    state = torch.random.get_rng_state()
    head.check_output_head(base, base.model)  # not refused
    assert torch.equal(torch.random.get_rng_state(), state)  # no dropout mask drawn
    assert {name: m.training for name, m in base.named_modules()} == before
    prepare_model(net)


@pytest.mark.parametrize("wrapper", ["torch.compile", "peft LoRA"])
@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("gemma2", dict(SMALL, head_dim=8, final_logit_softcapping=30.0)),
        ("cohere", dict(SMALL, logit_scale=0.0625)),
        ("granite", dict(SMALL, logits_scaling=8.0)),
    ],
)
def test_a_wrapped_model_trains_on_the_logits_its_own_forward_computes(model_type, kw, wrapper):
    """packed_loss read the scale and cap off the model as passed: under ``torch.compile(model)`` or a peft wrapper
    that is the wrapper's forward, which names neither, and Gemma 2's soft cap, Cohere's and Granite's scaling were
    dropped without a word (Gemma 2: a loss of 50.5 for the model's own 28.9). The output layer is scaled up (x40) to
    logits of a trained model's size, where the cap and the scale change the loss."""
    from peft import LoraConfig, get_peft_model

    reference, model = pair(model_type, **kw)
    with torch.no_grad():
        for net in (reference, model):
            net.get_output_embeddings().weight.mul_(40.0)
    if wrapper == "torch.compile":
        torch._dynamo.reset()
        model = torch.compile(model, backend="aot_eager")
    else:  # the same adapters on both (B starts at zero: the model's own function), the reference unprepared
        lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        torch.manual_seed(1)
        reference = get_peft_model(reference, LoraConfig(**lora))
        torch.manual_seed(1)
        model = prepare_model(get_peft_model(unprepare_model(model), LoraConfig(**lora))).eval()
    pairs = documents(kw["vocab_size"])
    with torch.no_grad():  # the cap or scale matters: the output layer alone gives logits far from the model's
        out = reference(input_ids=torch.as_tensor(pairs[0][0])[None], output_hidden_states=True)
        plain = reference.get_output_embeddings()(out.hidden_states[-1])
    assert float((plain - out.logits).abs().max()) > 1.0
    assert_trains_like_each_document_alone(reference, model, pairs)
