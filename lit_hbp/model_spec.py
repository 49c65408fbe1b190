"""The shape of a decoder-only transformer, enough to price its FLOPs, bytes and memory.

Pure Python: the analytic cost model and the planner's tools read it without torch. A spec comes
from a preset, a Hugging Face config (whatever its family calls the fields: ``n_embd`` or
``hidden_size``, ``n_layer`` or ``num_hidden_layers``, ...), or is refined from an instantiated
model, whose parameters say exactly which matmuls a token passes through (``active_layer_params``:
a mixture-of-experts layer counts its routed experts at top-k / experts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# What families call each field, first match wins.
ALIASES = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size", "padded_vocab_size"),
}


def _field(config: dict, name: str):
    for key in ALIASES[name]:
        if config.get(key) is not None:
            return config[key]
    return None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``active_layer_params`` / ``total_layer_params``, when
    known from the model itself, replace the gated-MLP formula: matmul parameters a token passes
    through in one decoder layer (averaged over layers) and parameters a layer holds."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    tied_embeddings: bool = False
    active_layer_params: float | None = None
    total_layer_params: float | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> float:
        """Matmul parameters one token passes through in a decoder layer: q, k, v, o projections
        and a gated MLP, unless measured from the model."""
        if self.active_layer_params is not None:
            return self.active_layer_params
        attn = self.hidden * self.heads * self.dim * 2 + self.hidden * self.kv_heads * self.dim * 2
        return attn + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> float:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        per_layer = self.total_layer_params if self.total_layer_params is not None else self.layer_params
        return self.layers * (per_layer + 2 * self.hidden) + embed + self.hidden

    def train_flops(self, tokens: float, sum_sq: float, head_tokens: float, weight_grads: bool = True) -> float:
        """Model FLOPs (forward and backward, no recomputation) of training on ``tokens`` tokens
        whose documents' squared lengths sum to ``sum_sq`` (causal attention: half the score
        matrix), with the LM head applied at ``head_tokens`` positions (lit-hbp: the supervised ones).
        The backward of a matmul costs two forwards: the input's gradient and the weight's; with
        frozen weights (LoRA) only the first is run (``weight_grads=False``)."""
        matmul = 3.0 if weight_grads else 2.0
        dense = 2.0 * self.layer_params * tokens * matmul + 2.0 * self.heads * self.dim * sum_sq * 3.0
        return self.layers * dense + 2.0 * self.hidden * self.vocab * head_tokens * matmul

    @classmethod
    def from_config(cls, config: dict | str | Path, name: str | None = None) -> ModelSpec:
        """From a Hugging Face config (dict, config.json, or a checkpoint folder holding one).
        Raises ValueError naming the fields it cannot find."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        c = dict(config)
        text = c.get("text_config")
        if isinstance(text, dict) and _field(c, "layers") is None:
            c = {**text, **{k: v for k, v in c.items() if k not in text and k != "text_config"}}
        values = {f: _field(c, f) for f in ALIASES}
        missing = [f"{f} ({' / '.join(ALIASES[f])})" for f in ("layers", "hidden", "heads") if values[f] is None]
        if missing:
            raise ValueError(f"the {c.get('model_type', 'model')} config has no {', '.join(missing)}")
        heads, hidden = int(values["heads"]), int(values["hidden"])
        kv = values["kv_heads"]
        if kv is None and c.get("multi_query"):
            kv = 1
        return cls(
            name=name or c.get("_name_or_path") or c.get("model_type", "model"),
            layers=int(values["layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(kv or heads),
            intermediate=int(values["intermediate"] or 4 * hidden),
            vocab=int(values["vocab"] or 32000),
            head_dim=c.get("head_dim"),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


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
