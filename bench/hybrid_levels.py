"""What a hybrid's mixers cost on Ulysses levels, as the packed call runs them, and what a head split saves.

    python bench/hybrid_levels.py [--gpus 32] [--gpu h100] [--samples 50000]

A stateful mixer (Mamba2, the gated delta rule) runs each document whole. On an SP level the ranks share a
pack's documents, or, where the mixer splits by heads, run every document on 1/sp of its heads; a mixer that
does not split runs a pack of one long document on every rank (``lit_hbp.packing.mixer_share``). This prices
an 8B-class hybrid of each kind on the paper-shaped mix (``tests/conftest.py``'s recipe) with the analytic
cost model: Nemotron-H-8B's shape (Mamba2 with 8 groups: split by whole groups) and Bamba-9B's (Mamba2 with
one group: split by its 128 heads, the gated norm summed over the ranks), each also as a mixer that does not
split (``mixer_heads`` cleared: the ranks share a pack's documents, one long document run whole by each), so
the gap is what splitting a mixer's heads is worth on those levels. Per model and mixer: the epoch's simulated seconds
with fixed levels (checkpointing the fewest layers that fit), the dense share of the SP levels' time, and the
levels the analytic search picks.
Simulated, not measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from lit_hbp.autoselect.search import analytic_levels
from lit_hbp.cost.costmodel import HARDWARE
from lit_hbp.cost.run_settings import Settings, cost_model
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level
from lit_hbp.report import format_table
from lit_hbp.simulate.simulator import compare, fill_checkpointing

# config.json fields of the published checkpoints (nvidia/Nemotron-H-8B-Base-8K, ibm-ai-platform/Bamba-9B),
# the layer pattern of Nemotron-H-8B: 24 Mamba2, 4 attention, 24 MLP blocks
NEMOTRON_H_8B = dict(
    model_type="nemotron_h", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=21504, vocab_size=131072, n_groups=8, mamba_num_heads=128,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    layers_block_type=[
        {"M": "mamba", "-": "mlp", "*": "attention"}[c]
        for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    ],
)  # fmt: skip
BAMBA_9B = dict(
    model_type="bamba", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, mamba_n_groups=1, mamba_n_heads=128, attn_layer_indices=[9, 18, 27],
)  # fmt: skip


def mamba2_params(hidden: int, heads: int, head_dim: int, groups: int, state: int, kernel: int = 4) -> float:
    """A Mamba2 mixer's matrices: ``in_proj`` (gate, x, B and C per group, a step per head), the depthwise
    convolution over x, B and C, ``out_proj``."""
    inner = heads * head_dim
    conv = inner + 2 * groups * state
    return hidden * (inner + conv + heads) + conv * kernel + inner * hidden


def shaped(spec: ModelSpec, mixer: float, per_kind: dict[str, float], kinds: list[str]) -> ModelSpec:
    """``spec`` with its layers' matmul parameters counted by kind (the config path prices every layer as
    attention and a gated MLP), as ``causal_lm.model_spec`` counts a built model's."""
    per_layer = sum(per_kind[k] for k in kinds) / len(kinds)
    return replace(spec, active_layer_params=per_layer, total_layer_params=per_layer, mixer_params=mixer)


LEVELS = [Level(8192), Level(32768, 2, 0, ulysses=2), Level(65536, 4, 0, ulysses=4), Level(131072, 8, 0, ulysses=8)]


def paper_mix(n: int, seed: int = 20250310) -> np.ndarray:
    """Log-normal chats and log-uniform long samples (1 in 200), as the tests' ``paper_shaped_mix``."""
    rng = np.random.default_rng(seed)
    short = np.clip(np.rint(rng.lognormal(np.log(700), 1.1, n)), 32, 32768)
    long_ = np.rint(np.exp(rng.uniform(np.log(8192), np.log(131072), max(1, n // 200))))
    return rng.permutation(np.r_[short, long_]).astype(np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--samples", type=int, default=50_000)
    args = p.parse_args()
    lengths = paper_mix(args.samples)
    settings = Settings(args.gpus, HARDWARE[args.gpu], 2, False)
    rows = []
    for name, config in (("nemotron_h 8B", NEMOTRON_H_8B), ("bamba 9B", BAMBA_9B)):
        spec = ModelSpec.from_config(config, name)
        attention = 4096 * (32 * 128 * 2 + 8 * 128 * 2)
        if config["model_type"] == "nemotron_h":  # Mamba2 (128 heads of 64 over 8 groups), attention, relu^2 MLP
            mixer = mamba2_params(4096, 128, 64, 8, 128)
            kinds = {"mamba": mixer, "attention": attention, "mlp": 2 * 4096 * 21504}
            spec = shaped(spec, mixer, kinds, config["layers_block_type"])
        else:  # Bamba: every layer a Mamba2 (128 heads of 64, one group) or attention, then a gated MLP
            mixer = mamba2_params(4096, 128, 64, 1, 128)
            kinds = {"m": mixer + 3 * 4096 * 14336, "a": attention + 3 * 4096 * 14336}
            spec = shaped(spec, mixer, kinds, ["a" if i in config["attn_layer_indices"] else "m" for i in range(32)])
        for mixer, heads in ((f"split by {spec.mixer_heads}", spec.mixer_heads), ("not split", None)):
            cost = cost_model(replace(spec, mixer_heads=heads), settings)
            start = time.perf_counter()
            levels = fill_checkpointing(LEVELS, cost, lengths)
            sim = next(s for s in compare(lengths, cost, levels, 1, 0) if s.name == "HBP")
            sp = sim.group_sp > 1
            dense = float((sim.parts["dense"][sp] * sim.group_sp[sp]).sum())
            busy = float((sim.parts["total"][sp] * sim.group_sp[sp]).sum())
            searched = analytic_levels(cost, lengths, 0).levels
            rows.append(
                dict(
                    name=f"{name}, mixers {mixer}",
                    fixed=", ".join(f"{lv.pack_len // 1024}K:sp{lv.sp}:ckpt{lv.ckpt_layers}" for lv in levels),
                    epoch_s=sim.seconds,
                    sp_dense_share=dense / busy,
                    searched=", ".join(f"{lv.pack_len // 1024}K:sp{lv.sp}:ckpt{lv.ckpt_layers}" for lv in searched),
                    took_s=time.perf_counter() - start,
                )
            )
    print(f"{args.gpus} x {args.gpu}, {lengths.size:,} samples ({int(lengths.sum()):,} tokens), ZeRO-2\n")
    columns = [("fixed", "s"), ("epoch_s", ".1f"), ("sp_dense_share", ".2f"), ("searched", "s"), ("took_s", ".1f")]
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
