"""lit-hbp beside the trainers its users run now: same data, same model folder, same optimizer, one pass.

    pip install -e ".[bench]"                      # TRL and its needs: never a dependency of the library
    python bench/peers.py                          # CPU: tiny_cpu.yaml's model, ~200 demo samples, 3 rounds
    python bench/peers.py --size 1b --samples 600 --max-len 8192 --rounds 1     # one GPU
    python bench/peers.py --model /models/my-llama --data tokens.jsonl          # your model and data

Modes, all reading one pre-tokenized file (``input_ids`` and ``labels``, -100 where a token is not
trained) and one ``save_pretrained`` folder, each trained for one pass with AdamW (betas 0.9/0.95, no
weight decay), --lr with --warmup steps of warm-up and a cosine to 10%, gradient clipping 1.0, seed 0,
fp32 on a CPU and bf16 on a GPU (DeepSpeed's bf16 for lit-hbp, autocast over fp32 weights for the others):

- lit-hbp: the CLI's ``fit`` (``lit_hbp.cli.app.main``) of a config written for the data: levels 1K and
  --max-len, bfd packing, one pack per optimizer step; on a GPU, HBPStrategy ZeRO-2 with compiled layers;
- trl-bfd: TRL's ``SFTTrainer``, ``packing=True, packing_strategy="bfd"`` (padding-free), --max-len, one
  pack per step;
- trl-nopack: ``SFTTrainer`` without packing, --batch-size samples per step padded to the longest;
- hf-padding: Hugging Face ``Trainer`` with dynamic padding (``DataCollatorForSeq2Seq``) and length-
  grouped batches of --batch-size.

Hugging Face modes run flash-attention 2 on a GPU when flash-attn is installed, else sdpa, with
``use_cache=False`` (with the cache on, transformers skips its packed-sequence detection and a
padding-free forward lets samples attend to each other: the ``control`` row of the check shows it).
Every round runs each mode in its own process, the order rotated between rounds. Seconds run from
after the imports to the end of the pass (model load, data preparation, training); steady tokens/s
leaves out the first optimizer step (compilation, warm-up). Padding is computed over real tokens.

The check: each mode's own collator and loss on the same 8 samples, before training, against each
sample alone through the model with eager attention; max |difference| of a token's cross-entropy
(a mode that lets samples see each other differs by ~0.1 and more).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("lit-hbp", "trl-bfd", "trl-nopack", "hf-padding")
SIZES = {"tiny": ROOT / "configs" / "tiny_cpu.yaml", "1b": ROOT / "configs" / "llama_1b_1gpu.yaml"}
CHECK_SAMPLES = 8
GENERATION_TEMPLATE = (  # the demo's template with {% generation %} around what an assistant turn trains
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ m['content'] }}"
    "<|end|>\n{% endgeneration %}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
)


# ----------------------------------------------------------------------------------------------- set-up


def build_model(out: Path, size: str, tokenizer: str, max_len: int) -> Path:
    """A randomly initialized Llama folder of the config's shape (``save_pretrained``, tokenizer beside)."""
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape = dict(yaml.safe_load(SIZES[size].read_text())["model"]["model"])
    shape["max_position_embeddings"] = max(max_len, 4096)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=len(tok), **ids, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_data(out: Path, demo_dir: Path, samples: int, long: int, max_len: int, seed: int) -> dict:
    """``samples`` demo chats and up to ``long`` long-context samples of at most ``max_len`` tokens,
    rendered and masked by transformers (``apply_chat_template``'s assistant mask), one JSON line each."""
    import random

    from transformers import AutoTokenizer

    from lit_hbp.demo.text import ensure_demo

    paths = ensure_demo(demo_dir)["paths"]
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    rng = random.Random(seed)

    def chats(name: str) -> list[list[dict]]:
        with open(paths[name], encoding="utf-8") as f:
            return [json.loads(line)["messages"] for line in f if line.strip()]

    def encode(messages: list[dict]) -> dict:
        enc = tok.apply_chat_template(
            messages, chat_template=GENERATION_TEMPLATE, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        ids = list(enc["input_ids"])
        return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, enc["assistant_masks"])]}

    short = chats("short")
    rng.shuffle(short)
    records = [r for r in map(encode, short[: samples * 2]) if len(r["input_ids"]) <= max_len][:samples]
    longs = [r for r in map(encode, chats("long")) if len(r["input_ids"]) <= max_len][:long]
    records += longs
    rng.shuffle(records)
    with open(out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return {"samples": len(records), "long": len(longs), "tokens": sum(len(r["input_ids"]) for r in records)}


def read_records(path: str | Path) -> list[dict]:
    """The data file's ``{input_ids, labels}`` records (an ``attention_mask`` of ones is taken too):
    every mode reads them alike, so a record any mode would read differently is refused with its line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            where = f"{path}:{line_no}"
            extra = sorted(set(r) - {"input_ids", "labels", "attention_mask"})
            if extra:
                raise SystemExit(f"{where}: peers reads input_ids and labels only, not {extra}")
            ids, labels = r.get("input_ids"), r.get("labels")
            if ids is None or labels is None or len(labels) != len(ids) or not ids:
                raise SystemExit(f"{where}: a record needs input_ids and labels of the same, non-zero length")
            if any(x != -100 and x != t for x, t in zip(labels, ids)):
                raise SystemExit(f"{where}: labels are the input ids (shifted by each mode's loss) or -100")
            if any(m != 1 for m in r.get("attention_mask", ())):
                raise SystemExit(f"{where}: attention_mask has zeros: give samples without padding")
            records.append({"input_ids": ids, "labels": labels})
    return records


def check_indices(records: list[dict], max_len: int) -> list[int]:
    """The check's 8 samples: the first 8 of the file with supervised tokens that fit one pack together."""
    picked, total = [], 0
    for i, r in enumerate(records):
        n = len(r["input_ids"])
        if any(x != -100 for x in r["labels"][1:]) and total + n <= max_len:
            picked.append(i)
            total += n
        if len(picked) == CHECK_SAMPLES:
            break
    return picked


def check_records(spec: dict, records: list[dict] | None = None) -> list[dict]:
    records = read_records(spec["data"]) if records is None else records
    return [records[i] for i in spec["check"]]


# ----------------------------------------------------------------------------------------------- workers


def device_and_autocast():
    import contextlib

    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    return device, autocast


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def token_losses(logits, labels, shifted: bool) -> list[float]:
    """Cross-entropy of every supervised token in row-major order; HF labels are shifted here."""
    import torch

    logits = logits.float()
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    keep = labels != -100
    return torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none").tolist()


def worker_reference(spec: dict) -> dict:
    """Each check sample alone through the model with eager attention, and the control: a padding-free
    batch (transformers' DataCollatorWithFlattening) on sdpa with the KV cache left on."""
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    device, autocast = device_and_autocast()
    check = check_records(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="eager", dtype=torch.float32)
    model.to(device).train()
    losses: list[float] = []
    with torch.no_grad(), autocast:
        for r in check:
            ids, labels = torch.tensor([r["input_ids"]], device=device), torch.tensor([r["labels"]], device=device)
            losses += token_losses(model(input_ids=ids, use_cache=False).logits, labels, False)
        model.set_attn_implementation("sdpa")
        flat = DataCollatorWithFlattening(return_position_ids=True)(check)
        ids, positions = flat["input_ids"].to(device), flat["position_ids"].to(device)
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
        control = token_losses(out.logits, flat["labels"].to(device), False)
    return {"token_losses": losses, "control_token_losses": control}


class HFClock:
    """Per-step times and token counts of a Hugging Face trainer (a collator wrapper and a callback)."""

    def __init__(self, collator):
        self.collator, self.real, self.computed, self.steps, self.first = collator, 0, 0, 0, None
        self.first_real: int | None = None  # one batch a step (no accumulation): the first step's tokens

    def __call__(self, features):
        batch = self.collator(features)
        n = batch["input_ids"].numel()
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else n
        self.real += real
        self.computed += n
        if self.first_real is None:
            self.first_real = real
        return batch

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Steps(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                clock.steps += 1
                if clock.first is None:
                    sync()
                    clock.first = (time.perf_counter(), clock.first_real)

        return Steps()


def hf_check(trainer, collator, check: list[dict]) -> tuple[float, list[float]]:
    """The mode's own collator and ``compute_loss`` on the check samples: (loss, token losses)."""
    import torch

    device, autocast = device_and_autocast()
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collator([dict(r) for r in check]).items()}
    with torch.no_grad(), autocast:
        loss, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    return float(loss), token_losses(out.logits, batch["labels"], False)


def worker_hf(spec: dict, mode: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    if mode != "hf-padding":
        from trl import SFTConfig, SFTTrainer

    t0 = time.perf_counter()
    device, _ = device_and_autocast()
    cuda = device.type == "cuda"
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False  # else a padding-free batch is not split into its samples (see the control)
    records = read_records(spec["data"])
    data = Dataset.from_list(records)
    common = dict(
        output_dir=str(Path(spec["result"]).with_suffix(".trainer")), num_train_epochs=1, learning_rate=spec["lr"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=spec["warmup"], adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, use_cpu=not cuda, seed=spec["seed"], report_to=[], logging_strategy="no", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False,  # TRL's default is True
    )  # fmt: skip
    if mode == "hf-padding":
        fields = TrainingArguments.__dataclass_fields__
        grouped = (
            {"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in fields
            else {"group_by_length": True}
        )  # fmt: skip
        args = TrainingArguments(per_device_train_batch_size=spec["batch_size"], **grouped, **common)
        collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
        clock = HFClock(collator)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=clock, processing_class=tok)
    else:
        packing = mode == "trl-bfd"
        args = SFTConfig(
            per_device_train_batch_size=1 if packing else spec["batch_size"], packing=packing,
            packing_strategy="bfd", max_length=spec["max_len"], dataset_num_proc=None, **common,
        )  # fmt: skip
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        collator = trainer.data_collator
        clock = HFClock(collator)
        trainer.data_collator = clock
    trainer.add_callback(clock.callback())
    result: dict = {"attention": attn}
    if spec["check_now"]:  # not training: its time is left out of the mode's seconds
        start = time.perf_counter()
        result["check_loss"], result["check_token_losses"] = hf_check(trainer, collator, check_records(spec, records))
        result["check_seconds"] = time.perf_counter() - start
        t0 += result["check_seconds"]
    trainer.train()
    sync()
    end = time.perf_counter()
    first_end, first_real = clock.first or (end, 0)
    result.update(
        seconds=end - t0, steady_seconds=end - first_end, real_tokens=clock.real, computed_tokens=clock.computed,
        steady_tokens=clock.real - first_real, steps=clock.steps,
    )  # fmt: skip
    return result


def lit_hbp_config(spec: dict, out: Path) -> Path:
    """The config a user writes for this data and model: levels 1K and --max-len, one pack per step."""
    import yaml

    cuda = spec["cuda"]
    levels = [{"pack_len": n, "sp": 1} for n in sorted({min(1024, spec["max_len"]), spec["max_len"]})]
    trainer = {
        "accelerator": "gpu" if cuda else "cpu", "devices": 1, "precision": "bf16-mixed" if cuda else "32-true",
        "max_epochs": 1, "accumulate_grad_batches": 1, "gradient_clip_val": 1.0, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "use_distributed_sampler": False, "num_sanity_val_steps": 0,
    }  # fmt: skip
    if cuda:
        trainer["strategy"] = {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"stage": 2}}
    config = {
        "seed_everything": spec["seed"],
        "trainer": trainer,
        "data": {
            "sources": [{"path": spec["data"], "format": "tokens"}], "tokenizer": spec["model"], "levels": levels,
            "packer": "bfd", "over_length": "error", "cache_dir": str(out / "data_cache"), "seed": spec["seed"],
        },
        "model": {
            "model": spec["model"], "loss": "ave_token", "lr": spec["lr"], "weight_decay": 0.0,
            "betas": [0.9, 0.95], "warmup_steps": spec["warmup"], "min_lr_ratio": 0.1, "compile": cuda,
        },
    }  # fmt: skip
    path = out / "lit_hbp.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def lit_hbp_check(spec: dict, check: list[dict]) -> tuple[float, list[float]]:
    """``packed_loss`` and the prepared model's logits on a pack of the check samples."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model

    device, autocast = device_and_autocast()
    model = prepare_model(AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)).to(device)
    n_targets = sum(sum(x != -100 for x in r["labels"][1:]) for r in check)
    batch = pack_samples(check, loss_norm=n_targets).to(device)
    with torch.no_grad(), autocast:
        loss = packed_loss(model, batch).loss
        logits = model(**pack_inputs(batch)).logits
    return float(loss), token_losses(logits, batch.labels, True)


def worker_lit_hbp(spec: dict) -> dict:
    import lightning as L

    from lit_hbp.cli.app import main as cli_main
    from lit_hbp.model import attention

    result: dict = {}
    if spec["check_now"]:
        start = time.perf_counter()
        result["check_loss"], result["check_token_losses"] = lit_hbp_check(spec, check_records(spec))
        result["check_seconds"] = time.perf_counter() - start
    t0 = time.perf_counter()
    config = lit_hbp_config(spec, Path(spec["work"]))
    clock = {"real": 0, "computed": 0, "steps": 0, "first": None}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock["real"] += int(batch.n_tokens)
            clock["computed"] += int(batch.pack_len)
            clock["steps"] += 1
            if clock["first"] is None:
                sync()
                clock["first"] = (time.perf_counter(), int(batch.n_tokens))  # one micro-batch a step

    cli = cli_main(["--config", str(config)], run=False)
    cli.trainer.callbacks.append(Clock())
    cli.trainer.fit(cli.model, cli.datamodule)
    chosen = sorted({c["backend"] for c in attention.choices(cli.model.model)})  # its packed calls' backends
    result["attention"] = "lit-hbp varlen: " + ", ".join(chosen)
    sync()
    end = time.perf_counter()
    first_end, first_real = clock["first"] or (end, 0)
    result.update(
        seconds=end - t0, steady_seconds=end - first_end, real_tokens=clock["real"],
        computed_tokens=clock["computed"], steady_tokens=clock["real"] - first_real, steps=clock["steps"],
    )  # fmt: skip
    return result


# What each mode's worker imports, imported first as lit-hbp's command line imports (``heap_left_alone``).
WORKER_IMPORTS = {
    "reference": ("transformers.modeling_utils",),
    "lit-hbp": ("lit_hbp.cli.app",),
    "hf-padding": ("datasets", "transformers.trainer"),
}


def worker(spec_path: str, mode: str) -> int:
    from lit_hbp.cli.command import heap_left_alone

    with heap_left_alone():  # without the cyclic collector's walks over the imports (~2 s a process), frozen after
        for name in WORKER_IMPORTS.get(mode, (*WORKER_IMPORTS["hf-padding"], "trl.trainer.sft_trainer")):
            if importlib.util.find_spec(name) is not None:  # a missing TRL is said below
                importlib.import_module(name)
    spec = json.loads(Path(spec_path).read_text())
    if mode == "reference":
        result = worker_reference(spec)
    elif mode == "lit-hbp":
        result = worker_lit_hbp(spec)
    else:
        if mode != "hf-padding" and importlib.util.find_spec("trl") is None:
            raise SystemExit(f"{mode} needs TRL: pip install -e '.[bench]'")
        result = worker_hf(spec, mode)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------- driver


def run_worker(spec: dict, mode: str, log: Path, timeout: float) -> dict:
    """One mode in its own process; its result, or ``{"error": ...}`` naming the log."""
    spec_path = Path(spec["result"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--spec", str(spec_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        try:
            code = subprocess.run(  # in the work folder: what a mode writes by a relative path lands there
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=spec["work"]
            ).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:.0f} s (log: {log})"}
    if code or not Path(spec["result"]).exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {"error": f"exit {code}: {tail[0][:200]} (log: {log})"}
    return json.loads(Path(spec["result"]).read_text())


def max_diff(got: list[float] | None, ref: list[float]) -> float | None:
    """Largest |difference| of a token's cross-entropy; None when the modes supervise different tokens."""
    if got is None or len(got) != len(ref):
        return None
    return max(abs(a - b) for a, b in zip(got, ref))


def summarize(runs: dict[str, list[dict]], reference: dict, tol: float) -> dict[str, dict]:
    """Per mode: real tokens, padding, seconds (median, min, max), tokens/s, time ratio to lit-hbp, steady
    tokens/s, and the check (max token-loss difference to one-by-one, kept apart or not)."""
    ref = reference.get("token_losses", [])
    ref_loss = sum(ref) / len(ref) if ref else float("nan")
    out: dict[str, dict] = {}
    for mode, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row: dict = {"rounds": len(results), "errors": [r["error"] for r in results if "error" in r]}
        if ok:
            secs = [r["seconds"] for r in ok]
            steady = [r["steady_tokens"] / r["steady_seconds"] for r in ok if r["steady_seconds"] > 0]
            row.update(
                real_tokens=ok[0]["real_tokens"], computed_tokens=ok[0]["computed_tokens"], steps=ok[0]["steps"],
                padding=1 - ok[0]["real_tokens"] / max(ok[0]["computed_tokens"], 1), attention=ok[0]["attention"],
                median_s=statistics.median(secs), min_s=min(secs), max_s=max(secs),
                tokens_per_s=ok[0]["real_tokens"] / statistics.median(secs),
                steady_tokens_per_s=statistics.median(steady) if steady else None,
            )  # fmt: skip
            checked = next((r for r in ok if "check_token_losses" in r), None)
            if checked is not None:
                diff = max_diff(checked["check_token_losses"], ref)
                row.update(
                    check_max_diff=diff, check_loss=checked["check_loss"],
                    check_loss_diff=checked["check_loss"] - ref_loss, apart=diff is not None and diff <= tol,
                )  # fmt: skip
        out[mode] = row
    base = out.get("lit-hbp", {}).get("median_s")
    for row in out.values():
        row["vs_lit_hbp"] = row["median_s"] / base if base and "median_s" in row else None
    return out


def markdown(summary: dict[str, dict], control: float | None, tol: float) -> str:
    def f(x, spec):
        return "" if x is None else format(x, spec)

    lines = [
        "| mode | attention | real tokens | padding | steps | seconds (median, min-max) | tokens/s | time vs lit-hbp "
        "| steady tokens/s | check: max token-loss diff | kept apart |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in summary.items():
        if "median_s" not in r:
            lines.append(f"| {mode} | failed: {'; '.join(r['errors'])} |" + " |" * 9)
            continue
        apart = {True: "yes", False: "**NO**", None: ""}[r.get("apart")]
        diff = r.get("check_max_diff")
        lines.append(
            f"| {mode} | {r['attention']} | {r['real_tokens']:,} | {r['padding']:.3f} | {r['steps']} | "
            f"{r['median_s']:.1f} ({r['min_s']:.1f}-{r['max_s']:.1f}) | {r['tokens_per_s']:,.0f} | "
            f"{f(r['vs_lit_hbp'], '.2f')}x | {f(r['steady_tokens_per_s'], ',.0f')} | "
            f"{'different tokens' if diff is None and 'check_loss' in r else f(diff, '.1e')} | {apart} |"
        )
    if control is not None:
        lines.append(
            f"\ncontrol: a padding-free batch on sdpa with the KV cache on differs by {control:.2e} "
            f"(samples see each other); tolerance for kept apart: {tol:g}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the model built when --model is not given")
    p.add_argument("--model", help="a save_pretrained folder (its tokenizer beside) instead of a built one")
    p.add_argument("--data", help="a JSON Lines file of {input_ids, labels} records instead of the demo's")
    p.add_argument("--samples", type=int, default=200, help="demo chats in the built data")
    p.add_argument("--long", type=int, default=8, help="demo long-context samples (<= --max-len) added to them")
    p.add_argument("--max-len", type=int, default=4096, help="pack length of the packing modes, longest sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step of the padding modes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5, help="warm-up optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, help="kept apart when no token's loss differs more (1e-3 fp32, 0.1 bf16)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one mode's process may run")
    p.add_argument("--work", default=str(ROOT / "runs" / "peers"), help="model, data, logs and results")
    p.add_argument("--demo-dir", default=str(ROOT / "demo_data"))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.spec, args.worker)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if any(m.startswith("trl") for m in modes) and importlib.util.find_spec("trl") is None:
        p.error("the trl modes need TRL: pip install -e '.[bench]' (or leave them out with --modes)")
    from lit_hbp.cli.command import heap_left_alone

    with heap_left_alone():  # as the workers' imports (the model and data built here)
        import torch
        import transformers.modeling_utils  # noqa: F401

    cuda = torch.cuda.is_available()
    tol = args.tol if args.tol is not None else (0.1 if cuda else 1e-3)
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model).resolve()
    else:
        from lit_hbp.demo.text import ensure_demo

        tokenizer = ensure_demo(args.demo_dir)["paths"]["tokenizer"]
        model = build_model(work / f"model_{args.size}", args.size, tokenizer, args.max_len)
    if args.data:
        data = Path(args.data).resolve()
        info = {"file": str(data)}
    else:
        data = work / "data.jsonl"
        info = build_data(data, Path(args.demo_dir), args.samples, args.long, args.max_len, args.seed)
    records = read_records(data)
    longest = max(len(r["input_ids"]) for r in records)
    if longest > args.max_len:
        p.error(f"{data}: a sample holds {longest} tokens, over --max-len {args.max_len}: no mode would train it whole")
    info.update(samples=len(records), tokens=sum(len(r["input_ids"]) for r in records), longest=longest)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"peers: {device}, {info['samples']} samples, {info['tokens']:,} tokens (longest {longest}), model {model}")
    spec = dict(
        model=str(model), data=str(data), check=check_indices(records, args.max_len), max_len=args.max_len,
        batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, seed=args.seed, cuda=cuda, work=str(work),
    )  # fmt: skip
    logs = work / "logs"
    ref_spec = {**spec, "result": str(work / "reference.json")}
    reference = run_worker(ref_spec, "reference", logs / "reference.log", args.timeout)
    if "error" in reference:
        print(f"reference: {reference['error']}", file=sys.stderr)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    control = max_diff(reference.get("control_token_losses"), reference.get("token_losses", []))

    def report() -> dict:
        return {
            "device": device, "data": info, "model": str(model),
            "settings": {k: v for k, v in vars(args).items() if v is not None}, "tolerance": tol,
            "control_max_diff": control, "modes": summarize(runs, reference, tol), "runs": runs,
        }  # fmt: skip

    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            result = run_worker(
                {**spec, "check_now": r == 0, "result": str(work / f"{mode}-{r}.json")}, mode,
                logs / f"{mode}-{r}.log", args.timeout,
            )  # fmt: skip
            runs[mode].append(result)
            said = result.get("error") or f"{result['seconds']:.1f} s, {result['real_tokens']:,} tokens"
            print(f"  round {r + 1}/{args.rounds} {mode}: {said}", flush=True)
            if args.json:  # after every run: a run stopped from outside still leaves what it measured
                Path(args.json).write_text(json.dumps(report(), indent=1))
    summary = summarize(runs, reference, tol)
    table = markdown(summary, control, tol)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    failed = [m for m, r in summary.items() if r["errors"]] + (["reference"] if "error" in reference else [])
    if summary.get("lit-hbp", {}).get("apart") is False:
        failed.append("lit-hbp's check")
    if failed:
        print(f"peers: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
