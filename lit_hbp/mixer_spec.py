"""Which layers of a Hugging Face config attend and which hold a stateful token mixer (a hybrid's Mamba, gated delta
rule, short convolution, lightning attention), and a mixer's heads and matmul parameters, read from the fields each
family names them by (pure Python, beside ``model_spec`` and ``moe_spec``). ``ModelSpec`` prices a hybrid's layers from
these: its attending layers quadratic in a document's length, its mixers linear; a Ulysses level splits the mixers by
the heads (or channels) named here (``lit_hbp.model.mixer_heads``).
"""

from __future__ import annotations

import math
import re

LAYER_COUNT = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # what families call each field, first wins
HIDDEN_WIDTH = ("hidden_size", "n_embd", "d_model", "dim")


def _first_of(config: dict, names: tuple[str, ...]):
    return next((config[k] for k in names if config.get(k) is not None), None)


# The per-layer lists hybrids name their layers' kinds by (Qwen3-Next's ``layer_types``, Nemotron-H's and
# Zamba's ``layers_block_type``, RecurrentGemma's ``block_types``); Jamba's every ``attn_layer_period``-th layer
# from ``attn_layer_offset``. A layer attends unless its kind is linear attention, a scan, a recurrence, a
# convolution or a block without a token mixer (Nemotron-H's ``mlp`` and ``moe`` layers).
LAYER_KINDS = ("layer_types", "layers_block_type", "block_types")
NOT_ATTENTION = re.compile(r"linear|mamba|ssm|recurrent|conv|rwkv|lstm|^m$|^mlp$|^moe$|^-$")
STATE_SIZES = ("state_size", "ssm_state_size", "d_state", "mamba_d_state")
ATTENTION_HEADS = ("num_attention_heads", "n_head", "n_heads")
NO_ATTENTION_FAMILIES = frozenset({"xlstm"})  # every layer a recurrent block; its config names no layer kind


def layer_kinds(config: dict) -> list[str] | None:
    """Each layer's kind, where the config lists them (a shorter list repeats: RecurrentGemma's
    ``block_types``), or None."""
    for key in LAYER_KINDS:
        kinds = config.get(key)
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            layers = int(_first_of(config, LAYER_COUNT) or len(kinds))
            return [kinds[i % len(kinds)] for i in range(layers)]
    return None


def attention_layers(config: dict) -> int | None:
    """How many of a config's layers attend over their tokens (their work grows with the square of a
    document's length; a hybrid's other layers carry a state, linear in it), from the lists or period its
    family names them by; None when the config says nothing (every layer attends), 0 for a state-space
    model (a state size and no attention heads)."""
    kinds = layer_kinds(config)
    if kinds is not None:
        return sum(not NOT_ATTENTION.search(k.lower()) for k in kinds)
    indices = config.get("attn_layer_indices", config.get("full_attn_idxs"))
    if isinstance(indices, (list, tuple)):
        return len(indices)
    if "attn_layer_indices" in config and indices is None:
        return 0  # Bamba's: attention only at the layers listed, none listed
    if config.get("model_type") in NO_ATTENTION_FAMILIES:
        return 0
    period, offset = config.get("attn_layer_period"), config.get("attn_layer_offset")
    layers = _first_of(config, LAYER_COUNT)
    if isinstance(period, int) and isinstance(offset, int) and period > 0 and layers:
        return sum(i % period == offset for i in range(int(layers)))
    if not any(config.get(k) for k in ATTENTION_HEADS) and any(config.get(k) for k in STATE_SIZES):
        return 0  # Mamba's, Mamba2's (whose num_heads are its scan's)
    return None


BLOCK_ONLY = re.compile(r"^mlp$|^moe$|^-$")  # a layer kind without a token mixer (Nemotron-H's)
MIXER_HEADS = {  # a family's fields its stateful mixers split by on a Ulysses level (mixer_heads.HEAD_SPLITS): the
    # groups, else (one group) the heads (a bias on their projections splits too: the output projection's is added by
    # the first share, mixer_heads._first_share)
    "qwen3_next": ("linear_num_key_heads",),
    "qwen3_5_text": ("linear_num_key_heads",),
    "qwen3_5_moe_text": ("linear_num_key_heads",),
    "olmo_hybrid": ("linear_num_key_heads",),
    "kimi_linear": ("linear_num_heads",),
    "bailing_hybrid": ("linear_num_heads",),
    "minimax": ("num_attention_heads",),
    "recurrent_gemma": ("num_attention_heads",),
    "xlstm": ("num_heads",),
    "nemotron_h": ("n_groups", "mamba_num_heads"),
    "bamba": ("mamba_n_groups", "mamba_n_heads"),
    "granitemoehybrid": ("mamba_n_groups", "mamba_n_heads"),
    "zamba2": ("mamba_ngroups", "n_mamba_heads"),
    "mamba2": ("n_groups", "num_heads"),
    "falcon_h1": ("mamba_n_groups", "mamba_n_heads"),
}
MIXER_CHANNELS = {  # a family whose mixers split by channels (a Mamba1 scan, a short convolution): the fields whose
    # product is the channels
    "mamba": ("intermediate_size",),
    "falcon_mamba": ("intermediate_size",),
    "jamba": ("mamba_expand", "hidden_size"),
    "lfm2": ("hidden_size",),
    "lfm2_moe": ("hidden_size",),
    "lfm3": ("hidden_size",),
}


BOTH = re.compile(r"^hybrid$")  # a layer kind holding a mixer beside attention (Zamba's)
MIXER_BESIDE_ATTENTION = frozenset({"falcon_h1"})  # every layer a scan beside attention; no layer kinds listed


def mixer_layers(config: dict) -> int:
    """How many of a config's layers hold a stateful token mixer (a hybrid's Mamba, gated delta rule, short
    convolution): the layers that neither attend nor are a block without a mixer, and those that hold one
    beside attention."""
    kinds = layer_kinds(config)
    if kinds is not None:
        kinds = [k.lower() for k in kinds]
        return sum(bool(NOT_ATTENTION.search(k)) and not BLOCK_ONLY.search(k) or bool(BOTH.search(k)) for k in kinds)
    if config.get("model_type") in MIXER_BESIDE_ATTENTION:
        return int(_first_of(config, LAYER_COUNT))
    attending = attention_layers(config)
    layers = _first_of(config, LAYER_COUNT)
    return 0 if attending is None or layers is None else int(layers) - attending


def mixer_heads(config: dict) -> int | None:
    """The heads a hybrid's mixers split by on a Ulysses level (the SP degree must divide them), from the
    family's config (``MIXER_HEADS``; channels: ``MIXER_CHANNELS``), or None: they do not split (the ranks share
    the documents)."""
    counts = [config.get(f) for f in MIXER_CHANNELS.get(config.get("model_type"), ())]
    if counts and None not in counts:
        return int(math.prod(counts))
    counts = [config.get(f) for f in MIXER_HEADS.get(config.get("model_type"), ())]
    if not counts or None in counts:
        return None
    return int(counts[0] if counts[0] > 1 or len(counts) == 1 else counts[1])


def mixer_spanning(config: dict) -> int:
    """Values a token that a hybrid's mixers, split by heads, sum over the SP group in each pass, from the family's
    config (``ModelSpec.mixer_spanning``): a Mamba1 scan's ``x_proj`` output (its step's rank and B and C), the
    sum of squares of a norm over every head (one group: a Mamba2's gated norm, Falcon-H1's when it has one,
    MiniMax's); 0 for the others or where the fields are missing."""
    family = config.get("model_type")
    rank, state = {"mamba": ("time_step_rank", "state_size"), "falcon_mamba": ("time_step_rank", "state_size"),
                   "jamba": ("mamba_dt_rank", "mamba_d_state")}.get(family, (None, None))  # fmt: skip
    if rank is not None:
        values = [config.get(rank), config.get(state)]
        return 0 if None in values else int(values[0]) + 2 * int(values[1])
    if family == "minimax":
        return 1
    if family in MAMBA2_FAMILIES and (family != "falcon_h1" or config.get("mamba_rms_norm")):
        groups = next((config[f] for f in MAMBA2_ALIASES["groups"] if config.get(f) is not None), None)
        return int(groups == 1)
    return 0


MAMBA2_FAMILIES = frozenset({"mamba2", "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1"})
MAMBA2_ALIASES = {  # a Mamba2 mixer's fields, as each family names them, first match wins
    "heads": ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads"),
    "head_dim": ("mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim"),
    "groups": ("mamba_n_groups", "mamba_ngroups", "n_groups"),
    "state": ("mamba_d_state", "ssm_state_size", "state_size"),
    "kernel": ("mamba_d_conv", "conv_kernel"),
}
GATED_DELTA_FAMILIES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
GATED_DELTA_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def mixer_params(config: dict) -> float | None:
    """Matmul parameters of one of a hybrid's stateful mixers, from its family's config: a Mamba2 mixer's input
    projection (gate, x, B and C per group, a step per head), depthwise convolution and output projection; a
    gated delta rule's (q, k, v, z, b, a projections, convolution over q, k and v, output projection); None
    for other families (priced as an attention block's)."""
    family, hidden = config.get("model_type"), _first_of(config, HIDDEN_WIDTH)
    if family in MAMBA2_FAMILIES:
        f = {k: _first_of(config, MAMBA2_ALIASES[k]) for k in MAMBA2_ALIASES}
        if None in f.values() or hidden is None:
            return None
        inner = f["heads"] * f["head_dim"]
        conv = inner + 2 * f["groups"] * f["state"]
        return float(hidden * (inner + conv + f["heads"]) + conv * f["kernel"] + inner * hidden)
    if family in GATED_DELTA_FAMILIES and all(config.get(k) for k in GATED_DELTA_FIELDS):
        nk, nv, dk, dv = (int(config[k]) for k in GATED_DELTA_FIELDS)
        key, value, kernel = nk * dk, nv * dv, int(config.get("linear_conv_kernel_dim") or 4)
        return float(hidden * (2 * key + 2 * value + 2 * nv) + (2 * key + value) * kernel + value * hidden)
    return None
