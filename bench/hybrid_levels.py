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
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.cost.run_settings import Settings, cost_model
from lit_hbp.model.causal_lm import configured_spec
from lit_hbp.packing import Level
from lit_hbp.report import format_table
from lit_hbp.simulate.simulator import compare, fill_checkpointing

# config.json fields of the published checkpoints (nvidia/Nemotron-H-8B-Base-8K, ibm-ai-platform/Bamba-9B),
# the layer pattern of Nemotron-H-8B: 24 Mamba2, 4 attention, 24 MLP blocks; each priced as a run prices it
# (``configured_spec``: the model built on the meta device, its layers' matrices counted by kind)
NEMOTRON_H_8B = dict(
    model_type="nemotron_h", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=21504, vocab_size=131072, n_groups=8, mamba_num_heads=128,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
)  # fmt: skip
BAMBA_9B = dict(
    model_type="bamba", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, mamba_n_groups=1, mamba_n_heads=128, attn_layer_indices=[9, 18, 27],
)  # fmt: skip


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
        spec = replace(configured_spec(config), name=name)  # its layers' matrices counted on the meta device
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
