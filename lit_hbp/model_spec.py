"""The shape of a decoder-only transformer, enough to price its FLOPs, bytes and memory.

Pure Python: the analytic cost model and the planner's tools read it without torch. A spec comes
from a preset, a Hugging Face config (whatever its family calls the fields: ``n_embd`` or
``hidden_size``, ``n_layer`` or ``num_hidden_layers``, ...), or is refined from an instantiated
model, whose parameters say exactly which matmuls a token passes through (``active_layer_params``:
a mixture-of-experts layer counts its routed experts at top-k / experts; from a config: ``moe_spec.Experts``; a
hybrid's attending and mixer layers: ``mixer_spec``). What a layer keeps for its backward (latent attention's,
dropout's; a mixture of experts' in ``moe_spec``) is read from the same config fields, under the same aliases, as the
shape.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lit_hbp.mixer_spec import (
    HIDDEN_WIDTH,
    LAYER_COUNT,
    NOT_ATTENTION,
    attention_layers,
    layer_kinds,
    mixer_heads,
    mixer_layers,
    mixer_params,
    mixer_spanning,
)
from lit_hbp.moe_spec import SUB_CONFIG_FIELDS, experts_of

# What families call each field, first match wins.
ALIASES = {
    "layers": LAYER_COUNT,
    "hidden": HIDDEN_WIDTH,
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "kv_n_heads"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "dff"),
    "vocab": ("vocab_size", "padded_vocab_size"),
}


def _field(config: dict, name: str, aliases: dict = ALIASES):
    for key in aliases[name]:
        if config.get(key) is not None:
            return config[key]
    return None


# A vision tower's fields, as its config names them (Qwen2-VL's ``hidden_size`` is its merger's output: its
# width is ``embed_dim``).
VISION_ALIASES = {
    "layers": ("depth", "num_hidden_layers", "num_layers"),
    "hidden": ("embed_dim", "hidden_size", "width"),
    "intermediate": ("intermediate_size",),
    "heads": ("num_heads", "num_attention_heads"),
}
TWO_MATRIX_MLPS = frozenset(
    {"ctrl", "gpt2", "gpt-sw3", "gpt_bigcode", "gptj", "codegen", "gpt_neo", "gpt_neox", "opt", "bloom", "falcon",
     "phi", "starcoder2", "biogpt", "xglm", "persimmon", "openai-gpt", "mpt", "ergo"}
)  # fmt: skip
"""Families whose MLP is two matrices (up, activation, down), not a gated MLP's three: their formula's parameters."""
GATED_ACTS = ("silu", "swish")  # a gated MLP (Qwen2.5-VL's): gate, up and down matrices
SIGMOID_ACTS = ("quick_gelu",)  # x * sigmoid(1.702 x): keeps its input and the sigmoid


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image encoder (its ``vision_config``), enough for what it weighs and what
    it keeps per image patch for the backward (``saved_bytes_per_patch``, checked against bytes measured on
    CPU for the Qwen, CLIP and SigLIP towers in tests/test_vision_costs.py).

    mlp_rows: rows of the intermediate size a block keeps per patch (2: GELU's input and output; 3: a
    sigmoid GELU's also its sigmoid; 4: a gated MLP's gate, up, activation and product). rotary: its
    attention rotates q and k (Qwen's 2-D RoPE, the towers that cut videos into temporal patches), keeping
    the rotated copies. windowed: some of its blocks attend within windows (Qwen2.5-VL's: the patches are
    reordered into windows and back). merge: patches per language token along each side (Qwen's 2: four
    patches a token).
    projectors: the projectors of its features into the language model (Qwen3-VL's deepstack adds some), to
    ``out_hidden`` (its config's; None: the language model's width).
    patch_pixels: the pixels of one patch (patch_size squared, times the temporal patch)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int = 16
    mlp_rows: int = 2
    rotary: bool = False
    windowed: bool = False
    merge: int = 1
    projectors: int = 1
    patch_pixels: int = 14 * 14
    out_hidden: int | None = None

    @property
    def gated(self) -> bool:
        return self.mlp_rows == 4

    def params(self, text_hidden: int) -> float:
        """Its blocks (attention's four matrices, the MLP's two or three), the patch embedding and the
        projectors (each: merged patches to the language model's width through one hidden layer)."""
        h, i = self.hidden, self.intermediate
        blocks = self.layers * (4 * h * h + (3 if self.gated else 2) * h * i)
        merged, out = self.merge * self.merge * h, self.out_hidden or text_hidden
        projector = merged * out + max(merged, out) ** 2
        return blocks + 3 * self.patch_pixels * h + self.projectors * projector

    def saved_bytes_per_patch(self, dtype_bytes: int) -> float:
        """Bytes per patch one block keeps for its backward: two norms' inputs, the attention's input, q, k,
        v, output and projection input (with q and k rotated copies: Qwen's), the MLP's input and its
        intermediate rows; a gated tower's RMSNorms (Qwen2.5-VL's) keep an fp32 copy of their input below fp32."""
        h = self.hidden
        rows = 9 * h + (4 * h if self.rotary else 0) + self.mlp_rows * self.intermediate
        upcast = 2 * 4 * h if self.gated and dtype_bytes < 4 else 0
        return dtype_bytes * rows + upcast

    def outside_bytes_per_patch(self, dtype_bytes: int) -> float:
        """Bytes per patch kept outside the blocks, checkpointed or not: each projector's norm input, first
        matmul input, activation input and second matmul input (merged patches: a hidden row per patch
        each); a rotary tower's cos and sin tables (fp32, a head's width each); a windowed tower's patches
        reordered into windows and back."""
        rotary = 2 * 4 * (self.hidden // self.heads) if self.rotary else 0
        windows = 2 * dtype_bytes * self.hidden if self.windowed else 0
        return dtype_bytes * 4 * self.hidden * self.projectors + rotary + windows

    @classmethod
    def from_config(cls, vision: dict) -> VisionSpec | None:
        """From a ``vision_config`` mapping; None when it names no depth or width (a tower lit-hbp cannot price)."""
        values = {f: _field(vision, f, VISION_ALIASES) for f in VISION_ALIASES}
        if values["layers"] is None or values["hidden"] is None:
            return None
        hidden = int(values["hidden"])
        act = str(vision.get("hidden_act") or vision.get("hidden_activation") or "gelu")
        patch, frames = int(vision.get("patch_size") or 14), int(vision.get("temporal_patch_size") or 1)
        return cls(
            layers=int(values["layers"]),
            hidden=hidden,
            intermediate=int(values["intermediate"] or (vision.get("mlp_ratio") or 4) * hidden),
            heads=int(values["heads"] or max(hidden // 64, 1)),
            mlp_rows=4 if act in GATED_ACTS else 3 if act in SIGMOID_ACTS else 2,
            rotary=vision.get("temporal_patch_size") is not None,
            windowed=bool(vision.get("window_size")) and vision.get("fullatt_block_indexes") is not None,
            merge=int(vision.get("spatial_merge_size") or 1),
            projectors=1 + len(vision.get("deepstack_visual_indexes") or []),
            patch_pixels=patch * patch * frames,
            out_hidden=vision.get("out_hidden_size") or (vision["hidden_size"] if vision.get("embed_dim") else None),
        )


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``active_layer_params`` / ``total_layer_params``, when
    known from the model itself, replace the gated-MLP formula: matmul parameters a token passes
    through in one decoder layer (averaged over layers, each use of a shared layer counted) and the layers'
    matrices (each once) per layer."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    attention_width: int | None = None
    """Per head, the query-key width plus the value width of the attention (None: twice ``dim``; multi-head latent
    attention's differ: DeepSeek-V3's 192 and 128)."""
    tied_embeddings: bool = False
    active_layer_params: float | None = None
    total_layer_params: float | None = None
    vision: VisionSpec | None = None
    """A vision-language model's image encoder (None: a text-only model)."""
    attention_layers: int | None = None
    """Layers whose work grows with the square of a document's length (None: every layer); a hybrid's others
    (Mamba, the gated delta rule, short convolutions: ``lit_hbp.model.mixers``) are linear in it, their
    projections counted in ``layer_params``."""
    mixer_layers: int | None = None
    """Layers holding a stateful token mixer (None: every layer that does not attend)."""
    mixer_params: float | None = None
    """Matmul parameters of one stateful mixer (its projections and convolution), when known from the model;
    else priced as an attention block's (``mixer_matmul_params``)."""
    mixer_heads: int | None = None
    """The heads its mixers split by on a Ulysses level (``lit_hbp.packing.mixer_share``); None: they do
    not split, the ranks share a pack's documents."""
    mixer_spanning: int = 0
    """Values a token that a mixer split by heads sums over its SP group in each pass (a Mamba1 scan's ``x_proj``
    output, a one-group norm's sum of squares: ``mixer_heads.spanning_values``); 0: nothing spans the shares."""
    attention_windows: tuple[tuple[str, int], ...] = ()
    """Each attending layer's reach, where any layer's is bounded (``attention_windows``): ``("sliding", w)``,
    ``("chunked", c)`` or ``("full", 0)``; empty: every layer attends to its document's whole causal prefix."""
    mlp_values: float | None = None
    """Values per token (the model's dtype) one layer's MLP keeps for its backward, averaged over the layers, where
    it is not a gated MLP's four rows of ``intermediate``: a mixture of experts' (``Experts.saved``)."""
    mlp_bytes: float = 0.0
    """Bytes per token of a layer's routing beside ``mlp_values`` (fp32 probabilities, expert indices)."""
    norm_values: float | None = None
    """Values per token a layer's norms normalize, averaged over the layers (``param_counts.norm_values``: Gemma 3's
    four of the hidden width, Qwen 3's and OLMo 2's query and key norms); None: two of the hidden width."""
    value_dim: int | None = None
    """Multi-head latent attention's value width per head (``attention_width`` less it: the query-key width)."""
    latent: tuple[int, int, int] | None = None
    """Multi-head latent attention's query and key-value ranks and rotary width (``latent_ranks``)."""
    dropout_values: int = 0
    """Values per token a layer's dropout masks cover (``dropout_rows``); 0: no dropout."""
    attention_dropout: bool = False
    """Its attention drops probabilities (a flash kernel keeps no mask; the CPU's sdpa keeps each document's)."""
    mlp_matrices: int = 3
    """Matrices of its MLP in the formula's parameters (3: gated; 2: ``TWO_MATRIX_MLPS``)."""
    mlp_params: tuple[float, float] | None = None
    """A mixture of experts' MLP in the formula, per layer averaged over the layers (``Experts.mlp_params``): the matmul
    parameters a token passes through (router, shared and top-k experts, the dense layers' MLP) and those held; None:
    ``mlp_matrices`` of ``intermediate``."""
    recompute_skipped: float = 0.0
    """Matmul parameters per layer a checkpointed layer's recompute does not run again: torch's non-reentrant
    checkpoint stops once it has rebuilt every tensor the backward reads, and a plain transformer layer's MLP output
    projection only feeds the residual sum (``POST_MLP_NORMS`` families normalize it, a mixture of experts weighs it
    by its routing: both keep it, all recomputed). A compiled layer, and one whose MLP is tiled, recomputes whole
    (``CostModel.dense_seconds``)."""
    router_loss: bool = False
    """Its config asks for a mixture of experts' load-balancing loss (``output_router_logits``), a mean over a whole
    pack that every rank of a level's SP group gathers, which context parallelism does not: the level search leaves CP
    layouts out, as for a hybrid's mixers."""
    counted_params: float | None = None
    """The language model's parameters counted on the built model, each tensor once (a layer shared, looped or
    nested counts once: ``param_counts.language_params``); None: the formula's (``params``)."""
    source: Any = field(default=None, compare=False, repr=False)
    """The model argument it was counted on (a config mapping or checkpoint folder), for what a run adds to it
    (LoRA's adapters: ``param_counts.lora_settings``); None: a preset or a config's formula."""

    @property
    def qk_width(self) -> int:
        """A head's query and key width (multi-head latent attention's own; else ``dim``)."""
        return (
            self.dim
            if self.value_dim is None or self.attention_width is None
            else self.attention_width - self.value_dim
        )

    @property
    def v_width(self) -> int:
        """A head's value (and output) width (multi-head latent attention's own; else ``dim``)."""
        return self.dim if self.value_dim is None or self.attention_width is None else self.value_dim

    @property
    def attending(self) -> int:
        """The layers that attend (``attention_layers``, or every layer)."""
        return self.layers if self.attention_layers is None else self.attention_layers

    @property
    def mixing(self) -> int:
        """The layers holding a stateful token mixer (``mixer_layers``, or those that do not attend)."""
        return self.layers - self.attending if self.mixer_layers is None else self.mixer_layers

    @property
    def mixer_matmul_params(self) -> float:
        """Matmul parameters a token passes through in one stateful mixer (``mixer_params``, else an attention
        block's q, k, v and o projections)."""
        if self.mixer_params is not None:
            return self.mixer_params
        return self.hidden * self.heads * self.dim * 2 + self.hidden * self.kv_heads * self.dim * 2

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> float:
        """Matmul parameters one token passes through in a decoder layer: q, k, v, o projections
        and a gated MLP (two matrices: ``mlp_matrices``) or a mixture of experts' (``mlp_params``), unless measured
        from the model."""
        if self.active_layer_params is not None:
            return self.active_layer_params
        return self._attention_params + self._mlp_params(0)

    @property
    def _attention_params(self) -> float:
        """q, k, v and o projections; multi-head latent attention's: the query's (through its rank where it has one),
        the keys' and values' down projection (with the shared rotary key) and up projection, the output's."""
        h, heads = self.hidden, self.heads
        if self.latent is None or self.attention_width is None or self.value_dim is None:
            return h * heads * self.dim * 2 + h * self.kv_heads * self.dim * 2
        (q_rank, kv_rank, rope), qk, v = self.latent, self.attention_width - self.value_dim, self.value_dim
        query = q_rank * (h + heads * qk) if q_rank else h * heads * qk
        return query + h * (kv_rank + rope) + kv_rank * heads * (qk - rope + v) + heads * v * h

    def _mlp_params(self, held: int) -> float:
        """A layer's MLP parameters in the formula: those a token passes through (``held`` 0) or all (1)."""
        if self.mlp_params is not None:
            return self.mlp_params[held]
        return self.mlp_matrices * self.hidden * self.intermediate

    @property
    def pair_flops(self) -> float:
        """Forward FLOPs of one token pair's causal attention through every layer, at the heads' query-key and value
        widths (``CostModel.attention_forward_seconds``'s): the planner's unit of work (``plan_hbp(extra_work=...)``
        counts a vision tower's in it). Not twice ``hidden``: Gemma 3's heads are wider than its hidden size."""
        return float(self.attending * self.heads * (self.qk_width + self.v_width))

    @property
    def params(self) -> float:
        """The language model's parameters (a vision tower's: ``vision.params``): counted where known, else the
        formula's (a layer's norms two rows of the width)."""
        if self.counted_params is not None:
            return self.counted_params
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.held_layer_params + 2 * self.hidden) + embed + self.hidden

    @property
    def held_layer_params(self) -> float:
        """Matmul parameters a decoder layer holds, averaged over the layers (a mixture of experts': all its experts):
        ``total_layer_params`` where counted, else the formula's."""
        if self.total_layer_params is not None:
            return self.total_layer_params
        return (
            self.layer_params if self.active_layer_params is not None else self._attention_params + self._mlp_params(1)
        )

    def attention_sq(self, lengths) -> float:
        """What the attending layers' causal attention over documents of these ``lengths`` weighs, per layer on
        average, in the unit of ``train_flops``' ``sum_sq``: the sum of ``document_sq``."""
        return float(self.document_sq(lengths).sum())

    def document_sq(self, lengths) -> np.ndarray:
        """Each document's attention weight, per attending layer on average: its squared length where every layer
        reaches its whole causal prefix; a sliding window of ``w`` keys bounds a longer document's at
        ``2wL - w^2 + w - L`` (twice its query-key pairs less the diagonal's half, as ``L^2`` is a full layer's), a
        chunked layer's is its chunks' squares."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if not self.attention_windows:
            return lengths**2
        total = np.zeros_like(lengths)
        for (kind, size), layers in Counter(self.attention_windows).items():
            if kind == "sliding":
                bounded = 2 * size * lengths - size * size + size - lengths
                total += layers * np.where(lengths <= size, lengths**2, bounded)
            elif kind == "chunked":
                whole, rest = np.divmod(lengths, size)
                total += layers * (whole * size * size + rest**2)
            else:
                total += layers * lengths**2
        return total / len(self.attention_windows)

    def train_flops(self, tokens: float, sum_sq: float, head_tokens: float, weight_grads: bool = True) -> float:
        """Model FLOPs (forward and backward, no recomputation) of training on ``tokens`` tokens
        whose documents' squared lengths sum to ``sum_sq`` (causal attention: half the score
        matrix), with the LM head applied at ``head_tokens`` positions (lit-hbp: the supervised ones).
        The backward of a matmul costs two forwards: the input's gradient and the weight's; with
        frozen weights (LoRA) only the first is run (``weight_grads=False``)."""
        matmul = 3.0 if weight_grads else 2.0
        dense = self.layers * 2.0 * self.layer_params * tokens * matmul
        attention = self.attending * self.heads * (self.attention_width or 2 * self.dim) * sum_sq * 3.0
        return dense + attention + 2.0 * self.hidden * self.vocab * head_tokens * matmul

    @classmethod
    def from_config(cls, config: dict | str | Path, name: str | None = None) -> ModelSpec:
        """From a Hugging Face config (dict, config.json, or a checkpoint folder holding one).
        Raises ValueError naming the fields it cannot find."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        c = top = dict(config)
        vision = c.get("vision_config")
        text = c.get("text_config")
        if isinstance(text, dict) and _field(c, "layers") is None:
            c = {**text, **{k: v for k, v in c.items() if k not in text and k != "text_config"}}
        for sub, names in SUB_CONFIG_FIELDS.items():  # DBRX's
            inner = c.get(sub) if isinstance(c.get(sub), dict) else {}
            c = {**{k: inner[k] for k in names if inner.get(k) is not None and k not in c}, **c}
        values = {f: _field(c, f) for f in ALIASES}
        if values["layers"] is None and layer_kinds(c) is not None:
            values["layers"] = len(layer_kinds(c))  # Nemotron-H's: as many as it lists
        attending = attention_layers(c)
        if attending == 0:
            values["heads"] = values["heads"] or 1  # a state-space model: no attention to price
        missing = [f"{f} ({' / '.join(ALIASES[f])})" for f in ("layers", "hidden", "heads") if values[f] is None]
        if missing:
            raise ValueError(f"the {c.get('model_type', 'model')} config has no {', '.join(missing)}")
        heads, hidden = int(values["heads"]), int(values["hidden"])
        kv = values["kv_heads"]
        if kv is None and c.get("multi_query"):
            kv = 1
        layers = int(values["layers"])
        dense = dense_width(c, ALIASES["intermediate"], hidden)
        matrices = 2 if c.get("model_type") in TWO_MATRIX_MLPS else 3
        experts = experts_of(c, dense or 4 * hidden, layers)
        moe = experts.saved(hidden) if experts else None
        width = dense or (moe[0] / 4 if moe else 4 * hidden)  # a mixture of experts naming no dense width: its active
        masked, attention_dropout = dropout_rows(c, hidden, width)
        latent = latent_ranks(c)
        return cls(
            name=name or top.get("_name_or_path") or top.get("model_type") or c.get("model_type", "model"),
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=int(kv or heads),
            intermediate=int(width),
            vocab=int(values["vocab"] or 32000),
            head_dim=c.get("head_dim"),
            attention_width=latent_attention_width(c),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            vision=VisionSpec.from_config(vision) if isinstance(vision, dict) else None,
            attention_layers=attending,
            mixer_layers=mixer_layers(c),
            mixer_params=mixer_params(c),
            mixer_heads=mixer_heads(c),
            mixer_spanning=mixer_spanning(c),
            attention_windows=attention_windows(c),
            mlp_values=moe[0] if moe else None,
            mlp_bytes=moe[1] if moe else 0.0,
            value_dim=c.get("v_head_dim") if latent else None,
            latent=latent,
            dropout_values=masked,
            attention_dropout=attention_dropout,
            mlp_matrices=matrices,
            mlp_params=experts.mlp_params(hidden, matrices) if experts else None,
            router_loss=bool(c.get("output_router_logits")),
            recompute_skipped=float(hidden * width) if plain_mlp_end(c, experts) else 0.0,
        )


POST_MLP_NORMS = ("afmoe", "axk1", "diffusion_gemma", "dory", "ergo", "exaone4", "flex_olmo", "gemma2", "gemma3",
                  "gemma4", "glm4", "glm_image", "glm_ocr", "kolibri1", "lfm3", "muse_glimmer", "muse_spark", "olmo2",
                  "olmo3", "olmo_hybrid", "t5gemma", "beam", "chameleon", "mllama", "mpt")  # fmt: skip
"""Model types (by prefix: a VLM's ``_text`` config too) whose decoder layers keep the MLP's output for their
backward: a norm of it before the residual sum (Gemma 2's ``post_feedforward_layernorm``, OLMo 2's, Chameleon's
``swin_norm``), a learned gate on it (Mllama's cross-attention layers), a dropout of it its config nests (MPT's)."""


def plain_mlp_end(config: dict, experts) -> bool:
    """Whether every layer ends in a dense MLP's output projection whose output only the residual sum takes (the
    part of a checkpointed layer its recompute skips: ``ModelSpec.recompute_skipped``): a plain transformer (no
    stateful mixers, no experts) neither normalizing the MLP's output nor dropping it (a residual dropout's mask is
    drawn after the projection)."""
    family = str(config.get("model_type") or "")
    residual_dropout = any(_positive(config.get(k)) for k in RESIDUAL_DROPOUT)
    return (
        experts is None and not mixer_layers(config) and not residual_dropout and not family.startswith(POST_MLP_NORMS)
    )


BOUNDED_KINDS = {
    "sliding_attention": ("sliding", "sliding_window"),
    "chunked_attention": ("chunked", "attention_chunk_size"),
}


def attention_windows(config: dict) -> tuple[tuple[str, int], ...]:
    """Each attending layer's reach (``ModelSpec.attention_windows``) as the family's code sets it: by
    ``layer_types`` where the config lists them (Gemma 2/3's, GPT-OSS's ``sliding_attention`` layers take
    ``sliding_window``, Llama 4's ``chunked_attention`` ones ``attention_chunk_size``), else Mistral's, Mixtral's,
    Phi-3's and Starcoder2's ``sliding_window`` at every layer; () when no layer's is bounded."""
    kinds = layer_kinds(config)
    if kinds is None:
        window = config.get("sliding_window")
        layers = attention_layers(config)
        layers = int(_field(config, "layers") or 0) if layers is None else layers
        bounded = isinstance(window, int) and not isinstance(window, bool) and window > 0
        return (("sliding", window),) * layers if bounded and config.get("use_sliding_window") is not False else ()
    reach = []
    for kind in kinds:
        if NOT_ATTENTION.search(kind.lower()):
            continue
        name, field = BOUNDED_KINDS.get(kind, ("full", None))
        size = config.get(field) if field else None
        reach.append((name, size) if isinstance(size, int) and size > 0 else ("full", 0))
    return tuple(reach) if any(name != "full" for name, _ in reach) else ()


def latent_attention_width(c: dict) -> int | None:
    """Multi-head latent attention's query-key plus value width per head (DeepSeek-V2/V3, Kimi K2: the queries and
    keys carry a rotary and a plain part, the values their own width); None for other attention."""
    parts = [c.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    return sum(parts) if all(isinstance(p, int) and p > 0 for p in parts) else None


# What a decoder layer keeps for its backward beyond a Llama layer's, read from the config's fields: the MLP's width
# where a family names it otherwise, a mixture of experts' routed and shared experts (``moe_spec.Experts.saved``),
# multi-head latent attention's low-rank projections, dropout. Counted from the tensors transformers 5.24's layers save
# (saved-tensor hooks on CPU, tests/test_memory_model.py).
RESIDUAL_DROPOUT = ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "residual_dropout", "dropout")
ACTIVATION_DROPOUT = ("activation_dropout",)
ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", "attn_dropout")

UNREAD_WIDTHS = ("dim_ff", "d_inner", "ffn_config", "encoder_ffn_dim", "decoder_ffn_dim")
"""MLP width fields of transformers' configs whose families the cost model does not read: refused by name."""


def _first_of(config: dict, names: tuple[str, ...]):
    return next((config[k] for k in names if config.get(k) is not None), None)


def dense_width(config: dict, aliases: tuple[str, ...], hidden: int) -> int | None:
    """A dense MLP's width: the first of ``aliases`` the config sets (``intermediate_size``, CTRL's ``dff``...),
    MPT's ``expansion_ratio``, xLSTM's ``ffn_proj_factor`` (rounded up as its layer rounds it), GPT-NeoX-Japanese's
    ``intermediate_multiple_size``; None where none is set (GPT-2's ``n_inner: null``: four times the width).
    Raises ValueError for a field naming it that is not read."""
    width = _first_of(config, aliases)
    if isinstance(width, (list, tuple)):  # Gemma 3n's per layer: their mean
        return int(sum(width) / len(width))
    if width is not None:
        return int(width)
    if config.get("expansion_ratio") is not None:
        return int(config["expansion_ratio"] * hidden)
    if config.get("ffn_proj_factor") is not None:
        multiple = int(config.get("ffn_round_up_to_multiple_of") or 1)
        return int(math.ceil(config["ffn_proj_factor"] * hidden / multiple) * multiple)
    if config.get("intermediate_multiple_size") is not None:
        return int(config["intermediate_multiple_size"] * hidden)
    unread = [k for k in UNREAD_WIDTHS if config.get(k) is not None]
    if unread:
        raise ValueError(
            f"the {config.get('model_type', 'model')} config names its MLP width by {unread[0]}, which lit-hbp's cost "
            "model does not read"
        )
    return None


def latent_ranks(config: dict) -> tuple[int, int, int] | None:
    """Multi-head latent attention's (``q_lora_rank`` (0: a full-rank query), ``kv_lora_rank``, ``qk_rope_head_dim``),
    whose projections' normed rows its layer keeps; None for other attention."""
    kv, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    if not (isinstance(kv, int) and kv > 0 and isinstance(rope, int) and rope > 0):
        return None
    return int(config.get("q_lora_rank") or 0), kv, rope


def dropout_rows(config: dict, hidden: int, width: int) -> tuple[int, bool]:
    """(values per token a layer's dropout masks cover, whether its attention drops probabilities), where the
    config's probabilities are above 0: a residual dropout after the attention and after the MLP (two rows of the
    width), an activation dropout in the MLP (a row of its width)."""
    residual = any(_positive(config.get(k)) for k in RESIDUAL_DROPOUT)
    activation = any(_positive(config.get(k)) for k in ACTIVATION_DROPOUT)
    attention = any(_positive(config.get(k)) for k in ATTENTION_DROPOUT)
    return (2 * hidden if residual else 0) + (width if activation else 0), attention


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# Published architectures (config.json of each model on the Hugging Face hub).
MODELS: dict[str, ModelSpec] = {
    "llama3.1-8b": ModelSpec("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3.1-70b": ModelSpec("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
}


def load_model_spec(spec: str) -> ModelSpec:
    """A preset name, a config.json / checkpoint folder, or a training YAML's model section."""
    if spec.lower() in MODELS:
        return MODELS[spec.lower()]
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"--model {spec!r} is neither a preset ({', '.join(MODELS)}) nor an existing path")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        config = yaml.safe_load(path.read_text()) or {}
        model = (config.get("model") or {}).get("model") or (config.get("model") or {}).get("init_args", {}).get(
            "model"
        )
        if model is None:
            raise ValueError(f"{path}: no model.model entry (a checkpoint path or a config mapping)")
        return ModelSpec.from_config(model if isinstance(model, dict) else Path(model), name=path.stem)
    return ModelSpec.from_config(path)
