"""A mixture of experts' shape, read from a Hugging Face config (pure Python, beside ``model_spec``): how many experts a
token is routed to of how many, their width, the shared experts beside them and the layers that route, under the names
transformers 5.25's families give them. The formula's FLOPs and parameters (``ModelSpec.mlp_params``) and what a layer
keeps for its backward (``ModelSpec.mlp_values``) read the same fields; a model built from the config counts its own
matrices instead (``causal_lm.model_spec``), routed experts at top-k of all with the same expert count and top-k.
Checked against ``FlopCounterMode`` on every MoE family built small (tests/test_moe_flops.py).

A routed expert keeps, per token it is given, its copy of the token's row, its gate and up projections, the
activation, their product and its output (2 h + 4 i); the router keeps the block's input row, its fp32 probabilities
and top-k indices and weights; a shared expert is a gated MLP (saved-tensor hooks on CPU, tests/test_memory_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k", "top_k_experts",
                     "top_k", "num_selected_experts")  # fmt: skip
EXPERT_WIDTH = ("moe_intermediate_size", "expert_ffn_hidden_size")
SHARED_WIDTH = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                "shared_experts_intermediate_size")  # fmt: skip
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")  # of the experts' width each
DENSE_BESIDE_EXPERTS = ("intermediate_size_mlp", "dense_intermediate_size", "prefix_dense_intermediate_size",
                        "mlp_only_intermediate_size", "first_dense_intermediate_size")  # fmt: skip
ONE_SHARED_EXPERT = frozenset({"llama4", "llama4_text", "hunyuan_v1_moe"})  # a shared expert no field counts
UNGATED_EXPERTS = frozenset({"nemotron_h", "ergo"})  # experts of two matrices (up, down)
SHARED_GATE = ("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_omni_moe", "qwen4_exp")  # a gate row, by prefix
SPARSE_KINDS = frozenset({"sparse", "moe", "hash_moe"})  # ``mlp_layer_types``' routed layers
SUB_CONFIG_FIELDS = {"attn_config": ("kv_n_heads",), "ffn_config": ("ffn_hidden_size", "moe_num_experts", "moe_top_k")}
"""DBRX's fields kept in its sub-configs, read as if at the top."""
ROUTING_BYTES_PER_EXPERT = 4  # the router's fp32 probabilities, per expert
ROUTING_BYTES_PER_CHOICE = 40  # per expert a token is sent to: int64 indices (three), fp32 weights (two)


def _first_of(config: dict, names: tuple[str, ...]):
    return next((config[k] for k in names if config.get(k) is not None), None)


def routed_layers(config: dict, layers: int) -> tuple[int, int]:
    """How many of the layers route their tokens to experts, and how many hold a dense MLP, as transformers builds
    them: the ``sparse`` (``moe``) entries of ``mlp_layer_types`` where the config lists them (Nemotron-H's ``moe``
    layer kinds, its ``mlp`` ones the dense: its other layers hold no MLP), else Llama 4's
    ``moe_layers``, Jamba's every ``expert_layer_period``-th from ``expert_layer_offset``, ERNIE's from
    ``moe_layer_start_index`` to ``moe_layer_end_index`` at ``moe_layer_interval``, else all but DeepSeek's first
    ``first_k_dense_replace`` (AFMoE's, LFM2-MoE's ``num_dense_layers``), Qwen-MoE's ``mlp_only_layers`` and those off
    its ``decoder_sparse_step`` (Llama 4's ``interleave_moe_layer_step``). DeepSeek-V2's ``moe_layer_freq`` is not
    read: transformers' layers do not."""
    kinds = config.get("mlp_layer_types")
    blocks = config.get("layers_block_type")
    if not isinstance(kinds, (list, tuple)) and isinstance(blocks, (list, tuple)) and "moe" in blocks:
        return blocks[:layers].count("moe"), blocks[:layers].count("mlp")
    if isinstance(kinds, (list, tuple)):
        routed = sum(str(k).lower() in SPARSE_KINDS for k in kinds[:layers])
    elif isinstance(config.get("moe_layers"), (list, tuple)):
        routed = sum(0 <= i < layers for i in config["moe_layers"])
    elif isinstance(config.get("expert_layer_period"), int):
        offset = int(config.get("expert_layer_offset") or 0)
        routed = sum(i % config["expert_layer_period"] == offset for i in range(layers))
    elif isinstance(config.get("moe_layer_start_index"), int):
        end = config.get("moe_layer_end_index")
        end = layers - 1 if end is None or end == -1 else int(end)
        every = int(config.get("moe_layer_interval") or 1)
        routed = sum(config["moe_layer_start_index"] <= i <= end and (i + 1) % every == 0 for i in range(layers))
    else:
        first = int(config.get("first_k_dense_replace") or config.get("num_dense_layers") or 0)
        dense = set(config.get("mlp_only_layers") or ())
        step = int(config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step") or 1)
        routed = sum(i >= first and i not in dense and (i + 1) % step == 0 for i in range(layers))
    return routed, layers - routed


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' MLP as its config describes it (``experts_of``): ``experts`` routed experts of
    ``width`` (``matrices`` each: 3 gated, 2 up and down), ``top_k`` of them a token, shared experts of ``shared``
    width in all beside them (Qwen-MoE's behind a sigmoid gate of one row: ``shared_gate``), in ``routed`` of the
    ``layers``; ``dense_layers`` of them a dense MLP of ``dense`` width. ``other_widths``: further sets of as many
    experts, each behind a router of its own, that a text token does not pass (ERNIE 4.5-VL's vision experts, which
    its image tokens take instead): held, not run."""

    experts: int
    top_k: int
    width: int
    shared: int
    dense: int
    routed: int
    layers: int
    dense_layers: int = 0
    matrices: int = 3
    shared_gate: bool = False
    other_widths: tuple[int, ...] = ()

    def mlp_params(self, hidden: int, dense_matrices: int = 3) -> tuple[float, float]:
        """(matmul parameters a token passes through, parameters held) of a layer's MLP, averaged over the layers:
        a routed layer's router (hidden x experts), shared experts and top-k of its experts (all of them held); a
        dense layer's MLP."""
        expert = self.matrices * hidden * self.width
        beside = hidden * self.experts + self.matrices * hidden * self.shared + hidden * self.shared_gate
        dense = self.dense_layers * dense_matrices * hidden * self.dense
        active = self.routed * (beside + self.top_k * expert) + dense
        others = sum(hidden * self.experts * (1 + self.matrices * w) for w in self.other_widths)
        return active / self.layers, (self.routed * (beside + self.experts * expert + others) + dense) / self.layers

    def saved(self, hidden: int) -> tuple[float, float]:
        """(values in the model's dtype, bytes) per token one layer's MLP keeps for its backward, averaged over the
        layers: a routed layer's router (its input row, ``ROUTING_BYTES_*``), top-k experts of ``2 h + 4 i`` values
        each and its shared experts (a gated MLP's ``4 i``, the gate's row); a dense layer's gated MLP."""
        values = hidden + self.top_k * (2 * hidden + 4 * self.width) + 4 * self.shared + self.shared_gate
        routing = ROUTING_BYTES_PER_EXPERT * self.experts + ROUTING_BYTES_PER_CHOICE * self.top_k
        dense = self.dense_layers * 4 * self.dense
        return (self.routed * values + dense) / self.layers, self.routed * routing / self.layers


def experts_of(config: dict, dense: int, layers: int) -> Experts | None:
    """A config's mixture of experts, None for a dense model (fewer than two experts, no experts per token, no
    routed layer, Doge's ``is_moe`` false): its experts' width (``EXPERT_WIDTH``, else the MLP's ``dense``), shared
    experts' (a width ``SHARED_WIDTH`` names, else ``SHARED_EXPERTS`` of the experts' width; Llama 4's and Hunyuan's
    one), the dense layers' (``DENSE_BESIDE_EXPERTS``, else ``dense``) and its routed layers (``routed_layers``)."""
    experts, top_k = _first_of(config, EXPERT_COUNT), _first_of(config, EXPERTS_PER_TOKEN)
    routed, dense_layers = routed_layers(config, layers)
    if not isinstance(experts, int) or experts < 2 or not isinstance(top_k, int) or not routed:
        return None
    if config.get("is_moe") is False:
        return None
    width = _first_of(config, EXPERT_WIDTH) or dense
    width, *others = width if isinstance(width, (list, tuple)) else [width]  # ERNIE 4.5-VL's: text experts', vision's
    shared = _first_of(config, SHARED_WIDTH) or width * int(_first_of(config, SHARED_EXPERTS) or 0)
    family = config.get("model_type")
    shared += width if family in ONE_SHARED_EXPERT else 0
    return Experts(
        experts=experts,
        top_k=min(top_k, experts),
        width=int(width),
        shared=int(shared),
        dense=int(_first_of(config, DENSE_BESIDE_EXPERTS) or dense),
        routed=routed,
        layers=layers,
        dense_layers=dense_layers,
        matrices=2 if family in UNGATED_EXPERTS else 3,
        shared_gate=bool(config.get("shared_expert_intermediate_size")) and str(family).startswith(SHARED_GATE),
        other_widths=tuple(int(w) for w in others),
    )
