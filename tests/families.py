"""Every causal-LM family transformers ships, built small: the matrix of the family tests.

The families come from transformers' own causal-LM mapping, so a new release's families are tested
without anyone listing them. Each gets one generic small shape (the fields its config has) plus a
few overrides where the generic shape is invalid for it or would leave a feature untested.
"""

from __future__ import annotations

import warnings

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=1024,
    head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    sliding_window=24,  # shorter than the test documents: windows matter
    n_positions=1024,
    n_ctx=1024,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_inner=96,
    ffn_dim=96,
    dff=96,  # CTRL's: its default 8,192 ReLU units put one within 1e-9 of its kink, where rounding picks a side
    word_embed_proj_dim=64,
    rotary_dim=8,
    partial_rotary_factor=0.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MLA = dict(num_key_value_heads=4, head_dim=8)  # multi-head latent attention: rotary dim = qk_rope_head_dim
OVERRIDES = {
    "granite": dict(logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    "gemma2": dict(final_logit_softcapping=2.0, attn_logit_softcapping=1.5),
    **{f: MLA for f in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "minicpm3", "youtu", "axk1", "axk2")},
    **{f: MLA for f in ("glm4_moe_lite", "glm_moe_dsa", "deepseek_v4", "sarvam_mla")},
}
# Hybrids built with the stateful mixer they are known for, beside an attention layer where the family has
# one (the generic shape gives LFM2 two attention layers and Qwen3-Next two Gated DeltaNet layers, and leaves
# Mamba2, Zamba, Zamba2 and ZAYA unbuildable).
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)  # 8 x 16 = 2 x 64
GATED_DELTA = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4)
BESIDE_ATTENTION = dict(layer_types=["linear_attention", "full_attention"])  # the mixer, then an attention layer
HYBRIDS = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8, n_groups=1, state_size=16, chunk_size=16),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=16, chunk_size=16),
    "zaya": dict(num_experts_per_tok=1),
    # the defaults' state widths and scan chunks (128-256) are slow on a CPU: small ones, a chunk shorter
    # than the test documents (a scan's chunk boundaries fall inside them)
    "bamba": dict(MAMBA2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(MAMBA2, **BESIDE_ATTENTION),
    "falcon_h1": dict(MAMBA2, mamba_d_ssm=128, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9]),  # distinct muP rows
    "nemotron_h": dict(ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, chunk_size=16),
    "kimi_linear": dict(  # its full attention is MLA
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}, **BESIDE_ATTENTION, **MLA
    ),
    **{f: dict(GATED_DELTA, **BESIDE_ATTENTION) for f in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "qwen4_exp_text": GATED_DELTA,  # its indexed attention needs settings its default config leaves unset
}
OVERRIDES.update(HYBRIDS)
OVERRIDES.update(
    # its sparse-attention indexer sits on the layers layer_types calls indexed (every fifth by default): one here
    kolibri1_1=dict(
        layer_types=["sliding_attention", "indexed_attention"],
        index_layers=[1],
        index_num_heads=2,
        index_topk=8,
        index_pool_size=64,
        index_compression=4,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=96,  # a dense first layer of its own width (3,584 by default), then experts
    ),
    # its dense and shared MLPs' widths have fields of their own (32,768 and 8,192 by default); a full-attention
    # layer every second one (the default: every fourth)
    ergo=dict(first_dense_intermediate_size=96, shared_intermediate_size=48, global_attention_every_n_layers=2),
    longcat_flash=dict(MLA, num_layers=2),  # its layer count's own field (28 by default)
)
BLT_PART = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=1)
OVERRIDES["blt"] = dict(  # its sub-models keep their own (billion-parameter) sizes unless given
    encoder_hash_byte_group_vocab=97,
    local_attention_window_len=None,
    patcher_config=BLT_PART,
    global_config=BLT_PART,
    encoder_config=dict(BLT_PART, hidden_size_global=32),
    decoder_config=dict(BLT_PART, hidden_size_global=32),
)
MAX_PARAMS = 5_000_000  # larger after shrinking: a multimodal wrapper whose sub-models keep their size
# The families of the issue that asked for this matrix; the table of docs/families.md is checked against them.
NAMED = (
    "llama qwen2 mistral qwen3 gemma gemma3_text phi3 phi gpt_neox starcoder2 olmo2 mixtral deepseek_v3 opt "
    "granite cohere gpt_oss stablelm gemma2 falcon gptj gpt2 bloom"
).split()


def all_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def small_config(family: str) -> dict:
    """The family's config mapping (model_type included) with the small shape; raises when the
    family's config cannot take it."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoConfig.for_model(family)
        fields = base.to_dict()
        alias = getattr(base, "attribute_map", {})
        kw = {}
        for k, v in {**SMALL, **OVERRIDES.get(family, {})}.items():
            if k in fields or k in OVERRIDES.get(family, {}):
                kw[k] = v
            elif alias.get(k) in fields:
                kw[alias[k]] = v
        config = AutoConfig.for_model(family, **kw).to_dict()
    config["model_type"] = family
    return config


def too_large(config: dict) -> int | None:
    """Parameter count when the small config still builds a model over MAX_PARAMS, else None."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    family = cfg.pop("model_type")
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg))
    n = sum(p.numel() for p in net.parameters())
    return n if n > MAX_PARAMS else None
