"""A stateful token mixer run on a share of its heads, on a Ulysses level (``mixers.by_document`` chooses it).

Where a pack's documents cannot be shared evenly over the ranks of a level (one long document: the long levels'
usual case), a mixer whose heads are independent runs every document on 1/sp of them: its class's own forward
(transformers' code, whatever kernel it picks) on a twin of that shape, built once per degree on the meta
device, holding the share's weights through ``torch.func.functional_call`` (views or gathers of the real ones,
so the gradients reach them). The output projection makes each rank's output a partial sum, which the SP kind
reduce-scatters; its bias, where it has one, is added by the first share alone (``_first_share``).
``HEAD_SPLITS`` names the classes and how each splits: the gated delta rule and Kimi's delta attention by key
heads; a Mamba2 mixer by whole groups, or, with one group, by heads with its gated norm summed over the ranks
(``SPANNING``); MiniMax's lightning attention by heads, its norm summed so too; RG-LRU and xLSTM's mLSTM by
heads; a Mamba1 scan by channels with its selective projection summed over the ranks; a short convolution by
channels. One module over 600 lines on purpose: each class's slices (``_*_part``, ``_*_shape``, a few lines a
family, 21 classes) beside the twin and the spanning modules they all rely on, read together when a family's
upstream source changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import torch

from lit_hbp.packing.mixer_share import splits

SHAPES = "_hbp_head_shapes"  # on a mixer instance: its 1/parts-of-the-heads twin per degree (meta, no weights)


def _span(n: int, part: int, parts: int) -> slice:
    """Part ``part`` of ``parts`` equal, contiguous shares of ``n`` rows."""
    return slice(part * n // parts, (part + 1) * n // parts)


def _rows(x: torch.Tensor, *spans: slice, dim: int = 0) -> torch.Tensor:
    """``x``'s rows (or ``dim``'s entries) in ``spans``, joined: a view when there is one."""
    pieces = [x.narrow(dim, s.start, s.stop - s.start) for s in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _gated_delta_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a gated-delta-rule mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        hidden_size=m.hidden_size, linear_num_value_heads=m.num_v_heads // parts,
        linear_num_key_heads=m.num_k_heads // parts, linear_key_head_dim=m.head_k_dim,
        linear_value_head_dim=m.head_v_dim, linear_conv_kernel_dim=m.conv_kernel_size, hidden_act=m.activation,
        rms_norm_eps=m.layer_norm_epsilon, layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _qkv_channels(key_dim: int, k_ch: slice, v_ch: slice) -> tuple[slice, slice, slice]:
    """A delta rule's convolution channels of a share (queries, then keys, then values): its heads' query and key
    channels ``k_ch`` (of ``key_dim`` each) and value channels ``v_ch``."""
    return (
        k_ch,
        slice(key_dim + k_ch.start, key_dim + k_ch.stop),
        slice(2 * key_dim + v_ch.start, 2 * key_dim + v_ch.stop),
    )


def _gated_delta_common(m: torch.nn.Module, part: int, parts: int) -> tuple[dict, slice, slice]:
    """The weights every gated-delta-rule layout splits alike: the convolution's q, k and v channels of the
    part's key heads and their value heads, the per-value-head decay and step, the output projection's
    columns of those value heads, and the gated norm (shared by every head, whole)."""
    k, v = _span(m.num_k_heads, part, parts), _span(m.num_v_heads, part, parts)
    dk, dv = m.head_k_dim, m.head_v_dim
    q_ch = slice(k.start * dk, k.stop * dk)
    weights = {
        "conv1d.weight": _rows(m.conv1d.weight, *_qkv_channels(m.key_dim, q_ch, slice(v.start * dv, v.stop * dv))),
        "A_log": m.A_log[v],
        "dt_bias": m.dt_bias[v],
        "norm.weight": m.norm.weight,
        "out_proj.weight": _rows(m.out_proj.weight, slice(v.start * dv, v.stop * dv), dim=1),
    }
    return weights, k, v


def _qwen3_next_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` hold each key head's group of rows together."""
    weights, k, _ = _gated_delta_common(m, part, parts)
    per_v = m.num_v_heads // m.num_k_heads
    qkvz = 2 * m.head_k_dim + 2 * m.head_v_dim * per_v
    weights["in_proj_qkvz.weight"] = _rows(m.in_proj_qkvz.weight, slice(k.start * qkvz, k.stop * qkvz))
    weights["in_proj_ba.weight"] = _rows(m.in_proj_ba.weight, slice(k.start * 2 * per_v, k.stop * 2 * per_v))
    return weights


def _qwen3_5_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Qwen3.5: ``in_proj_qkv`` holds all queries, then all keys, then all values (the convolution's
    channels); ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` a block per value head."""
    weights, k, v = _gated_delta_common(m, part, parts)
    dk, dv = m.head_k_dim, m.head_v_dim
    v_ch = slice(v.start * dv, v.stop * dv)
    weights["in_proj_qkv.weight"] = _rows(
        m.in_proj_qkv.weight, *_qkv_channels(m.key_dim, slice(k.start * dk, k.stop * dk), v_ch)
    )
    weights["in_proj_z.weight"] = _rows(m.in_proj_z.weight, v_ch)
    weights["in_proj_b.weight"] = m.in_proj_b.weight[v]
    weights["in_proj_a.weight"] = m.in_proj_a.weight[v]
    return weights


def _olmo_hybrid_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config an OLMo Hybrid gated delta rule of 1/``parts`` of ``m``'s heads is built from (its own fields;
    the decay's and step's initial ranges only shape weights a twin never holds)."""
    return SimpleNamespace(
        hidden_size=m.hidden_size, linear_num_value_heads=m.num_v_heads // parts,
        linear_num_key_heads=m.num_k_heads // parts, linear_key_head_dim=m.head_k_dim,
        linear_value_head_dim=m.head_v_dim, linear_conv_kernel_dim=m.conv_kernel_size,
        linear_allow_neg_eigval=m.allow_neg_eigval, rms_norm_eps=m.eps, hidden_act=m.activation,
        linear_a_log_min=0.0, linear_a_log_max=16.0, linear_dt_min=1e-3, linear_dt_max=0.1,
        linear_dt_init_floor=1e-4, layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _olmo_hybrid_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """OLMo Hybrid: separate q, k, v, a, b and g projections, a row (block) per head; its norm per head, whole."""
    k, v = _span(m.num_k_heads, part, parts), _span(m.num_v_heads, part, parts)
    dk, dv = m.head_k_dim, m.head_v_dim
    q_ch, v_ch = slice(k.start * dk, k.stop * dk), slice(v.start * dv, v.stop * dv)
    return {
        "q_proj.weight": m.q_proj.weight[q_ch],
        "k_proj.weight": m.k_proj.weight[q_ch],
        "v_proj.weight": m.v_proj.weight[v_ch],
        "a_proj.weight": m.a_proj.weight[v],
        "b_proj.weight": m.b_proj.weight[v],
        "g_proj.weight": m.g_proj.weight[v_ch],
        "conv1d.weight": _rows(m.conv1d.weight, *_qkv_channels(m.key_dim, q_ch, v_ch)),
        "A_log": m.A_log[v],
        "dt_bias": m.dt_bias[v],
        "o_norm.weight": m.o_norm.weight,
        "o_proj.weight": _rows(m.o_proj.weight, v_ch, dim=1),
    }


def _delta_attention_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Kimi (or Bailing) delta attention of 1/``parts`` of ``m``'s heads is built from (its own
    fields and its forget gate's)."""
    gate = m.forget_gate
    return SimpleNamespace(
        hidden_size=m.hidden_size, linear_num_heads=m.num_heads // parts, linear_head_dim=m.head_dim,
        linear_conv_kernel_dim=m.conv_kernel_size, hidden_act=m.activation, rms_norm_eps=m.o_norm.variance_epsilon,
        kda_safe_gate=getattr(gate, "safe_gate", None), kda_lower_bound=getattr(gate, "lower_bound", None),
        layer_types={m.layer_idx: getattr(m, "layer_type", None)},  # Bailing's keeps none
    )  # fmt: skip


def _delta_attention_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Kimi Linear's delta attention (KDA) and Bailing's: q, k, v projections and a per-channel decay, a row
    (block) per head; the gate's and decay's low-rank down projections (Kimi's) whole, their up projections
    by head; the norm per head, whole."""
    h = _span(m.num_heads, part, parts)
    ch = slice(h.start * m.head_dim, h.stop * m.head_dim)
    gate = m.forget_gate
    weights = {
        "q_proj.weight": m.q_proj.weight[ch],
        "k_proj.weight": m.k_proj.weight[ch],
        "v_proj.weight": m.v_proj.weight[ch],
        "conv1d.weight": _rows(m.conv1d.weight, *_qkv_channels(m.qkv_dim, ch, ch)),
        "forget_gate.dt_bias": gate.dt_bias[ch],
        "forget_gate.A_log": gate.A_log[h] if gate.A_log.dim() == 1 else gate.A_log[:, :, h],
        "b_proj.weight": m.b_proj.weight[h],
        "o_norm.weight": m.o_norm.weight,
        "o_proj.weight": _rows(m.o_proj.weight, ch, dim=1),
    }
    for name, proj in (("forget_gate.f_proj", "f_proj"), ("forget_gate.f_b_proj", "f_b_proj")):
        if hasattr(gate, proj):
            weights[f"{name}.weight"] = getattr(gate, proj).weight[ch]
    if hasattr(gate, "f_a_proj"):
        weights["forget_gate.f_a_proj.weight"] = gate.f_a_proj.weight
    if hasattr(m, "g_proj"):
        weights["g_proj.weight"] = m.g_proj.weight[ch]
    else:
        weights["g_a_proj.weight"], weights["g_b_proj.weight"] = m.g_a_proj.weight, m.g_b_proj.weight[ch]
    return weights


def _lightning_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config MiniMax's lightning attention of 1/``parts`` of ``m``'s heads is built from (its own fields; its
    activation is the mixer's own module, ``HeadSplit.own``)."""
    return SimpleNamespace(
        head_dim=m.head_dim, num_attention_heads=m.num_attention_heads // parts, hidden_size=m.qkv_proj.in_features,
        num_hidden_layers=m.num_hidden_layers, block_size=m.block_size, hidden_act="silu",
        layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _lightning_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """MiniMax's lightning attention: ``qkv_proj`` a block of q, k and v rows per head, the output gate, the norm
    and the output projection a block per head, the decays (buffers) per head; its norm spans every head
    (``_SharedGatedNorm`` without a gate)."""
    h = _span(m.num_attention_heads, part, parts)
    ch = slice(h.start * m.head_dim, h.stop * m.head_dim)
    return {
        "qkv_proj.weight": m.qkv_proj.weight[3 * ch.start : 3 * ch.stop],
        "output_gate.weight": m.output_gate.weight[ch],
        "norm.weight": m.norm.weight[ch],
        "out_proj.weight": _rows(m.out_proj.weight, ch, dim=1),
        "slope_rate": m.slope_rate[h],
        "query_decay": m.query_decay[h],
        "key_decay": m.key_decay[h],
        "diagonal_decay": m.diagonal_decay[:, h],
    }


def _first_share(bias: torch.Tensor, part: int) -> torch.Tensor:
    """An output projection's bias on share ``part``: the whole bias on the first share, its zeros on the others.
    The shares' outputs sum to the mixer's, which adds the bias once (added by every share it would count ``parts``
    times); the zeros keep its gradient a tensor, 0, on every rank, as data-parallel reductions expect (a share
    without it, None, fails the gradients' all-reduce)."""
    return bias * float(part == 0)


def _rglru_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a RecurrentGemma recurrent block of 1/``parts`` of ``m``'s heads is built from (its own fields;
    its activation is the block's own module, ``HeadSplit.own``)."""
    return SimpleNamespace(
        lru_width=m.lru_width // parts, hidden_size=m.hidden_size, conv1d_width=m.conv1d_width,
        num_attention_heads=m.rg_lru.num_attention_heads // parts, hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip


def _rglru_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """RecurrentGemma's recurrent block: its two input branches, convolution and RG-LRU per channel (the gates
    block-diagonal, a block per head), the output projection's columns of them; the output projection's bias
    added by the first share alone (``_first_share``)."""
    lru = m.rg_lru
    h = _span(lru.num_attention_heads, part, parts)
    ch = slice(h.start * lru.block_width, h.stop * lru.block_width)
    return {
        "linear_y.weight": m.linear_y.weight[ch],
        "linear_y.bias": m.linear_y.bias[ch],
        "linear_x.weight": m.linear_x.weight[ch],
        "linear_x.bias": m.linear_x.bias[ch],
        "conv_1d.weight": m.conv_1d.weight[ch],
        "conv_1d.bias": m.conv_1d.bias[ch],
        "rg_lru.recurrent_param": lru.recurrent_param[ch],
        "rg_lru.input_gate_weight": lru.input_gate_weight[h],
        "rg_lru.input_gate_bias": lru.input_gate_bias[h],
        "rg_lru.recurrent_gate_weight": lru.recurrent_gate_weight[h],
        "rg_lru.recurrent_gate_bias": lru.recurrent_gate_bias[h],
        "linear_out.weight": _rows(m.linear_out.weight, ch, dim=1),
        "linear_out.bias": _first_share(m.linear_out.bias, part),
    }


def _mamba2_heads(m: torch.nn.Module) -> int:
    """What an SP degree must divide for a Mamba2 mixer to split: its groups (a share is whole groups with their
    heads, the gated norm per group within it), or, with one group, its heads (every share reads the group's
    B and C, and the norm spans the shares: ``_SharedGatedNorm``)."""
    return m.n_groups if m.n_groups > 1 else m.num_heads


def _mamba2_groups(m: torch.nn.Module, parts: int) -> int:
    """The groups a Mamba2 mixer of 1/``parts`` of ``m``'s heads holds (see ``_mamba2_heads``)."""
    return m.n_groups // parts if m.n_groups > 1 else 1


def _mamba2_shape(m: torch.nn.Module, parts: int) -> Any:
    """The config a Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from (Nemotron-H's: a copy of its own)."""
    config = copy.copy(m.config)
    config.mamba_num_heads, config.n_groups = m.num_heads // parts, _mamba2_groups(m, parts)
    return config


def _bamba_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Bamba or Granite 4.0-H mixer of 1/``parts`` of ``m``'s heads is built from (its own fields:
    it keeps no config; its width is ``int(mamba_expand * hidden_size)``, exact through a fraction)."""
    return SimpleNamespace(
        mamba_proj_bias=m.use_bias, mamba_n_heads=m.num_heads // parts, hidden_size=m.hidden_size,
        mamba_d_state=m.ssm_state_size, mamba_d_conv=m.conv_kernel_size,
        mamba_expand=Fraction(m.intermediate_size // parts, m.hidden_size), mamba_conv_bias=m.use_conv_bias,
        hidden_act=m.activation, rms_norm_eps=m.layer_norm_epsilon, mamba_n_groups=_mamba2_groups(m, parts),
        mamba_d_head=m.head_dim, mamba_chunk_size=m.chunk_size, time_step_limit=m.time_step_limit,
        layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _zamba2_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Zamba2 Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from: its config's fields (a
    strict dataclass, whose integer ``mamba_expand`` cannot say half the width), the width's through a fraction."""
    c = m.config
    return SimpleNamespace(
        n_mamba_heads=m.num_heads // parts, hidden_size=m.hidden_size, mamba_d_state=m.ssm_state_size,
        mamba_d_conv=m.conv_kernel_size, mamba_expand=Fraction(m.intermediate_size // parts, m.hidden_size),
        use_conv_bias=m.use_conv_bias, mamba_ngroups=_mamba2_groups(m, parts), mamba_headdim=m.head_dim,
        chunk_size=m.chunk_size, time_step_min=c.time_step_min, add_bias_linear=c.add_bias_linear,
        layer_types={m.layer_idx: m.layer_type}, use_mamba_kernels=True,
    )  # fmt: skip


def _plain_mamba2_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Mamba2 model's mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        num_heads=m.num_heads // parts, hidden_size=m.hidden_size, state_size=m.ssm_state_size,
        conv_kernel=m.conv_kernel_size, expand=Fraction(m.intermediate_size // parts, m.hidden_size),
        time_step_rank=m.time_step_rank, use_conv_bias=m.use_conv_bias, hidden_act=m.activation,
        layer_norm_epsilon=m.layer_norm_epsilon, n_groups=_mamba2_groups(m, parts), head_dim=m.head_dim,
        chunk_size=m.chunk_size, time_step_limit=m.time_step_limit, time_step_min=m.time_step_min,
        time_step_max=m.time_step_max, time_step_floor=m.time_step_floor, use_bias=m.use_bias,
        layer_types={m.layer_idx: m.layer_type},
    )  # fmt: skip


def _falcon_h1_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config a Falcon-H1 Mamba2 mixer of 1/``parts`` of ``m``'s heads is built from (its own fields)."""
    return SimpleNamespace(
        hidden_act=m.activation, hidden_size=m.hidden_size, layer_types={m.layer_idx: m.layer_type},
        mamba_chunk_size=m.chunk_size, mamba_conv_bias=m.use_conv_bias, mamba_d_conv=m.conv_kernel_size,
        mamba_d_head=m.head_dim, mamba_d_ssm=m.intermediate_size // parts, mamba_d_state=m.ssm_state_size,
        mamba_expand=None, mamba_n_groups=_mamba2_groups(m, parts), mamba_n_heads=m.num_heads // parts,
        mamba_norm_before_gate=getattr(m.norm, "norm_before_gate", True), mamba_proj_bias=m.use_bias,
        mamba_rms_norm=m.mamba_rms_norm, projectors_bias=m.out_proj.bias is not None,
        rms_norm_eps=m.layer_norm_epsilon, ssm_in_multiplier=m.ssm_in_multiplier, time_step_limit=m.time_step_limit,
    )  # fmt: skip


def _xlstm_shape(m: torch.nn.Module, parts: int) -> SimpleNamespace:
    """The config an xLSTM layer (mLSTM) of 1/``parts`` of ``m``'s heads is built from: its config's fields (a
    strict dataclass, whose float width factors cannot say a share's widths exactly), the widths through fractions
    (``int(hidden_size * factor)``)."""
    c = m.config
    return SimpleNamespace(
        **{**vars(c), "num_heads": c.num_heads // parts,
           "qk_dim_factor": Fraction(m.qk_dim // parts, c.hidden_size),
           "v_dim_factor": Fraction(m.v_dim // parts, c.hidden_size)}
    )  # fmt: skip


def _xlstm_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """An xLSTM layer (mLSTM): q, k, v and the output gate a block of rows per head, the input and forget gates
    a row per head, the multi-head norm per head (its weight and bias a block per head), the output projection's
    columns of them; with ``use_bias`` the rows' biases go with them, the output projection's to the first share
    (``_first_share``). ``weight_mode`` "fused" holds q, k, v and the output gate in one projection (each whole
    in turn), the input and forget gates in another."""
    heads = m.config.num_heads
    h = _span(heads, part, parts)
    dk, dv = m.qk_dim // heads, m.v_dim // heads
    qk, v = slice(h.start * dk, h.stop * dk), slice(h.start * dv, h.stop * dv)
    weights = {
        "multihead_norm.weight": m.multihead_norm.weight[v],
        "out_proj.weight": _rows(m.out_proj.weight, v, dim=1),
    }
    if m.config.weight_mode == "fused":
        shift = [0, m.qk_dim, 2 * m.qk_dim, 2 * m.qk_dim + m.v_dim]
        rows = [slice(s + r.start, s + r.stop) for s, r in zip(shift, (qk, qk, v, v))]
        layout = {"qkv_opreact": rows, "ifgate_preact": [h, slice(heads + h.start, heads + h.stop)]}
    else:
        layout = {"q": [qk], "k": [qk], "v": [v], "ogate_preact": [v], "igate_preact": [h], "fgate_preact": [h]}
    for name, rows in layout.items():
        linear = getattr(m, name)
        weights[f"{name}.weight"] = _rows(linear.weight, *rows)
        if linear.bias is not None:
            weights[f"{name}.bias"] = _rows(linear.bias, *rows)
    if m.multihead_norm.bias is not None:
        weights["multihead_norm.bias"] = m.multihead_norm.bias[v]
    if m.out_proj.bias is not None:
        weights["out_proj.bias"] = _first_share(m.out_proj.bias, part)
    return weights


def _whole_shape(m: torch.nn.Module, parts: int) -> Any:
    """The config of a twin shaped as ``m`` itself: a mixer whose forward takes every width from its weights (a
    Mamba1 scan, a short convolution) runs a share of its channels on such a twin (Jamba's config could not say
    a share's width: ``mamba_expand * hidden_size``)."""
    return m.config


def _short_conv_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """A short convolution (LFM2's ``ShortConv``): ``in_proj`` gives B, C and x per channel, the depthwise
    convolution runs each channel alone, ``out_proj`` reads them: a share is its channels' rows and columns
    (``conv_bias``: the input projection's and the convolution's biases with their channels, the output
    projection's added by the first share, ``_first_share``)."""
    width = m.conv.weight.shape[0]
    ch = _span(width, part, parts)
    rows = (ch, slice(width + ch.start, width + ch.stop), slice(2 * width + ch.start, 2 * width + ch.stop))
    weights = {
        "in_proj.weight": _rows(m.in_proj.weight, *rows),
        "conv.weight": m.conv.weight[ch],
        "out_proj.weight": _rows(m.out_proj.weight, ch, dim=1),
    }
    if m.in_proj.bias is not None:
        weights["in_proj.bias"] = _rows(m.in_proj.bias, *rows)
    if m.conv.bias is not None:
        weights["conv.bias"] = m.conv.bias[ch]
    if m.out_proj.bias is not None:
        weights["out_proj.bias"] = _first_share(m.out_proj.bias, part)
    return weights


def _mamba1_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """A Mamba1 scan (Mamba's, FalconMamba's, Jamba's): ``in_proj`` gives x and the gate per channel, the
    convolution, step, decay and skip are per channel, ``x_proj`` reads every channel for the step's low rank,
    B and C (a share's columns give a partial sum, summed over the ranks: ``_SharedProjection``), and Jamba's
    norms of those (and FalconMamba's weightless ones) are whole; with ``use_bias`` (Jamba's
    ``mamba_proj_bias``) ``in_proj``'s bias goes with its rows, ``out_proj``'s to the first share
    (``_first_share``)."""
    inner = m.intermediate_size
    ch = _span(inner, part, parts)
    weights = {
        "in_proj.weight": _rows(m.in_proj.weight, ch, slice(inner + ch.start, inner + ch.stop)),
        "conv1d.weight": m.conv1d.weight[ch],
        "x_proj.weight": _rows(m.x_proj.weight, ch, dim=1),
        "dt_proj.weight": m.dt_proj.weight[ch],
        "dt_proj.bias": m.dt_proj.bias[ch],
        "A_log": m.A_log[ch],
        "D": m.D[ch],
        "out_proj.weight": _rows(m.out_proj.weight, ch, dim=1),
    }
    if m.in_proj.bias is not None:
        weights["in_proj.bias"] = _rows(m.in_proj.bias, ch, slice(inner + ch.start, inner + ch.stop))
    if m.conv1d.bias is not None:
        weights["conv1d.bias"] = m.conv1d.bias[ch]
    if m.out_proj.bias is not None:
        weights["out_proj.bias"] = _first_share(m.out_proj.bias, part)
    for norm in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        weight = getattr(getattr(m, norm, None), "weight", None)
        if isinstance(weight, torch.Tensor):
            weights[f"{norm}.weight"] = weight
    return weights


def _mamba2_part(m: torch.nn.Module, part: int, parts: int) -> dict[str, torch.Tensor]:
    """A Mamba2 mixer (Nemotron-H's, Bamba's, Granite 4.0-H's, Zamba2's, Mamba2's): ``in_proj`` gives the gate,
    the convolution's input (x, then B and C per group of heads) and the step per head; a share is its heads
    with their groups (whole groups, or the one group every share reads); the input projection's and the
    convolution's biases go with their rows, the output projection's (``use_bias``, Bamba's and Granite's
    ``mamba_proj_bias``, Zamba2's ``add_bias_linear``, Falcon-H1's ``projectors_bias``) to the first share
    (``_first_share``)."""
    h = _span(m.num_heads, part, parts)
    g = _span(m.n_groups, part, parts) if m.n_groups > 1 else slice(0, 1)
    inner, state, conv = m.intermediate_size, m.ssm_state_size, m.conv_dim
    x = slice(h.start * m.head_dim, h.stop * m.head_dim)
    b = slice(inner + g.start * state, inner + g.stop * state)
    c = slice(inner + m.n_groups * state + g.start * state, inner + m.n_groups * state + g.stop * state)
    shifted = [slice(inner + s.start, inner + s.stop) for s in (x, b, c)]  # in in_proj: after the gate
    rows = (x, *shifted, slice(inner + conv + h.start, inner + conv + h.stop))
    weights = {
        "in_proj.weight": _rows(m.in_proj.weight, *rows),
        "conv1d.weight": _rows(m.conv1d.weight, x, b, c),
        "dt_bias": m.dt_bias[h],
        "A_log": m.A_log[h],
        "D": m.D[h],
        "out_proj.weight": _rows(m.out_proj.weight, x, dim=1),
    }
    if isinstance(getattr(m.norm, "weight", None), torch.Tensor):  # Falcon-H1's is optional
        weights["norm.weight"] = m.norm.weight[x]
    if isinstance(getattr(m, "mup_vector", None), torch.Tensor):  # Falcon-H1's muP multipliers of in_proj's rows
        weights["mup_vector"] = _rows(m.mup_vector, *rows, dim=2)
    if m.in_proj.bias is not None:
        weights["in_proj.bias"] = _rows(m.in_proj.bias, *rows)
    if m.conv1d.bias is not None:
        weights["conv1d.bias"] = _rows(m.conv1d.bias, x, b, c)
    if m.out_proj.bias is not None:
        weights["out_proj.bias"] = _first_share(m.out_proj.bias, part)
    return weights


class _SharedGatedNorm(torch.nn.Module):
    """A Mamba2 mixer's gated RMSNorm (transformers' ``...RMSNormGated`` of one group: ``weight * y *
    rsqrt(mean(y^2) + eps)``, ``y = x * silu(gate)``; MiniMax's plain one: no gate) over the whole width, on a
    rank holding a share of the heads: each rank's sum of squares summed over the SP group
    (``SPKind.sum_ranks``), divided by the whole width. Built for one call (it holds the call's SP group); its
    weight, on the meta device, is the share's through ``functional_call``."""

    def __init__(self, norm: torch.nn.Module, mixer: torch.nn.Module, sp: Any):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.eps, self.width, self.sp = norm.variance_epsilon, mixer.norm.weight.numel(), sp

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        y = hidden_states.to(torch.float32)
        if gate is not None:
            y = y * torch.nn.functional.silu(gate.to(torch.float32))
        squares = self.sp.kind.sum_ranks(y.pow(2).sum(-1, keepdim=True), self.sp.ctx)
        return self.weight * (y * torch.rsqrt(squares / self.width + self.eps)).to(dtype)


class _SharedProjection(torch.nn.Module):
    """A Mamba1 scan's ``x_proj`` (no bias) on a rank holding a share of the channels: its columns of them give a
    partial sum of the step's low rank, B and C, summed over the SP group (``SPKind.sum_ranks``), so every rank
    scans its channels with the whole mixer's B, C and steps. Built for one call, like ``_SharedGatedNorm``."""

    def __init__(self, linear: torch.nn.Module, mixer: torch.nn.Module, sp: Any):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty_like(linear.weight, device="meta"))
        self.sp = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sp.kind.sum_ranks(torch.nn.functional.linear(x, self.weight), self.sp.ctx)


class _SharedFalconNorm(_SharedGatedNorm):
    """Falcon-H1's optional gated RMSNorm (``FalconH1RMSNormGated`` of one group) over the whole width, on a rank
    holding a share of the heads, as ``_SharedGatedNorm`` (each rank's sum of squares summed over the SP group), in
    its own order: the gate before the norm or, with ``norm_before_gate`` (its config's default), after it, and the
    weight applied in float32 before the cast back."""

    def __init__(self, norm: torch.nn.Module, mixer: torch.nn.Module, sp: Any):
        super().__init__(norm, mixer, sp)
        self.before_gate = norm.norm_before_gate

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        gated = None if gate is None else torch.nn.functional.silu(gate.to(torch.float32))
        if gated is not None and not self.before_gate:
            hidden_states = hidden_states * gated
        y = hidden_states.to(torch.float32)
        squares = self.sp.kind.sum_ranks(y.pow(2).sum(-1, keepdim=True), self.sp.ctx)
        y = self.weight * (y * torch.rsqrt(squares / self.width + self.eps))
        if gated is not None and self.before_gate:
            y = y * gated
        return y.to(dtype)


def _shared_norm(norm: torch.nn.Module, mixer: torch.nn.Module, sp: Any) -> torch.nn.Module:
    """A twin's norm spanning the shares: Falcon-H1's (which may normalize before its gate) or the others'."""
    cls = _SharedFalconNorm if hasattr(norm, "norm_before_gate") else _SharedGatedNorm
    return cls(norm, mixer, sp)


SPANNING = {"norm": _shared_norm, "x_proj": _SharedProjection}  # a twin's module that spans the shares
# the values a token that each sums over the SP group: a norm's sum of squares (one group), x_proj's output
SPANNING_VALUES = {"norm": lambda module: 1, "x_proj": lambda module: module.out_features}


@dataclass(frozen=True)
class HeadSplit:
    """How a mixer class runs on a share of its heads: ``heads(m)`` the count that the SP degree must
    divide, ``shape(m, parts)`` the config of a mixer of 1/parts of them (built from ``m``'s own
    fields), ``part(m, part, parts)`` the slices of ``m``'s weights that one holds (by parameter name:
    views where they can be, so their gradients reach ``m``'s weights). Each part's output is that part's
    heads' share of the output projection (its bias the first part's): the parts' outputs sum to the whole
    mixer's."""

    heads: Callable[[torch.nn.Module], int | None]
    shape: Callable[[torch.nn.Module, int], Any]
    part: Callable[[torch.nn.Module, int, int], dict[str, torch.Tensor]]
    spanning: Callable[[torch.nn.Module], tuple[str, ...]] = lambda m: ()
    """The twin's modules whose work spans the shares (``SPANNING``: a one-group Mamba2's gated norm, Falcon-H1's
    too, a Mamba1
    scan's ``x_proj``): on a split they run summed over the call's SP group, and the twin runs its unfused path
    (eval mode: a fused training kernel would take those weights itself, within the share)."""
    own: tuple[str, ...] = ()
    """The twin's modules taken from the mixer itself (no weights; one its config cannot name: an activation)."""
    layer_idx: bool = True
    """Whether the class is built from its config and a layer index (xLSTM's layer: its config alone)."""


def _one_group(m: torch.nn.Module) -> tuple[str, ...]:
    return ("norm",) if m.n_groups == 1 else ()


def _falcon_h1_one_group(m: torch.nn.Module) -> tuple[str, ...]:
    """Falcon-H1's gated norm is optional (``mamba_rms_norm``; else an identity, the gate applied by the mixer)."""
    return _one_group(m) if m.mamba_rms_norm else ()


def _channels(m: torch.nn.Module) -> int:
    """What an SP degree must divide for a mixer that splits by channels (a Mamba1 scan, a short convolution)."""
    return (m.conv1d if hasattr(m, "conv1d") else m.conv).weight.shape[0]


_MAMBA1 = HeadSplit(_channels, _whole_shape, _mamba1_part, lambda m: ("x_proj",))
_SHORT_CONV = HeadSplit(_channels, _whole_shape, _short_conv_part)


HEAD_SPLITS = {  # by class: exact against one process in tests/test_mixers.py, each at sp 2
    "Qwen3NextGatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_next_part),
    "Qwen3_5GatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_5_part),
    "Qwen3_5MoeGatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _gated_delta_shape, _qwen3_5_part),
    "NemotronHMamba2Mixer": HeadSplit(_mamba2_heads, _mamba2_shape, _mamba2_part, _one_group),
    "BambaMixer": HeadSplit(_mamba2_heads, _bamba_shape, _mamba2_part, _one_group),
    "GraniteMoeHybridMambaLayer": HeadSplit(_mamba2_heads, _bamba_shape, _mamba2_part, _one_group),
    "Zamba2MambaMixer": HeadSplit(_mamba2_heads, _zamba2_shape, _mamba2_part, _one_group),
    "Mamba2Mixer": HeadSplit(_mamba2_heads, _plain_mamba2_shape, _mamba2_part, _one_group),
    "FalconH1Mixer": HeadSplit(_mamba2_heads, _falcon_h1_shape, _mamba2_part, _falcon_h1_one_group),
    "OlmoHybridGatedDeltaNet": HeadSplit(lambda m: m.num_k_heads, _olmo_hybrid_shape, _olmo_hybrid_part),
    "KimiLinearDeltaAttention": HeadSplit(lambda m: m.num_heads, _delta_attention_shape, _delta_attention_part),
    "BailingHybridDeltaAttention": HeadSplit(lambda m: m.num_heads, _delta_attention_shape, _delta_attention_part),
    "MiniMaxLightningAttention": HeadSplit(
        lambda m: m.num_attention_heads, _lightning_shape, _lightning_part, lambda m: ("norm",), ("act_fn",)
    ),
    "RecurrentGemmaRecurrentBlock": HeadSplit(
        lambda m: m.rg_lru.num_attention_heads, _rglru_shape, _rglru_part, own=("act_fn",)
    ),
    "MambaMixer": _MAMBA1,
    "FalconMambaMixer": _MAMBA1,
    "JambaMambaMixer": _MAMBA1,
    "xLSTMLayer": HeadSplit(lambda m: m.config.num_heads, _xlstm_shape, _xlstm_part, layer_idx=False),
    "Lfm2ShortConv": _SHORT_CONV,
    "Lfm2MoeShortConv": _SHORT_CONV,
    "Lfm3ShortConv": _SHORT_CONV,
}


def split_heads(mixer: torch.nn.Module) -> int | None:
    """The heads ``mixer`` splits by on a Ulysses level (an SP degree must divide them), or None where it does
    not split: its class has no ``HEAD_SPLITS`` entry, or it holds a weight or buffer the split does not know
    (LoRA's adapters), which a share would leave out."""
    split = HEAD_SPLITS.get(type(mixer).__name__)
    if split is None:
        return None
    named = set(split.part(mixer, 0, 1))
    if named != {n for n, _ in mixer.named_parameters()} | {n for n, _ in mixer.named_buffers()}:
        return None
    return split.heads(mixer)


def spanning_values(mixer: torch.nn.Module) -> int:
    """Values a token that ``mixer``, split by heads, sums over its SP group in each pass (an all-reduce, its
    gradient another in the backward): a one-group norm's sum of squares, a Mamba1 scan's ``x_proj`` output; 0
    where nothing spans the shares or it does not split."""
    split = HEAD_SPLITS.get(type(mixer).__name__)
    if split is None or split_heads(mixer) is None:
        return 0
    return sum(SPANNING_VALUES[name](mixer.get_submodule(name)) for name in split.spanning(mixer))


def heads_part(mixer: torch.nn.Module, part: int, parts: int, sp: Any = None):
    """A function running ``mixer`` on part ``part`` of ``parts`` equal shares of its heads (its own forward,
    on its twin of that shape with the share's weights), or None where it does not split so
    (``split_heads``, ``mixer_share.splits``; a mixer with work spanning the shares without ``sp``, the call's
    SP group, to sum it over)."""
    if not splits(split_heads(mixer), parts):
        return None
    split = HEAD_SPLITS[type(mixer).__name__]
    spanning = split.spanning(mixer) if parts > 1 else ()
    if spanning and sp is None:
        return None
    weights = split.part(mixer, part, parts)
    shapes = mixer.__dict__.setdefault(SHAPES, {})
    if parts not in shapes:
        with torch.device("meta"):
            built = (getattr(mixer, "layer_idx", None),) if split.layer_idx else ()
            shapes[parts] = twin = type(mixer)(split.shape(mixer, parts), *built)
        for name in weights.keys() - dict(twin.named_parameters()).keys() - dict(twin.named_buffers()).keys():
            twin.register_buffer(name, weights[name].to("meta"), persistent=False)  # one its model registers
        for name in split.own:
            setattr(twin, name, getattr(mixer, name))
    twin = shapes[parts]
    if spanning:  # this call's twin: the cached one's modules, those spanning the shares summed over its SP group
        twin = copy.copy(twin)
        twin._modules = {**twin._modules, **{name: SPANNING[name](twin._modules[name], mixer, sp) for name in spanning}}
        twin.training = False
    return lambda *args, **kwargs: torch.func.functional_call(twin, weights, args, kwargs, strict=True)
