"""Per-level step time and peak memory with no layer vs every layer activation-checkpointed.

    python bench/ckpt_memory.py --config configs/tiny_cpu.yaml [--device cpu] [--steps 3]
    python bench/ckpt_memory.py --config configs/tiny_cpu.yaml --device cuda --hidden 1024 --layers 24 --heads 16

For each level of the config (sp 1, one device), real training steps of the config's model through
HBPStrategy (DeepSpeed ZeRO-2, AdamW) on a pack filled from the config's data lengths, timed by the
same profiler the measured level auto-selection uses. One discarded probe warms the device up
first (CUDA context, kernels, allocator); then --repeats rounds alternate which setting runs first,
and each time is the median over the rounds. Memory is measured two ways: the bytes autograd keeps for backward
(every saved tensor's storage, counted once, through ``saved_tensors_hooks``; non-reentrant
checkpointing installs its own inner hook, so what it drops is not counted): exact on any device;
and on a GPU the peak CUDA allocation. (On CPU the peak resident set size mostly measures the
process and the allocator, so it is not shown.)
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from lit_hbp.autoselect.measured import MeasuredProfiler, synthetic_batch
from lit_hbp.cost.config import model_config, read_config
from lit_hbp.lightning.config_data import config_lengths
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.packing.levels import as_level
from lit_hbp.report import format_table

MIB = 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="rounds per setting, alternating their order")
    p.add_argument("--hidden", type=int, help="override the model: hidden size (intermediate = 3x)")
    p.add_argument("--layers", type=int, help="override the model: decoder layers")
    p.add_argument("--heads", type=int, help="override the model: attention heads (kv heads = heads / 2)")
    args = p.parse_args()
    config = read_config(args.config)
    lengths, vocab, _ = config_lengths(config)
    model = dict(model_config(config, vocab))
    if args.hidden:
        model.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        model["num_hidden_layers"] = args.layers
    if args.heads:
        model.update(num_attention_heads=args.heads, num_key_value_heads=max(args.heads // 2, 1))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def factory() -> HBPLitModule:
        torch.manual_seed(0)
        return HBPLitModule(model=model)

    layers = model["num_hidden_layers"]
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    trainer_args = dict(accelerator=device.type, devices=1, precision=precision)
    profiler = MeasuredProfiler(factory, lengths, float("inf"), trainer_args, dict(stage=2), steps=args.steps)
    module = factory()
    module.configure_model()
    module = module.to(device=device, dtype=dtype).train()
    rows = []
    levels = [as_level(x) for x in config["data"]["levels"]]
    profiler.probe(levels[0].pack_len, 1, layers)  # warm-up, discarded
    settings = ((0, "none"), (layers, "all"))
    for level in levels:
        batch = synthetic_batch(lengths, level.pack_len, 1, 0, model["vocab_size"], 0, np.random.default_rng(0))
        batch = batch.to(device)
        row = dict(name=f"{level.pack_len} tokens")
        runs = {tag: [] for _, tag in settings}
        for r in range(args.repeats):
            for ckpt, tag in settings if r % 2 == 0 else settings[::-1]:
                runs[tag].append(profiler.probe(level.pack_len, 1, ckpt))
        for ckpt, tag in settings:
            row[f"step_s_{tag}"] = float(np.median([m.seconds for m in runs[tag]]))
            saved = saved_for_backward(module, batch.replace(ckpt_layers=ckpt))
            row[f"saved_for_backward_mib_{tag}"] = saved / MIB
            if device.type == "cuda":
                row[f"peak_mib_{tag}"] = max(m.memory for m in runs[tag]) / MIB
        row["time_cost"] = row["step_s_all"] / row["step_s_none"] - 1
        row["activation_saving"] = 1 - row["saved_for_backward_mib_all"] / row["saved_for_backward_mib_none"]
        rows.append(row)
    params = sum(p.numel() for p in module.parameters()) / 1e6
    print(f"{params:.1f}M-parameter model, {layers} layers, {device.type} {dtype}, sp 1\n")
    cols = [
        (k, "+.1%" if k in ("time_cost", "activation_saving") else ".3f" if k.startswith("step") else ".1f")
        for k in rows[0]
        if k != "name"
    ]
    print(format_table(rows, cols))
    return 0


def saved_for_backward(module: HBPLitModule, batch: dict) -> int:
    """Bytes of the distinct tensor storages autograd keeps for the backward of one micro-step."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(batch)[0]
    loss.backward()
    module.zero_grad(set_to_none=True)
    return sum(storages.values())


if __name__ == "__main__":
    sys.exit(main())
