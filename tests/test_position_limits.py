"""Llama 4's text layers take positions from the call (a chunked mask, queries scaled by row position): a pack
whose documents stay within those limits trains like each document alone, one past them is refused in the
packed call (``lit_hbp.model.position_limits``), whichever way it is called."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model

LLAMA4 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
              no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
CHUNKED = dict(attention_chunk_size=4, attn_temperature_tuning=False)  # layer 0 chunked (RoPE), layer 1 full
TEMPERATURE = dict(attention_chunk_size=None, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5)


def pair(**kw):
    config = AutoConfig.for_model("llama4_text", **LLAMA4, **kw)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(reference.state_dict())
    return reference, prepare_model(model).eval()


def documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 96, n), np.ones(n, bool)) for n in lengths]


def alone_ce(reference, pairs) -> float:
    total = 0.0
    for ids, _ in pairs:
        ids = torch.as_tensor(ids)[None]
        total += float(F.cross_entropy(reference(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum"))
    return total


@pytest.mark.parametrize(
    "settings, within, past, refusal",
    [
        (CHUNKED, [4, 3, 4, 2], [4, 12], "a document of 12 tokens, longer than the config's attention_chunk_size"),
        (TEMPERATURE, [14], [2, 3], "a pack of 2 documents reaching row position 4 \\(the config's floor_scale: 4\\)"),
    ],
    ids=["chunked_attention", "temperature_tuning"],
)
def test_a_llama4_pack_within_its_limits_trains_like_each_document_alone_and_one_past_them_is_refused(
    settings, within, past, refusal
):
    reference, model = pair(**settings)
    pairs = documents(within)
    got = packed_loss(model, pack_samples(pairs), "sum")
    assert float(got.ce_sum) == pytest.approx(alone_ce(reference, pairs), rel=1e-5)
    over = pack_samples(documents(past))
    with pytest.raises(ValueError, match=refusal):
        packed_loss(model, over, "sum")
    with pytest.raises(ValueError, match=refusal):  # a project's own call of the pack, without host boundaries
        model(**pack_inputs(over))
    # The limits are the model's: past them its logits are not those of full causal attention without them.
    ids = torch.as_tensor(documents([12])[0][0])[None]
    plain, _ = pair()  # the defaults' chunk and floor_scale (8192): neither binds on 12 tokens
    plain.load_state_dict(reference.state_dict())
    assert not torch.allclose(reference(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)
