"""HBP on a vision-language mix, with and without the vision tower's work in the balance, in the cluster
simulator (docs/vision.md).

    python bench/vlm_balance.py [--world 8] [--samples 40000] [--seed 0]

The mix (seeded): text chats of 100-8K tokens (35%), one-image chats (35%), 2-6 image chats (20%) and
videos of 10K-120K tokens (10%); an image is 256-2,048 tokens after merging. The model: Qwen2.5-VL-7B's
shape (a 28-layer 3584-wide language model; a 32-layer 1280-wide vision tower, 14-pixel patches, 2x2
merge: four patches per image token, two frames per video patch). Each sample's encoder work comes from
``lit_hbp.data.media.encoder_flops`` (checked against torch's FLOP counter in tests/test_vision_data.py)
and is priced in every plan alike (the tower trained: its forward, backward and, on a level that
checkpoints, its recompute); rows differ only in how they pack and order. 8 x H100 by default, levels
16K sp 1 and 128K sp 8 with checkpointing filled in by the simulator (``fill_checkpointing``, the tower's
memory counted), and a last row on the levels the analytic search chooses knowing the tower
(``analytic_levels(vision=...)``).
"""

from __future__ import annotations

import argparse

import numpy as np
from transformers import AutoConfig

from lit_hbp.autoselect.search import analytic_levels, with_vision
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.data.media import vision_load
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level, plan_hbp, plan_single_level
from lit_hbp.simulate.simulator import fill_checkpointing, price

QWEN25_VL_7B = dict(  # the published Qwen2.5-VL-7B-Instruct config's shape
    model_type="qwen2_5_vl",
    text_config=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, vocab_size=152064),
    vision_config=dict(depth=32, hidden_size=1280, out_hidden_size=3584, intermediate_size=3420, num_heads=16,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
)  # fmt: skip
CONFIG = AutoConfig.for_model(**QWEN25_VL_7B)
LM = ModelSpec.from_config(CONFIG.to_dict(), name="qwen2.5-vl-7b")
PIXELS_PER_TOKEN = 4 * 14 * 14 * 2  # 2x2 merged patches of 14x14 pixels, each pixel once per frame of a pair
FRAME_TOKENS = (448 // 28) ** 2  # a temporal patch (two 448x448 frames): its tokens after the 2x2 merge


def mix(n: int, seed: int) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """(lengths, per sample its images' (pixels, tiles)) of the vision-language mix."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(4, size=n, p=[0.35, 0.35, 0.20, 0.10])
    text = np.exp(rng.uniform(np.log(100), np.log(8192), n)).astype(np.int64)
    lengths, images = np.zeros(n, np.int64), []
    for i, kind in enumerate(kinds.tolist()):
        if kind == 3:  # a video: one sequence of frames, 10K-120K tokens
            tokens = [int(np.exp(rng.uniform(np.log(10_000), np.log(120_000))))]
        else:
            count = (0, 1, int(rng.integers(2, 7)))[kind]
            tokens = [int(np.exp(rng.uniform(np.log(256), np.log(2048)))) for _ in range(count)]
        lengths[i] = min(int(text[i] // (4 if kind == 3 else 1)) + sum(tokens), 131_072)
        # The tower attends within a frame pair (a temporal patch) of a video: 256 tokens at 448x448 frames
        tiles = [max(1, t // FRAME_TOKENS) if kind == 3 else 1 for t in tokens]
        images.append([(t * PIXELS_PER_TOKEN, k) for t, k in zip(tokens, tiles)])
    return lengths, images


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--samples", type=int, default=40_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lengths, images = mix(args.samples, args.seed)
    load = vision_load(images, CONFIG)
    extra = load.work
    cost = with_vision(CostModel(LM, HARDWARE["h100"], args.world), lengths, load)
    levels = fill_checkpointing([Level(16_384, 1), Level(131_072, min(8, args.world))], cost, lengths)
    chosen = analytic_levels(cost, lengths, args.seed, max_len=131_072, vision=load).levels
    w, s = args.world, args.seed
    runs = [
        ("naive ISF at 128K", plan_single_level(lengths, levels[-1], w, 1, s, "isf", over_length="drop")),
        ("hierarchical, no balance", plan_hbp(lengths, levels, w, 1, s, over_length="drop", balance=False)),
        ("HBP, attention only", plan_hbp(lengths, levels, w, 1, s, over_length="drop")),
        ("HBP with the vision work", plan_hbp(lengths, levels, w, 1, s, over_length="drop", extra_work=extra)),
        ("HBP, auto-selected levels", plan_hbp(lengths, chosen, w, 1, s, over_length="drop", extra_work=extra)),
    ]
    sims = price(runs, cost, extra_work=extra)
    ratio = extra.sum() / (lengths.astype(np.float64) ** 2).sum()
    chosen_text = ", ".join(f"{lv.pack_len}:{lv.sp} ckpt {lv.ckpt_layers}" for lv in chosen)
    print(f"{args.samples} samples, {int(lengths.sum()):,} tokens, {sum(map(len, images)):,} images/videos on "
          f"{w} x {HARDWARE['h100'].name}; the vision tower's work {ratio:.1f}x the language model's attention; levels "
          + ", ".join(f"{lv.pack_len}:{lv.sp} ckpt {lv.ckpt_layers}" for lv in levels)
          + f"; auto-selected {chosen_text}")  # fmt: skip
    base = sims[0].seconds
    print(f"{'plan':<28} {'epoch s':>10} {'idle':>6} {'speed-up':>9}")
    for sim in sims:
        idle = sim.breakdown()["idle"]
        print(f"{sim.name:<28} {sim.seconds:>10.0f} {idle:>6.1%} {base / sim.seconds:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
