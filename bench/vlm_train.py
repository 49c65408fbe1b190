"""HBP against naive packing on the tiny VLM, measured on CPU (issue 45): the same records, the same
model, each plan's packs really run (forward and backward) and timed.

    python bench/vlm_train.py [--records 300] [--world 4] [--work /tmp/lit_hbp_vlm_train]

Records: the VLM demo's image chats (``lit_hbp.demo.vision``: 17-68 tokens an image) joined into
conversations of 1 to --max-turns turns, most short and a few long (a seeded power law), so lengths
spread from ~30 to ~6K tokens and a long conversation holds up to ~80 images: the spread of
vision-language data, at the tiny model's scale (no videos: the demo's LLaVA-NeXT has no video tower).

Plans, for a world of --world ranks (sp 1 each; the ranks are simulated, the packs are real):

- naive: one level at --long tokens, ISF packing, packs batched in order, no balance;
- hbp_attention: levels 1K and --long, balanced by attention work only;
- hbp: the same levels, balanced by attention plus each sample's vision-tower work
  (``HBPDataModule.vision_work``, what a run plans with).

Every distinct pack is collated as the loader does (images decoded by the processor) and run through
``packed_loss`` on the prepared model (fp32, one thread, median of --repeats); a step costs its slowest
rank's pack, the epoch the sum of its steps. Printed: each plan's epoch seconds, steps, the ranks' idle
share, and HBP's speed-up over naive.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lit_hbp import HBPDataModule, packed_loss, prepare_model
from lit_hbp.data.collate import collate_packs
from lit_hbp.demo.vision import DATA_FILE, MODEL_DIR, ensure_vlm_demo
from lit_hbp.packing import plan_hbp


def conversations(demo: Path, n: int, max_turns: int, seed: int) -> list[dict]:
    """``n`` records, each the messages and images of 1 to ``max_turns`` demo chats (a power law: most
    short), image paths absolute."""
    chats = [json.loads(line) for line in (demo / DATA_FILE).read_text().splitlines()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = min(max_turns, int(rng.paretovariate(1.1)))
        picked = rng.sample(chats, turns)
        record = {"messages": [m for c in picked for m in c["messages"]]}
        images = [str(demo / p) for c in picked for p in c.get("images", [])]
        if images:
            record["images"] = images
        out.append(record)
    return out


def step_costs(plan, seconds) -> np.ndarray:
    """Per optimizer step (one micro-step: accumulate 1), the slowest rank's pack time."""
    out = []
    for s in range(len(plan.step_offsets) - 1):
        packs = range(int(plan.step_offsets[s]), int(plan.step_offsets[s + 1]))
        out.append(max(seconds(plan.members[plan.offsets[p] : plan.offsets[p + 1]]) for p in packs))
    return np.asarray(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=300)
    p.add_argument("--max-turns", type=int, default=60)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--long", type=int, default=8192, help="the longest level (the naive plan's only one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=Path("/tmp/lit_hbp_vlm_train"))
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    demo = args.work / "demo"
    ensure_vlm_demo(demo)
    data = args.work / "mix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(demo, args.records, args.max_turns, args.seed)))
    levels = [{"pack_len": 1024, "sp": 1}, {"pack_len": args.long, "sp": 1}]
    dm = HBPDataModule(sources=[str(data)], tokenizer=str(demo / MODEL_DIR), levels=levels, over_length="drop",
                       cache_dir=str(args.work / "cache"), val_fraction=0.0)  # fmt: skip
    dm.setup("fit")
    store, work = dm.store, dm.vision_work(dm.store)
    lengths = store.lengths
    print(f"{lengths.size} samples, {int(lengths.sum()):,} tokens (longest {int(lengths.max())}), "
          f"{int(store.media_counts().sum())} images; vision work {work.sum() / (lengths**2).sum():.2f}x the "
          "attention's squared lengths", flush=True)  # fmt: skip
    plans = {
        "naive": plan_hbp(lengths, [args.long], args.world, packer="isf", balance=False, seed=args.seed),
        "hbp_attention": plan_hbp(lengths, [1024, args.long], args.world, seed=args.seed),
        "hbp": plan_hbp(lengths, [1024, args.long], args.world, seed=args.seed, extra_work=work),
    }

    from transformers import AutoModelForImageTextToText

    model = prepare_model(AutoModelForImageTextToText.from_pretrained(demo / MODEL_DIR).float())
    inputs = dm._media_inputs(store)
    media = lambda i: inputs.media(store.tokens(i)[0], store.media(i), store.where(i))  # noqa: E731
    timed: dict[tuple, float] = {}

    def seconds(members: np.ndarray) -> float:
        key = tuple(sorted(members.tolist()))
        if not key:
            return 0.0
        if key not in timed:
            batch = collate_packs([members], store.tokens, pad_id=dm.pad_id, media=media)
            runs = []
            for _ in range(args.repeats):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                packed_loss(model, batch, "sum").loss.backward()
                runs.append(time.perf_counter() - start)
            timed[key] = statistics.median(runs)
        return timed[key]

    results = {}
    for name, plan in plans.items():
        costs = step_costs(plan, seconds)
        busy = sum(seconds(plan.members[plan.offsets[k] : plan.offsets[k + 1]]) for k in range(len(plan.offsets) - 1))
        results[name] = {"seconds": float(costs.sum()), "steps": int(costs.size),
                         "idle": float(1 - busy / (args.world * costs.sum()))}  # fmt: skip
        print(f"{name:14s} {costs.sum():8.2f} s  {costs.size:4d} steps  ranks idle {results[name]['idle']:.1%}",
              flush=True)  # fmt: skip
    for name in ("hbp_attention", "hbp"):
        results[name]["speedup"] = results["naive"]["seconds"] / results[name]["seconds"]
        print(f"{name} over naive: {results[name]['speedup']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
