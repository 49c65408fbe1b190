"""Forward FLOPs per token of every mixture-of-experts family transformers 5.25 ships, built small, against torch's
``FlopCounterMode`` on a real forward: lit-hbp's model FLOPs count the matmul weights a token passes through (the
router, top-k routed experts, shared experts, a dense layer's MLP), causal attention as half the score matrix, the LM
head on every position here. Both of lit-hbp's counts are checked: the formula read from the config alone
(``ModelSpec.from_config``: the planner's tools on a config that cannot be built here) and the one counted on the built
model's matrices (``causal_lm.model_spec``: MFU and the level search).

The reference is what torch counts, less half of what the family's eager attention function counts (it computes the
whole score matrix), less a sparse-attention indexer's own scores (lit-hbp prices full causal attention there, a
finding left open), with experts run densely (Llama 4's: every token through every expert, the unchosen weighted 0)
taken at top-k of all. Hybrids are built with attention layers only: their mixers are checked in
tests/test_mixer_costs.py; the routing is what is checked here. Equal to the last FLOP, but within 2% where a family's
attention holds what neither count follows (``WITHIN_2_PERCENT``) and for the formula's families in ``FORMULA_OFF``,
not compared.
"""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
from families import MLA, small_config
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp.model.build import checkpoint_layers, decoder_of
from lit_hbp.model.causal_lm import model_spec
from lit_hbp.model_spec import ModelSpec

TOKENS = 16  # below every window of the small shape: each layer attends to the whole prefix
ATTENTION_ONLY = dict(layer_types=["full_attention", "full_attention"])
OVERRIDES = {
    "dbrx": dict(  # its attention's and experts' fields live in sub-configs
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=320,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2),
    ),
    "llama4_text": dict(intermediate_size_mlp=128, moe_layers=[1]),  # a dense first layer of its own width
    "deepseek_v2": dict(moe_layer_freq=2),  # transformers' layers do not read it: every layer past the first routes
    "qwen2_moe": dict(mlp_only_layers=[0]),
    "qwen3_moe": dict(num_hidden_layers=3, decoder_sparse_step=2),  # the second layer routes, the others are dense
    "ernie4_5_moe": dict(num_hidden_layers=3, moe_layer_start_index=1, moe_layer_end_index=1),
    "jamba": dict(attn_layer_period=1, attn_layer_offset=0),  # expert_layer_period 2, offset 1: the second layer
    "beam": dict(mlp_layer_types=["dense", "sparse"]),
    "flint": dict(mlp_only_layers=[0]),
    "granitemoehybrid": dict(ATTENTION_ONLY, layers_block_type=["full_attention", "full_attention"]),
    "nemotron_h": dict(layers_block_type=["full_attention", "moe"], moe_shared_expert_intermediate_size=48),
    **{f: ATTENTION_ONLY for f in ("minimax", "lfm2_moe", "qwen3_next", "qwen3_5_moe_text", "lara_mini")},
    **{f: dict(ATTENTION_ONLY, **MLA) for f in ("kimi_linear", "bailing_hybrid")},  # their attention is MLA
    "hunyuan_v1_moe": dict(moe_topk=2),
    "aria_text": dict(moe_num_experts=4),
    "zaya": dict(router_hidden_size=16),  # top-1 only
}  # fmt: skip
FAMILIES = sorted(
    """afmoe aria_text axk1 axk2 bailing_hybrid beam cohere2_moe dbrx deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4
    dots1 ergo ernie4_5_moe exaone_moe flex_olmo flint glm4_moe glm4_moe_lite glm_moe_dsa gpt_oss granitemoe
    granitemoe_swa granitemoehybrid granitemoeshared hunyuan_v1_moe hy_v3 hy_v4 jamba jetmoe kimi_linear kolibri1
    kolibri1_1 laguna lara_mini lfm2_moe llama4_text mellum mimo_v2_flash minicpm5_moe minimax minimax_m2
    minimax_m3_vl_text mixtral nemotron_h olmoe param2moe phimoe qwen2_moe qwen3_5_moe_text qwen3_moe qwen3_next
    sarvam_mla sarvam_moe solar_open zaya""".split()
)
NOT_COMPARED = {  # families whose config names experts, not compared here
    "dots3_note": "a multimodal wrapper keeping its 280B language model at the small shape",
    "dots3_note_text": "its config refuses the small shape (num_key_value_heads must match num_attention_heads)",
    "gemma4": "a multimodal wrapper", "gemma4_text": "135M parameters at the small shape (experts off by default)",
    "inkling2_text": "15M parameters at the small shape", "inkling2_loop_text": "14M parameters at the small shape",
    "llama4": "a multimodal wrapper (llama4_text is its language model)",
    "qwen3_5_moe": "a multimodal wrapper (qwen3_5_moe_text)", "qwen4_exp": "a multimodal wrapper (qwen4_exp_text)",
    "longcat_flash": "zero-computation experts: the work a token gets depends on its routing",
    "doge": "experts of one neuron looked up by product keys (is_moe), not matrices",
    "inkling_text": "attention of its own (relative position logits, short convolutions of its keys and values)",
    "qwen4_exp_text": "a hyper-connection mixer outside the decoder layers, which lit-hbp's FLOPs leave out",
}  # fmt: skip
FORMULA_OFF = {  # what the config's formula does not price (the built model's count does)
    "axk2": "its input norms' MLPs", "deepseek_v4": "hyper-connections, a compressor", "hy_v4": "hyper-connections",
    "deepseek_v32": "the indexer's projections",
    "glm_moe_dsa": "the indexer's projections", "nemotron_h": "layers holding attention or an MLP, not both",
    "zaya": "a router of its own MLP", "afmoe": "its attention's output gate", "beam": "its attention's output gate",
    "qwen3_next": "its attention's output gate", "qwen3_5_moe_text": "its attention's output gate",
    "minicpm5_moe": "its attention's output gate (q_gate_proj)",
    "mimo_v2_flash": "sliding layers of their own key-value heads",
}  # fmt: skip
WITHIN_2_PERCENT = {  # below 0.7%, all of it outside the experts
    "jetmoe": "its attention's own experts (the formula: dense q, k, v and o)",
    "zaya": "its attention's convolution and delayed values, a step longer than the tokens",
    "deepseek_v4": "its hyper-connections' mixing", "hy_v4": "its hyper-connections' mixing",
    "laguna": "its attention's per-head gate (the formula)",
    "bailing_hybrid": "its attention's per-head gate (the formula)",
}  # fmt: skip
DENSE_EXPERTS = {"llama4_text": "Llama4TextExperts"}  # run every token through every expert
SELECTION = re.compile(r"Indexer$|Compressor$")  # sparse attention's key selection: not in lit-hbp's FLOPs


def config_of(family: str) -> dict:
    if family == "dbrx":
        return {"model_type": "dbrx", **OVERRIDES["dbrx"]}
    return {**small_config(family), **OVERRIDES.get(family, {})}


def built(config: dict) -> torch.nn.Module:
    cfg = dict(config)
    family = cfg.pop("model_type")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg), attn_implementation="eager")
    if getattr(net.config, "_experts_implementation", None):
        net.set_experts_implementation("eager")  # the family's own loop over the chosen experts
    return net.eval()


def measured(net: torch.nn.Module, monkeypatch) -> float:
    """Forward FLOPs per token as lit-hbp defines them, from torch's counter on the model's forward."""
    counter = FlopCounterMode(display=False)
    attention = [0]
    module = sys.modules[type(net).__module__]
    eager = getattr(module, "eager_attention_forward", None)
    if eager is not None:

        def counted(*args, **kwargs):
            before = counter.get_total_flops()
            out = eager(*args, **kwargs)
            attention[0] += counter.get_total_flops() - before
            return out

        monkeypatch.setattr(module, "eager_attention_forward", counted)
    with counter:  # grad on: DBRX's expert slices are views of parameters
        net(input_ids=torch.arange(3, 3 + TOKENS)[None], use_cache=False)
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    root = type(net).__name__
    off = attention[0] / 2  # causal: half the score matrix the eager function computes
    for name, m in net.named_modules():
        flops = per_module.get(f"{root}.{name}", 0)
        if SELECTION.search(type(m).__name__):  # its own projections stay counted
            linear = (f"{root}.{name}.{n}" for n, s in m.named_modules() if isinstance(s, torch.nn.Linear))
            off += flops - sum(per_module.get(k, 0) for k in linear)
        if type(m).__name__ == DENSE_EXPERTS.get(net.config.model_type):
            off += flops * (1 - net.config.num_experts_per_tok / m.num_experts)
    return (counter.get_total_flops() - off) / TOKENS


def forward_per_token(spec: ModelSpec) -> float:
    return spec.train_flops(TOKENS, TOKENS**2, TOKENS) / 3 / TOKENS


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_forward_flops_are_torchs_count(family, monkeypatch):
    config = config_of(family)
    net = built(config)
    reference = measured(net, monkeypatch)
    within = 0.02 if family in WITHIN_2_PERCENT else 1e-9
    counted = model_spec(net, checkpoint_layers(decoder_of(net)), mixers=[])
    assert forward_per_token(counted) == pytest.approx(reference, rel=within), "the built model's count"
    if family not in FORMULA_OFF:
        formula = ModelSpec.from_config(config)
        assert forward_per_token(formula) == pytest.approx(reference, rel=within), "the config's formula"


def test_every_family_naming_experts_is_compared_or_says_why():
    """transformers' causal-LM families whose default config names an expert count (DBRX's in ``ffn_config``): each
    is compared above or named, with why, in ``NOT_COMPARED``: a new release's families are not left out unseen."""
    from families import all_families

    from lit_hbp.moe_spec import EXPERT_COUNT

    named = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in all_families():
            try:
                config = AutoConfig.for_model(family).to_dict()
            except Exception:  # noqa: BLE001 - a config that cannot be made with its defaults names nothing here
                continue
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
            if any(k in c for c in (config, text, config.get("ffn_config") or {}) for k in EXPERT_COUNT):
                named.add(family)
    assert named - set(FAMILIES) - set(NOT_COMPARED) == set()
    assert set(NOT_COMPARED) <= named


@pytest.mark.parametrize(
    "config, published",
    [
        (dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
              vocab_size=32000), (46.7e9, 12.9e9)),
        (dict(model_type="dbrx", d_model=6144, n_layers=40, n_heads=48, vocab_size=100352,
              attn_config=dict(kv_n_heads=8), ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4)),
         (132e9, 36e9)),
        (dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
              num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
              num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280), (671e9, 37e9)),
    ],
    ids=["mixtral-8x7b", "dbrx", "deepseek-v3"],
)  # fmt: skip
def test_the_formula_gives_published_total_and_active_parameters(config, published):
    """The config's formula at the published sizes (config.json on the hub): total parameters and those a token passes
    through (the model cards' "active": its layers' and the LM head's; DeepSeek-V3's 671B without its MTP module)."""
    spec = ModelSpec.from_config(config)
    active = spec.layers * spec.layer_params + spec.hidden * spec.vocab
    assert (spec.params, active) == pytest.approx(published, rel=0.03)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_the_cost_models_attention_time_and_sp_bytes_are_at_the_heads_own_widths(family):
    """Multi-head latent attention's query-key heads are 192 wide in DeepSeek-V3 and its values 128, while its config's
    ``head_dim`` is the rotary part (64): the time model priced attention and the Ulysses and CP bytes at ``head_dim``
    (2.5x low for DeepSeek-V3), MFU at the real widths. Attention's forward against ``FlopCounterMode`` on the eager
    model (it computes the whole score matrix: causal is half), bytes against the config's own widths."""
    from lit_hbp.cost.costmodel import CostModel
    from lit_hbp.cost.hardware import HARDWARE
    from lit_hbp.model.causal_lm import configured_spec
    from lit_hbp.parallel.context_parallel import ContextParallel
    from lit_hbp.parallel.ulysses import Ulysses

    config, tokens = small_config(family), 16
    fields = {k: v for k, v in config.items() if k != "model_type"}
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), attn_implementation="eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net.eval()(input_ids=torch.arange(3, 3 + tokens)[None], use_cache=False)
    scores = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" in str(op)) / 2
    spec, hw = configured_spec(config), HARDWARE["h100"]
    priced = CostModel(spec, hw, 1).attention_forward_seconds(tokens * tokens, 1) * hw.peak_flops * hw.eff_attn
    assert priced * spec.attending == pytest.approx(scores, rel=1e-9)

    hf = net.config
    qk = getattr(hf, "qk_nope_head_dim", 0) + getattr(hf, "qk_rope_head_dim", 0) or hf.head_dim
    v = getattr(hf, "v_head_dim", None) or hf.head_dim
    heads, kv, sp, n = hf.num_attention_heads, hf.num_key_value_heads, 2, 1000.0
    q_k_v_o = 2 * n * (heads * qk + max(kv, sp) * qk + max(kv, sp) * v + heads * v)  # bf16
    assert Ulysses().comm_bytes_per_layer(spec, n, sp) == pytest.approx(q_k_v_o * (sp - 1) / sp)
    assert ContextParallel().comm_breakdown(spec, n, 4, 2)["cp"] == pytest.approx(2 * n * kv * (qk + v))


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_a_token_pairs_attention_work_is_the_heads_own(family):
    """The planner weighs a vision tower's work in units of one token pair's attention through every layer
    (``ModelSpec.pair_flops``): it was twice the hidden size, while Gemma 3's heads (and Gemma-3-27B's: 0.76x) are
    wider, so images weighed less than they cost. Against ``FlopCounterMode`` on the eager model: it computes the
    whole score matrix of a document of T tokens, twice its T * T / 2 causal pairs' work, priced at T * T."""
    from lit_hbp.model.causal_lm import configured_spec

    config, tokens = {**small_config(family), "head_dim": 24}, 16
    config.pop("sliding_window", None)
    config.pop("layer_types", None)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), attn_implementation="eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net.eval()(input_ids=torch.arange(3, 3 + tokens)[None], use_cache=False)
    scores = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))
    spec = configured_spec(config)
    assert spec.heads * spec.dim != spec.hidden  # the case: heads wider than the hidden size
    assert spec.pair_flops * tokens * tokens == pytest.approx(scores / 2, rel=1e-9)
