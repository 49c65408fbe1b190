"""ModelSpec read from configs whose families name the MLP's width their own way: the width the built model's
matrices have, its parameters and matmul FLOPs as the model counts them."""

import warnings

import pytest
import torch
from families import small_config
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp.model_spec import ModelSpec


def built(family: str, **fields):
    config = {**small_config(family), **fields}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "model_type"})
        return config, AutoModelForCausalLM.from_config(hf).float()


def test_ctrls_dff_is_its_mlp_width_in_parameters_and_flops():
    """CTRL names its MLP width ``dff``: the spec's parameters are the model's, and its forward matmul FLOPs those
    FlopCounterMode counts (its layers are not checkpoint layers: the config's formula prices it)."""
    config, net = built("ctrl")
    spec = ModelSpec.from_config(config)
    assert spec.intermediate == config["dff"] != 4 * spec.hidden
    matrices = sum(p.numel() for p in net.parameters() if p.dim() == 2)  # each once: a tied head is the embedding
    embedding = spec.vocab * spec.hidden * (1 if spec.tied_embeddings else 2)
    assert spec.layers * spec.layer_params + embedding == matrices
    tokens = 64
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        net(input_ids=torch.randint(3, 300, (1, tokens)))
    counts = counter.get_flop_counts()["Global"]
    measured = sum(v for k, v in counts.items() if str(k).split(".")[1] in ("mm", "addmm"))  # not attention's bmm
    assert spec.train_flops(tokens, 0, tokens) / 3 == measured


@pytest.mark.parametrize("family, field", [("mpt", "expansion_ratio"), ("xlstm", "ffn_proj_factor")])
def test_a_width_named_by_a_ratio_is_the_built_mlps(family, field):
    """MPT's ``expansion_ratio``, xLSTM's ``ffn_proj_factor`` (rounded up to its multiple): the width of the built
    model's MLP matrices, not four times the hidden size."""
    config, net = built(family)
    spec = ModelSpec.from_config(config)
    widths = {p.shape[0] for n, p in net.named_parameters() if p.dim() == 2 and ("up" in n or "ffn" in n)}
    assert spec.intermediate in widths, (field, spec.intermediate, widths)


def test_an_mlp_width_the_cost_model_does_not_read_is_refused_by_name():
    with pytest.raises(ValueError, match="names its MLP width by dim_ff, which lit-hbp's cost model does not read"):
        ModelSpec.from_config({"model_type": "cpmant", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                               "dim_ff": 96})  # fmt: skip
