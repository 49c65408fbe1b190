"""Training throughput: HBP packed varlen batches vs padded batches vs HF's flattening collator.

    python bench/train_throughput.py [--samples 600] [--max-len 4096] [--batch-size 8] [--device cpu]

All three modes train the same randomly initialized Llama-style model (same seed) for one pass over
the same samples of the embedded demo data (short chats plus long-context samples up to --max-len),
with AdamW, forward + backward + step per batch:

- padded: random batches of --batch-size samples padded to the longest, HF attention with a padding
  mask (what a plain Trainer + DataCollatorWithPadding does);
- hf_trainer_flatten: Hugging Face Trainer with transformers' DataCollatorWithFlattening (each
  batch of --batch-size samples concatenated into one row, position_ids restarting per sample);
- hbp: the HBP plan (levels 1K sp1 and --max-len sp1 on one device) and HBPLitModule's varlen
  attention and chunked cross-entropy.

Throughput counts real sample tokens only (padding is waste); MFU is printed when the device's peak
is known (GPUs by name, or --peak-tflops). Targets: hbp >= 2x padded on the demo data; on a GPU
(--device cuda, bf16 autocast; e.g. --hidden 1024 --layers 24 --heads 16 for a ~0.5B model), hbp
>= 1.0x the HF Trainer, which uses flash-attention-2 when installed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lit_hbp.cost.gpu_peaks import peak_flops
from lit_hbp.data.collate import collate_packs
from lit_hbp.data.sources import Source
from lit_hbp.data.store import SampleStore
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.demo.text import ensure_demo
from lit_hbp.lightning.datamodule import load_tokenizer
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.causal_lm import decoder_layers, unprepare_model
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level, plan_hbp
from lit_hbp.report import format_table

HERE = Path(__file__).resolve().parent


def load_samples(args) -> tuple[SampleStore, np.ndarray, object]:
    demo = ensure_demo(args.demo_dir)["paths"]
    tok = load_tokenizer(demo["tokenizer"])
    sources = [
        tokenize_source(Source(demo[k]), tok, cache_dir=HERE / "cache", progress=False) for k in ("short", "long")
    ]
    store = SampleStore.build(sources, args.max_len, "drop")
    rng = np.random.default_rng(args.seed)
    long_ids = np.flatnonzero(store.source_of == 1)
    short_ids = rng.permutation(np.flatnonzero(store.source_of == 0))[: max(args.samples - long_ids.size, 0)]
    chosen = rng.permutation(np.r_[short_ids, long_ids])
    return store, chosen, tok


def model_config(args, vocab: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": max(args.heads // 2, 1),
        "max_position_embeddings": args.max_len,
        "vocab_size": vocab,
    }


WARMUP = 2  # batches left out of the timing (first-call overheads)


def timed_loop(batches, step_fn, device, warmup: int = WARMUP) -> tuple[float, int, int]:
    """Seconds over all batches after ``warmup`` (excluded), real tokens and computed tokens timed."""
    real = computed = 0
    start = None
    for i, (batch, n_real, n_computed) in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        step_fn(batch)
        if i >= warmup:
            real += n_real
            computed += n_computed
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, real, computed


def autocast(device):
    """bf16 autocast on CUDA (fp32 master weights, as HF Trainer's bf16=True), nothing on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def baseline_copy(model: torch.nn.Module, attn: str, compile_layers: bool = False) -> torch.nn.Module:
    """A peer's model (HF Trainer's, TRL's, a plain loop's): a copy of the prepared ``model`` with lit-hbp's
    preparation undone (``unprepare_model``) and the family's own ``attn``. A prepared copy recognises a
    padding-free batch's restarting positions as a pack and runs lit-hbp's varlen attention inside the peer's
    step (the HF and TRL rows did so until 2026-11-30). With ``compile_layers`` its decoder layers are compiled
    as ``HBPLitModule(compile=True)`` compiles the run's: each layer, dynamic over lengths, the same regions."""
    names = {id(layer) for layer in decoder_layers(model)}
    names = [name for name, module in model.named_modules() if id(module) in names]
    net = unprepare_model(copy.deepcopy(model))
    net.set_attn_implementation(attn)
    net.config.use_cache = False  # with a cache, transformers does not split a padding-free row into its samples
    if compile_layers:
        for name in names:
            net.get_submodule(name).compile(dynamic=True)
    return net


def hf_model(base: HBPLitModule, attn: str, device, dtype=torch.float32):
    return baseline_copy(base.model, attn).to(device=device, dtype=dtype).train()


def run_padded(base, store, chosen, args, device, pad_id):
    net = hf_model(base, "sdpa", device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def batches():
        for a in range(0, chosen.size, args.batch_size):
            group = [store.tokens(int(i)) for i in chosen[a : a + args.batch_size]]
            longest = max(x[0].size for x in group)
            ids = torch.full((len(group), longest), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for r, (x, target) in enumerate(group):
                ids[r, : x.size] = torch.as_tensor(x)
                mask[r, : x.size] = 1
                x = torch.as_tensor(x).long()  # ids stored as uint16 (small vocabularies), where -100 is not one
                labels[r, : x.size(0)] = torch.where(torch.as_tensor(target), x, -100)
            n_real = int(mask.sum())
            yield (ids.to(device), mask.to(device), labels.to(device)), n_real, ids.numel()

    def step(b):
        ids, mask, labels = b
        with autocast(device):
            loss = net(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_loop(batches(), step, device)


def run_hf_trainer(base, store, chosen, args, device):
    """Hugging Face Trainer with DataCollatorWithFlattening (HF's padding-free path)."""
    import tempfile

    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback

    cuda = device.type == "cuda"
    net = hf_model(base, "flash_attention_2" if cuda and _has_flash() else "sdpa", device, torch.float32)
    flatten = DataCollatorWithFlattening(return_position_ids=True)
    counts = []

    def collate(features):
        batch = flatten(features)
        counts.append(int(batch["input_ids"].shape[1]))
        return batch

    data = []
    for i in chosen:
        x, target = store.tokens(int(i))
        x = x.astype(np.int64)  # the store keeps small vocabularies in uint16: -100 would wrap
        data.append({"input_ids": x.tolist(), "labels": np.where(target, x, -100).tolist()})
    steps = -(-len(data) // args.batch_size)
    marks = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            if state.global_step == WARMUP:
                if cuda:
                    torch.cuda.synchronize()
                marks["start"] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        targs = hf_training_args(out, args.batch_size, steps, cuda, seed=args.seed)
        Trainer(model=net, args=targs, train_dataset=data, data_collator=collate, callbacks=[Clock()]).train()
    if cuda:
        torch.cuda.synchronize()
    tokens = sum(counts[WARMUP:steps])
    return time.perf_counter() - marks["start"], tokens, tokens


def hf_training_args(out: str, batch_size: int, steps: int, cuda: bool, args_class=None, **extra):
    """The HF Trainer baseline's settings: AdamW at 1e-4, bf16 autocast on a GPU, no logging, no saving
    (``args_class``: a ``TrainingArguments`` subclass, e.g. TRL's ``SFTConfig``)."""
    from transformers import TrainingArguments

    return (args_class or TrainingArguments)(
        output_dir=out,
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=1e-4,
        bf16=cuda,
        use_cpu=not cuda,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def run_hbp(base, store, chosen, args, device, pad_id):
    module = copy.deepcopy(base).to(device=device).train()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    plan = plan_hbp(
        store.lengths[chosen],
        [Level(1024), Level(args.max_len)],
        1,
        seed=args.seed,
        loss_tokens=store.loss_tokens[chosen],
    )

    def batches():
        for mb in plan.micro_batches(0):
            packs = [chosen[p] for p in mb.packs]
            b = collate_packs(packs, store.tokens, pad_id=pad_id, loss_norm=mb.loss_norm)
            b = b.to(device)
            yield b, b.n_tokens, b.input_ids.shape[1]

    def step(b):
        with autocast(device):
            loss = module(b)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_loop(batches(), step, device)


def _peak_flops(device) -> float | None:
    """bf16 dense peak of the GPU (for MFU), by GPU variant (``lit_hbp.cost.gpu_peaks``)."""
    return peak_flops(device, torch.bfloat16)


def _has_flash() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s of the device for MFU (GPUs: looked up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo-dir", default=str(HERE / "demo_data"))
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    store, chosen, tok = load_samples(args)
    pad_id = tok.pad_token_id
    base = HBPLitModule(model=model_config(args, len(tok)))
    base.configure_model()
    lengths = store.lengths[chosen]
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    print(
        f"{chosen.size} samples, {int(lengths.sum())} tokens (median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}); model {sum(x.numel() for x in base.parameters()) / 1e6:.1f}M params, "
        f"{device.type} {precision}, batch size {args.batch_size} for the baselines\n"
    )
    runs = (
        ("padded", lambda: run_padded(base, store, chosen, args, device, pad_id)),
        ("hf_trainer_flatten", lambda: run_hf_trainer(base, store, chosen, args, device)),
        ("hbp", lambda: run_hbp(base, store, chosen, args, device, pad_id)),
    )
    peak = args.peak_tflops * 1e12 if args.peak_tflops else _peak_flops(device)
    spec = ModelSpec.from_config(base.model.config.to_dict())
    # Model FLOPs per real token, the module's definition (HBPLitModule.micro_batch_flops): dense layers on every
    # real token, each sample's causal attention and the LM head on its supervised tokens, forward and backward,
    # averaged over the data: the same for every mode, each of which trains every chosen sample once.
    tokens = lengths.astype(np.float64)
    supervised = sum(int(np.count_nonzero(store.tokens(int(i))[1][1:])) for i in chosen)
    flops_per_token = spec.train_flops(tokens.sum(), spec.attention_sq(tokens), supervised) / tokens.sum()
    rows = []
    for name, fn in runs:
        try:
            seconds, real, computed = fn()
        except torch.OutOfMemoryError:
            rows.append(dict(name=name, oom=True))
            print(f"{name}: out of memory", file=sys.stderr)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        mfu = real / seconds * flops_per_token / peak if peak else float("nan")
        rows.append(
            dict(
                name=name,
                seconds=seconds,
                real_tokens=real,
                computed_tokens=computed,
                padding=1 - real / computed,
                tokens_per_s=real / seconds,
                mfu=mfu,
            )
        )
    speed = {r["name"]: r.get("tokens_per_s") for r in rows}
    cols = [
        ("seconds", ".1f"),
        ("real_tokens", "d"),
        ("computed_tokens", "d"),
        ("padding", ".3f"),
        ("tokens_per_s", ".0f"),
        ("vs_padded", ".2f"),
        ("vs_hf", ".2f"),
    ] + ([("mfu", ".3f")] if peak else [])
    for r in rows:
        r["vs_padded"] = r["tokens_per_s"] / speed["padded"] if speed["padded"] and not r.get("oom") else float("nan")
        r["vs_hf"] = (
            r["tokens_per_s"] / speed["hf_trainer_flatten"]
            if speed["hf_trainer_flatten"] and not r.get("oom")
            else float("nan")
        )
    table = [
        {"name": r["name"], **{k: "OOM" if k == "tokens_per_s" else "" for k, _ in cols}}
        if r.get("oom")
        else {"name": r["name"], **{k: format(r[k], f) for k, f in cols}}
        for r in rows
    ]
    print(format_table(table, [(k, "s") for k, _ in cols]))
    if rows[-1].get("oom"):
        print("\nhbp ran out of memory: FAIL")
        return 1
    ratio, vs_hf = rows[-1]["vs_padded"], rows[-1]["vs_hf"]
    ok = (np.isnan(ratio) or ratio >= 2) and (device.type != "cuda" or np.isnan(vs_hf) or vs_hf >= 1.0)
    print(
        f"\nhbp vs padded: {ratio:.2f}x (target >= 2x); vs HF Trainer + flattening: {vs_hf:.2f}x "
        f"(target >= 1.0x on a GPU): {'PASS' if ok else 'FAIL'}; a baseline that ran out of memory is not compared"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
