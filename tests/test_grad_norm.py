"""train/grad_norm: the global L2 norm of the gradients before clipping, logged at the optimizer steps
whose metrics the loggers write and at no other, under plain Lightning (where Lightning clips) and
under HBPStrategy (DeepSpeed ZeRO, where the engine clips), full fine-tuning and LoRA.

The reference is computed apart from the module: from the parameters' ``.grad`` by brute force (fp64
sum of squares) where Lightning leaves them in place before clipping, and under ZeRO, whose gradients
are partitioned and never left in ``.grad``, by running every micro-batch of the step again through a
copy of the weights the step started from and adding up the gradients (over the ranks: their mean,
the gradient DeepSpeed and DDP apply)."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA
from distributed import Pool
from lightning.pytorch.loggers import CSVLogger

from lit_hbp.lightning.meter import logs_now
from lit_hbp.lightning.module import HBPLitModule

TINY = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
CLIP = 1e-3  # far below every norm here: clipping changes the gradients at every step
STEPS, ACCUMULATE, EVERY = 4, 2, 2  # optimizer steps 2 and 4 log


def write_chats(path):
    rng = np.random.default_rng(3)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    rows = [{"prompt": " ".join(rng.choice(words, rng.integers(2, 30))), "response": "the lazy dog"} for _ in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("grad_norm") / "d.jsonl")


@pytest.fixture
def in_process_deepspeed():
    """An in-process DeepSpeed fit leaves DeepSpeed holding its process groups: destroyed the DeepSpeed way
    (which releases them), the next fit in this process builds its own."""
    deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    yield
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()


def brute_norm(grads) -> float:
    return float(sum((g.double() ** 2).sum() for g in grads if g is not None) ** 0.5)


class Record(L.Callback):
    """Per optimizer step: whether it logs, the micro-batches and the weights it started from, and
    (where ``.grad`` holds them) the norm of the gradients before and after Lightning's clipping."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.logged: dict[int, float] = {}  # train/grad_norm by optimizer step (1-based), as the module logs it

    def setup(self, trainer, pl_module, stage):
        log = pl_module.log

        def recording(name, value, *args, **kwargs):
            if name == "train/grad_norm":
                self.logged[trainer.global_step] = float(value)
            return log(name, value, *args, **kwargs)

        pl_module.log = recording

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
            vocab = pl_module.hparams.vocab_size
            self.steps.append(dict(batches=[], weights=weights, vocab=vocab, pre=None, post=None, logs=None))
        self.steps[-1]["batches"].append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # callbacks run before the module's hook
        self.steps[-1]["pre"] = brute_norm(p.grad for p in pl_module.model.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.fit_loop._should_accumulate():
            self.steps[-1]["logs"] = logs_now(trainer)
            self.steps[-1]["post"] = brute_norm(p.grad for p in pl_module.model.parameters())


def recomputed_norms(steps, lora, accumulate, world: int = 1) -> list[float]:
    """Each step's gradient again, from its starting weights and micro-batches, apart from the run:
    the loss Lightning backpropagates (the module's, over accumulate), mean over the ranks."""
    module = HBPLitModule(model=TINY, vocab_size=steps[0]["vocab"], lora=lora, self_check=False)
    module.configure_model()
    norms = []
    for step in steps:
        module.model.load_state_dict(step["weights"])
        module.model.zero_grad(set_to_none=True)
        for batch in step["batches"]:
            (module(batch)[0] / accumulate).backward()
        grads = [p.grad.detach().double() for p in module.model.parameters() if p.grad is not None]
        if world > 1:
            flat = torch.cat([g.flatten() for g in grads])
            torch.distributed.all_reduce(flat)
            grads = [flat / world]
        norms.append(brute_norm(grads))
    return norms


def fit(
    data, tokenizer, root, strategy="auto", lora=None, devices=1, logger=True, precision="32-true", self_check=False
) -> tuple[L.Trainer, Record]:
    from lit_hbp.lightning.datamodule import HBPDataModule

    dm = HBPDataModule(
        sources=[{"path": str(data)}], tokenizer=tokenizer, levels=["64:1", "160:1"], cache_dir=str(root / "cache")
    )
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lr=1e-2, lora=lora, self_check=self_check)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        log_every_n_steps=EVERY,
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        logger=CSVLogger(root / "logs", name="run") if logger else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        precision=precision,
    )
    trainer.fit(module, dm)
    return trainer, record


def logged_norms(trainer) -> list[float]:
    """train/grad_norm of every row of the CSV logger's metrics.csv that has it, in order."""
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("train/loss") for r in rows)
    return [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]


def check(logs: list[bool], logged: dict[int, float], reference: list[float], csv_values: list[float] | None = None):
    """Logged at the steps that log only (every EVERY-th), equal to the reference there, before clipping."""
    assert logs == [(i + 1) % EVERY == 0 for i in range(STEPS)]
    assert sorted(logged) == list(range(EVERY, STEPS + 1, EVERY))
    expected = [ref for log, ref in zip(logs, reference) if log]
    logged = [logged[k] for k in sorted(logged)]
    np.testing.assert_allclose(logged, expected, rtol=2e-5)
    if csv_values is not None:  # what the logger wrote
        np.testing.assert_allclose(csv_values, expected, rtol=1e-6)
    assert all(value > 100 * CLIP for value in logged)  # before clipping


def test_a_float64_run_passes_its_self_check_and_logs_the_float64_norm(chats, toy_tokenizer, tmp_path):
    """``precision: 64-true``: the loss, the self-check's reference and the gradient norm stay in float64 (they
    were taken in fp32: the self-check failed at float64's tolerances, the norm raised). Reference: the brute
    force fp64 norm of ``.grad`` (the logger keeps fp32)."""
    trainer, record = fit(chats, toy_tokenizer, tmp_path, precision="64-true", self_check=True)
    steps = record.steps
    assert all(p.dtype == torch.float64 for p in trainer.lightning_module.parameters())
    logged = [record.logged[k] for k in sorted(record.logged)]
    np.testing.assert_allclose(logged, [s["pre"] for s in steps if s["logs"]], rtol=1e-7)  # logged as fp32
    assert trainer.callback_metrics["train/loss"] > 0


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_plain_lightning_logs_the_norm_before_clipping_at_logging_steps(chats, toy_tokenizer, tmp_path, lora):
    trainer, record = fit(chats, toy_tokenizer, tmp_path, lora=lora)
    steps = record.steps
    check([s["logs"] for s in steps], record.logged, [s["pre"] for s in steps], logged_norms(trainer))
    for s in steps:  # Lightning did clip the gradients the reference saw
        assert s["post"] == pytest.approx(CLIP, rel=1e-3) and s["pre"] > 100 * CLIP
    if lora is None:  # the brute force of .grad is itself independent of how the module ran the step
        np.testing.assert_allclose([s["pre"] for s in steps], recomputed_norms(steps, None, ACCUMULATE), rtol=1e-4)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_zero2_logs_deepspeeds_norm_before_clipping_at_logging_steps(
    chats, toy_tokenizer, tmp_path, lora, in_process_deepspeed, caplog
):
    from lit_hbp.lightning.strategy import HBPStrategy

    caplog.set_level(logging.INFO)
    trainer, record = fit(chats, toy_tokenizer, tmp_path, HBPStrategy(stage=2), lora=lora)
    (setup,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HBPStrategy levels:")]
    assert setup.endswith("ZeRO stage 2 (one process: nothing sharded; --trainer.strategy hbp_ddp trains the same "
                          "levels with a lighter step, docs/gpu.md)")  # fmt: skip
    assert all(s["pre"] == 0 for s in record.steps)  # ZeRO keeps the gradients in its partitions, not in .grad
    reference = recomputed_norms(record.steps, lora, ACCUMULATE)
    check([s["logs"] for s in record.steps], record.logged, reference, logged_norms(trainer))


def _zero2_two_ranks(data, tokenizer, root):
    from lit_hbp.lightning.strategy import HBPStrategy

    rank = torch.distributed.get_rank()
    _, record = fit(data, tokenizer, Path(root) / f"rank{rank}", HBPStrategy(stage=2), devices=2, logger=False)
    reference = recomputed_norms(record.steps, None, ACCUMULATE, world=2)
    local = recomputed_norms(record.steps, None, ACCUMULATE)  # this rank's own gradient alone
    logs = [step["logs"] for step in record.steps]
    return dict(logs=logs, logged=dict(record.logged), reference=reference, local=local)


def check_two_ranks(pool: Pool, tokenizer: str, root) -> None:
    """ZeRO-2 on the two ranks of ``pool``: the logged norm is that of the mean of the ranks' gradients
    (what DeepSpeed applies), the same on both, and not either rank's own. Run by
    tests/test_export.py, whose pool of two processes it shares (starting one costs more than the run)."""
    data = write_chats(root / "d.jsonl")
    results = pool.run(_zero2_two_ranks, str(data), tokenizer, str(root), timeout=300)
    for r in results:
        check(r["logs"], r["logged"], r["reference"])
        assert all(abs(g - n) > 1e-3 * g for g, n in zip(r["reference"], r["local"]))  # not a rank's own norm
    assert results[0]["logged"] == results[1]["logged"]
