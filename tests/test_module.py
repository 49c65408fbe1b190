"""HBPLitModule: the loss normalizers' gradients, checkpointing, compilation, FLOPs; on a GPU, every
attention backend's packed loss and gradients against separate forwards (the CPU parity of every
model family is tests/test_families.py)."""

import copy
import json
import math

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT_TEMPLATE, TINY_LLAMA, quiet_trainer, separate_loss

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.data.collate import collate_packs
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.loss import chunked_cross_entropy
from lit_hbp.model.packed_call import pack_scope
from lit_hbp.model.tiling import TiledMLP

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
ARCHS = {
    "llama": TINY,
    "qwen2": {**TINY, "model_type": "qwen2"},
    "mistral": {**TINY, "model_type": "mistral", "sliding_window": 24},
}


def make_module(config=TINY, vocab=300, **kw) -> HBPLitModule:
    torch.manual_seed(0)
    m = HBPLitModule(model=config, vocab_size=vocab, **kw)
    m.configure_model()
    return m


def reference_model(module: HBPLitModule):
    """The same weights with transformers' own SDPA attention: the independent reference."""
    ref = copy.deepcopy(module.model)
    ref.set_attn_implementation("sdpa")
    return ref


def random_samples(rng, n, vocab=300, lo=3, hi=60):
    return {
        i: (rng.integers(0, vocab, int(k)), rng.random(int(k)) < 0.7) for i, k in enumerate(rng.integers(lo, hi, n))
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("backend", ["flash_attn_3", "flash_attn_4", "flash_attn", "torch_varlen", "flex", "sdpa"])
def test_packed_loss_and_gradients_equal_separate_forwards_cuda(backend, arch):
    """fp32 weights under bf16 autocast (how training runs) against HF's own sdpa attention on each
    document alone in fp32: loss within 1%, gradients within 5% of the largest entry (bf16 noise)."""
    from lit_hbp.model.attention.backends import why_not

    needs = frozenset({"window"}) if "sliding_window" in ARCHS[arch] else frozenset()
    reason = why_not(backend, "cuda", torch.bfloat16, needs)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    module = make_module(ARCHS[arch], loss="sum").cuda()
    ref = reference_model(module)
    prepare_model(module.model, attn_backend=backend)
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 24, hi=300)
    samples[23] = (rng.integers(0, 300, 700), np.ones(700, bool))  # longer than mistral's window
    batch = collate_packs([np.arange(24)], lambda i: samples[i], pad_id=0)
    batch = batch.to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = module(batch)[0]
    loss.backward()
    expected = separate_loss(ref, samples, "cuda")
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-2 * expected.item()
    for (name, p), q in zip(module.model.named_parameters(), ref.parameters()):
        err = (p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
        assert err < 5e-2, (name, err)


def test_chunked_cross_entropy_matches_full_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    labels[::3] = -100
    weights = torch.rand(37)
    loss, ce_sum, n = chunked_cross_entropy(hidden, head, labels, weights, chunk_size=5)
    keep = labels != -100
    ce = F.cross_entropy(head(hidden[keep]), labels[keep], reduction="none")
    torch.testing.assert_close(loss, (ce * weights[keep]).sum())
    torch.testing.assert_close(ce_sum, ce.sum().detach())
    assert n == int(keep.sum())
    g_chunked = torch.autograd.grad(loss, [hidden, head.weight])
    g_full = torch.autograd.grad((ce * weights[keep]).sum(), [hidden, head.weight])
    for a, b in zip(g_chunked, g_full):
        torch.testing.assert_close(a, b)
    # No target at all: a zero loss that still reaches the LM head (matched collective hooks).
    zero, _, n0 = chunked_cross_entropy(hidden, head, torch.full((37,), -100), weights)
    assert n0 == 0 and zero.item() == 0 and zero.requires_grad


# ------------------------------------------------------------------------------- loss gradients


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = None
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(copy.deepcopy(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    rng = np.random.default_rng(1)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(40):
            q = " ".join(rng.choice(words, rng.integers(2, 20)))
            a = " ".join(rng.choice(words, rng.integers(1, 25)))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    return path


def train_one_step(data_path, tokenizer, accumulate, loss, tmp_path):
    dm = HBPDataModule(
        sources=[{"path": str(data_path)}],
        tokenizer=tokenizer,
        levels=["96:1", "256:1"],
        cache_dir=str(tmp_path / "cache"),
    )
    module = make_module(vocab=dm.vocab_size, loss=loss, lr=0.0)
    capture = GradCapture()
    trainer = quiet_trainer(devices=1, max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture])
    reference = copy.deepcopy(module)
    trainer.fit(module, dm)
    return capture, dm, reference


def reference_grads(reference: HBPLitModule, dm, batches, loss):
    """Per-sample HF forwards with SDPA attention: the definition of each normalizer."""
    ref = reference_model(reference)
    terms = []  # (micro index, sample ce sum, sample targets)
    for m, b in enumerate(batches):
        for i in b.sample_index.tolist():
            ids, target = dm.store.tokens(i)
            ids = torch.tensor(ids, dtype=torch.long)
            labels = torch.where(torch.as_tensor(target[1:]), ids[1:], -100)
            logits = ref(input_ids=ids[None], use_cache=False).logits[0, :-1]
            ce = F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100)
            terms.append((m, ce, int((labels != -100).sum())))
    a = len(batches)
    if loss == "ave_token":
        total = sum(ce for _, ce, _ in terms) / sum(n for *_, n in terms)
    elif loss == "token_mean":
        total = (
            sum(sum(ce for mm, ce, _ in terms if mm == m) / sum(n for mm, _, n in terms if mm == m) for m in range(a))
            / a
        )
    elif loss == "sample_mean":
        total = (
            sum(sum(ce / n for mm, ce, n in terms if mm == m) / sum(1 for mm, *_ in terms if mm == m) for m in range(a))
            / a
        )
    else:
        total = sum(ce for _, ce, _ in terms) / a
    total.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_ave_token_step_equals_global_token_mean(chat_data, toy_tokenizer, tmp_path, accumulate):
    capture, dm, reference = train_one_step(chat_data, toy_tokenizer, accumulate, "ave_token", tmp_path)
    assert len(capture.batches) == accumulate
    expected = reference_grads(reference, dm, capture.batches, "ave_token")
    for name, g in capture.grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    if accumulate > 1:
        # The micro-batches hold different token counts, so averaging per-micro-batch means would
        # give another update: the comparison above can tell the two apart.
        assert len({b.n_targets for b in capture.batches}) > 1
        per_micro = reference_grads(reference, dm, capture.batches, "token_mean")
        gap = max((capture.grads[n] - per_micro[n]).abs().max().item() for n in per_micro)
        assert gap > 1e-4


@pytest.mark.parametrize("loss", ["token_mean", "sample_mean", "sum"])
def test_other_normalizers_match_their_definitions(chat_data, toy_tokenizer, tmp_path, loss):
    capture, dm, reference = train_one_step(chat_data, toy_tokenizer, 2, loss, tmp_path)
    expected = reference_grads(reference, dm, capture.batches, loss)
    for name, g in capture.grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)


class RatesTaken(L.Callback):
    """The learning rate of every optimizer step as the optimizer takes it, and each micro-batch's plan."""

    def __init__(self):
        self.rates, self.batches = [], []

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].register_step_pre_hook(lambda opt, *_: self.rates.append(opt.param_groups[0]["lr"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, trainer.accumulate_grad_batches, batch.n_targets, batch.loss_norm))


def test_train_lr_is_the_rate_each_logged_step_took(chat_data, toy_tokenizer, tmp_path):
    """Lightning steps the scheduler before on_train_batch_end: ``train/lr`` read there was the next step's."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = make_module(vocab=dm.vocab_size, lr=1e-3, warmup_steps=2, self_check=False)
    taken, logger = RatesTaken(), CSVLogger(tmp_path, name="lr")
    trainer = quiet_trainer(devices=1, max_steps=4, log_every_n_steps=1, logger=logger,
                            callbacks=[taken, LearningRateMonitor("step")])  # fmt: skip
    trainer.fit(module, dm)
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    logged = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    monitor = [float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")]  # the first of two groups
    assert len(taken.rates) == 4 and len(set(taken.rates)) == 4  # warm-up, then the cosine: four rates
    assert logged == pytest.approx(taken.rates, rel=1e-6) and monitor == pytest.approx(taken.rates, rel=1e-6)


def test_a_warm_up_longer_than_the_run_rises_all_run_as_set_and_says_so(chat_data, toy_tokenizer, tmp_path):
    """``warmup_steps`` 5 in a run of 3 optimizer steps was cut to 3 (the peak rate reached at the last step,
    sooner than asked) without a word; now the rate rises as the setting says (HF's schedules too) and is said."""
    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = make_module(vocab=dm.vocab_size, lr=1e-3, warmup_steps=5, self_check=False)
    taken = RatesTaken()
    with pytest.warns(UserWarning, match=r"model.warmup_steps 5 is longer than the run's 3 optimizer steps: the "
                      r"learning rate rises toward model.lr for the whole run and ends at 0.0005"):  # fmt: skip
        quiet_trainer(devices=1, max_steps=3, callbacks=[taken]).fit(module, dm)
    assert taken.rates == pytest.approx([1e-3 * k / 6 for k in (1, 2, 3)], rel=1e-9)


def test_a_config_mappings_vocabulary_is_kept_when_the_tokenizer_fits_in_it():
    """``vocab_size`` in the model mapping was replaced by the tokenizer's (a vocabulary padded to a multiple of 64
    silently lost its rows); it is kept when the tokenizer's tokens fit, refused when they do not."""
    assert make_module({**TINY, "vocab_size": 320}).model.get_input_embeddings().num_embeddings == 320
    assert make_module(TINY).model.get_input_embeddings().num_embeddings == 300  # the tokenizer's, when unset
    with pytest.raises(ConfigError, match=r"model.model.vocab_size: 200 rows embed fewer than the tokenizer's 300"):
        make_module({**TINY, "vocab_size": 200})
    from lit_hbp.cost.config import model_config  # what the level search and the simulator price: the same rows

    assert model_config({"model": {"model": {**TINY, "vocab_size": 320}}}, 300)["vocab_size"] == 320
    assert model_config({"model": {"model": TINY}}, 300)["vocab_size"] == 300


def test_a_gradient_accumulation_schedule_plans_each_epoch_with_its_accumulation(chat_data, toy_tokenizer, tmp_path):
    """Lightning's GradientAccumulationScheduler sets the trainer's accumulation when an epoch starts, after the
    epoch's loader was planned: the ave_token normalizer of each micro-batch is its optimizer step's supervised
    tokens over the step's micro-batches, counted here from the batches themselves."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = make_module(vocab=dm.vocab_size, self_check=False)
    taken = RatesTaken()
    trainer = quiet_trainer(devices=1, max_epochs=2, limit_train_batches=4, reload_dataloaders_every_n_epochs=1,
                            callbacks=[taken, GradientAccumulationScheduler({0: 1, 1: 2})])  # fmt: skip
    trainer.fit(module, dm)
    assert [(e, a) for e, a, *_ in taken.batches] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [norm for *_, norm in taken.batches[:4]] == [n for _, _, n, _ in taken.batches[:4]]
    second = taken.batches[4:]
    for step in (second[:2], second[2:]):
        assert [norm for *_, norm in step] == [sum(n for _, _, n, _ in step) / 2] * 2
    assert len(taken.rates) == 4 + 2


@pytest.mark.parametrize("varies", ["accumulation schedule", "one scheduled accumulation", "random packer"])
def test_a_max_epochs_runs_schedule_spans_the_optimizer_steps_it_takes(
    varies, chat_data, toy_tokenizer, tmp_path, caplog
):
    """Lightning counts a ``max_epochs`` run's optimizer steps as its first epoch's times the epochs; an epoch that
    accumulates more (a GradientAccumulationScheduler) or that a seeded packer plans with another number of
    micro-steps makes the run shorter or longer than that, and the cosine ended short of its floor (52 counted,
    40 run: 0.23 of lr at the last step, not 0.10). A scheduler of one accumulation ({0: 2}) was taken for Lightning's
    own count, which counts it as 1 (the scheduler sets the trainer's as an epoch starts): twice the steps run. The
    schedule spans the steps the run takes (the reference: the optimizer's own steps, counted by a hook). Each epoch's
    plan is logged once, as its epoch starts."""
    import logging

    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lit_hbp.callbacks.progress import planned_steps

    packer, callbacks, limit = {
        "accumulation schedule": ("bfd", [GradientAccumulationScheduler({0: 1, 1: 2})], 8),
        "one scheduled accumulation": ("bfd", [GradientAccumulationScheduler({0: 2})], 8),
        "random packer": ("random", [], 1.0),
    }[varies]
    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"), packer=packer, seed=2)  # fmt: skip
    module = make_module(vocab=dm.vocab_size, lr=1e-3, warmup_steps=0, min_lr_ratio=0.1, self_check=False)
    taken = RatesTaken()
    trainer = quiet_trainer(devices=1, max_epochs=3, limit_train_batches=limit, reload_dataloaders_every_n_epochs=1,
                            callbacks=[taken, *callbacks])  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(module, dm)
    said = [line.split(" plan:")[0] for line in caplog.messages if " plan: " in line]
    assert said == ["epoch 0", "epoch 1", "epoch 2"], said
    steps = len(taken.rates)
    counted = [dm.plan_for_epoch(e).n_micro_steps for e in range(3)]
    if "packer" in varies:
        assert counted[0] * 3 != sum(counted), counted  # this seed draws epochs Lightning would miscount
    assert module._schedule["total"] == steps == trainer.global_step == planned_steps(trainer)  # the bar's total
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (steps - 1) / steps))  # the last step's, one short of 0.1
    assert taken.rates[-1] == pytest.approx(1e-3 * cosine)


def test_a_float_limit_that_ends_the_epoch_inside_an_optimizer_step_is_refused_before_the_first_step(
    chat_data, toy_tokenizer, tmp_path
):
    """A float ``limit_train_batches`` is resolved against the plan's length: one that leaves the epoch's last
    optimizer step one micro-batch of two (which Lightning would step on, normalized by both) is refused when
    the loader is built, naming the limit and a multiple that fits; one that ends on a step trains."""
    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = make_module(vocab=dm.vocab_size, self_check=False)
    quiet_trainer(devices=1, max_steps=1, accumulate_grad_batches=2).fit(module, dm)
    n = dm.plan_for_epoch(0).n_micro_steps
    assert n % 2 == 0 and n >= 4
    odd, even = (n - 0.5) / n, (n - 1.5) / n  # Lightning's int(n * limit): n - 1 and n - 2 micro-batches
    trainer = quiet_trainer(devices=1, max_epochs=1, accumulate_grad_batches=2, limit_train_batches=odd)
    with pytest.raises(ConfigError, match=rf"cuts the epoch's {n} micro-batches a rank at {n - 1}, but an optimizer "
                       rf"step accumulates 2 .* give a multiple of 2 \({n - 2} or {n}\)"):  # fmt: skip
        trainer.fit(module, dm)
    assert trainer.global_step == 0
    fits = quiet_trainer(devices=1, max_epochs=1, accumulate_grad_batches=2, limit_train_batches=even)
    fits.fit(module, dm)
    assert fits.global_step == (n - 2) // 2


def test_an_accumulation_by_epoch_given_as_a_dict_is_refused_by_name(chat_data, toy_tokenizer, tmp_path):
    """Lightning 1.x's ``accumulate_grad_batches={epoch: n}``, which Lightning 2 accepts and then fails on: a bare
    ``TypeError: unhashable type: 'dict'`` once the data was read."""
    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = make_module(vocab=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(devices=1, max_steps=2, accumulate_grad_batches={0: 1, 2: 2})
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches must be an int, got \{0: 1, 2: 2\}: .*Scheduler"):
        trainer.fit(module, dm)


@pytest.mark.parametrize("varies", ["random packer", "isf packer", "ffs packer", "accumulation schedule"])
def test_epochs_of_another_length_without_reloaded_loaders_are_refused_before_the_data_is_read(
    varies, chat_data, toy_tokenizer, tmp_path
):
    """Lightning reads the loader's length once unless it reloads it each epoch: an epoch planned with another
    number of micro-steps would be cut or run short, so the run stops before its first step, naming the setting."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    packer, callbacks = (
        (varies.split()[0], []) if "packer" in varies else ("bfd", [GradientAccumulationScheduler({1: 2})])
    )  # isf and ffs draw too: they trained epoch 0 whole and stopped at epoch 1 in a traceback
    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"), packer=packer)  # fmt: skip
    module = make_module(vocab=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(devices=1, max_epochs=2, limit_train_batches=2, callbacks=callbacks)
    with pytest.raises(ConfigError, match="reload_dataloaders_every_n_epochs is 0 but .*set Trainer"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0 and dm.store is None
    one_epoch = quiet_trainer(devices=1, max_epochs=1, limit_train_batches=2, callbacks=callbacks)
    one_epoch.fit(module, dm)
    assert one_epoch.global_step == 2


@pytest.mark.parametrize(
    "setting, says",
    [
        (dict(lr=-1.0), "model.lr must be a finite number >= 0, got -1.0"),
        (dict(lr=float("inf")), "model.lr must be a finite number >= 0, got inf"),
        (dict(weight_decay=-0.1), "model.weight_decay must be a finite number >= 0"),
        (dict(weight_decay=float("inf")), "model.weight_decay must be a finite number >= 0, got inf"),
        (dict(lora={}), r"model.lora: \{\} names no LoRA setting, and the full model would train"),
        (dict(lora={"rank": 0}), "model.lora.rank must be a whole number >= 1, got 0"),
        (dict(lora={"rank": 2.5}), "model.lora.rank must be a whole number >= 1, got 2.5"),
        (dict(lora={"r": 4, "dropout": 2.0}), r"model.lora.dropout must be a probability in \[0, 1\), got 2.0"),
        (dict(lora={"rank": 4, "alpha": -1}), "model.lora.alpha must be a number > 0, got -1"),
        (dict(lora={"rank": 4, "task_type": "SEQ_CLS"}), "model.lora.task_type: lit-hbp trains a causal language"),
        (dict(betas=(0.9, 1.0)), r"model.betas must be two numbers in \[0, 1\), got \[0.9, 1.0\]"),
        (dict(warmup_steps=-5), "model.warmup_steps must be a whole number of optimizer steps >= 0, got -5"),
        (dict(min_lr_ratio=-1.0), r"model.min_lr_ratio \(the cosine's floor, a share of lr\) must be in \[0, 1\]"),
        (dict(min_lr_ratio=2.0), r"must be in \[0, 1\], got 2.0"),
        (dict(ce_chunk_size=0), "model.ce_chunk_size .* must be a whole number >= 1, got 0"),
    ],
)
def test_a_setting_torch_would_train_wrongly_on_is_refused_by_name(setting, says):
    """A negative floor is a negative learning rate (gradient ascent) from the middle of the run on; a negative
    warm-up starts the cosine part-way down; a chunk of 0 tokens never computes the loss; an infinite rate or decay
    makes every weight NaN at the first step; an empty LoRA mapping trained the full model, and LoRA values peft
    fails on stopped in a traceback after the data was read."""
    with pytest.raises(ConfigError, match=says):
        HBPLitModule(model=TINY, **setting)
    with pytest.raises(ValueError, match="ce_chunk_size .* must be an int >= 1, got -4"):
        packed_loss(make_module(), pack_samples([(np.arange(3, 9), np.ones(6))]), "sum", ce_chunk_size=-4)


def test_checkpointed_layers_follow_the_level(chat_data):
    """A level's checkpointing holds for its packed call only: inside ``pack_scope`` the first k layers,
    after it the layers as they were."""
    module = make_module()
    with pack_scope(module.model, 2):
        assert [layer.gradient_checkpointing for layer in module._layers] == [True, True, False]
    assert [layer.gradient_checkpointing for layer in module._layers] == [False, False, False]
    with pytest.raises(ValueError, match="ckpt_layers 4 exceeds the model's 3 decoder layers"):
        with pack_scope(module.model, 4):
            pass
    # Same gradients with and without checkpointing.
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 4)
    batch = collate_packs([np.arange(4)], lambda i: samples[i], loss_norm=10.0)
    grads = []
    for k in (0, 3):
        module.zero_grad()
        module.train()
        module(batch.replace(ckpt_layers=k))[0].backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_micro_batch_flops_match_a_flop_counter():
    """The model-FLOPs formula against torch's FLOP counter on HF's eager attention, document by
    document (eager attention computes the full score matrix: twice the causal half the formula
    counts); then a micro-batch's figure: real tokens, its documents, its supervised positions, and
    under SP each rank's share."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_hbp.parallel.ulysses import Ulysses

    module = make_module()
    spec = module._spec
    samples = random_samples(np.random.default_rng(1), 5)
    samples[4] = (samples[4][0][:-1], samples[4][1][:-1])  # 167 tokens: the pack needs padding
    eager = copy.deepcopy(module.model)
    eager.set_attn_implementation("eager")
    with FlopCounterMode(display=False) as counter:
        for ids, _ in samples.values():
            eager(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits.sum().backward()
    lengths = np.array([ids.size for ids, _ in samples.values()], dtype=np.float64)
    tokens, sum_sq = lengths.sum(), (lengths**2).sum()
    assert counter.get_total_flops() == pytest.approx(spec.train_flops(tokens, 2 * sum_sq, tokens), rel=1e-9)

    pack = lambda sp: collate_packs([np.arange(5)], lambda i: samples[i], pad_id=0, sp=sp)  # noqa: E731
    batch = pack(1)
    assert batch.input_ids.shape[1] > tokens == batch.n_tokens, "padding is not counted"
    supervised = sum(int(t[1:].sum()) for _, t in samples.values())  # a token predicts the next one
    assert module.micro_batch_flops(batch) == pytest.approx(spec.train_flops(tokens, sum_sq, supervised), rel=1e-12)
    shards = [Ulysses().shard(pack(2), 2, r) for r in range(2)]
    heads = [int((s.labels != -100).sum()) for s in shards]
    assert sum(heads) == supervised
    for s, h in zip(shards, heads):
        expected = spec.train_flops(tokens, sum_sq, 0) / 2 + spec.train_flops(0, 0, h)
        assert module.micro_batch_flops(s) == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones(caplog):
    """compile=True: each decoder layer compiled once with dynamic shapes; packs of other lengths and
    other checkpointing flags give eager's gradients, with a bounded number of recompilations."""
    import torch._dynamo

    torch._dynamo.reset()
    eager, compiled = make_module(), make_module(compile=True)
    rng = np.random.default_rng(3)
    packs = [[30, 7, 51, 12], [100, 3, 60], [9, 9, 9, 9, 9, 90]]
    for i, lengths in enumerate(packs):
        samples = {j: (rng.integers(0, 300, n), rng.random(n) < 0.7) for j, n in enumerate(lengths)}
        batch = collate_packs([np.arange(len(lengths))], samples.__getitem__, loss_norm=40.0)
        grads = []
        for m in (eager, compiled):
            m.zero_grad()
            loss = m(batch.replace(ckpt_layers=i % 2))[0]
            loss.backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] > 0
    assert all(layer._compiled_call_impl is not None for layer in compiled._layers)
    assert torch._dynamo.config.recompile_limit >= 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("loss", ["ave_token", "token_mean", "sum", "sample_mean"])
def test_liger_kernels_train_like_the_chunked_loss(loss):
    """liger=True (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU) against the same weights without
    Liger, fp32: loss within 1e-4 relative, gradients within 1e-3 of the largest entry."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    plain = make_module(loss=loss).cuda()
    fused = make_module(loss=loss, liger=True).cuda()
    fused.model.load_state_dict(plain.model.state_dict())
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 12, hi=200)
    batch = collate_packs([np.arange(12)], lambda i: samples[i], loss_norm=50.0)
    batch = batch.to("cuda")
    results = []
    for m in (plain, fused):
        value, ce, n = m(batch)
        value.backward()
        results.append((value.item(), ce.item(), n, {k: p.grad for k, p in m.model.named_parameters()}))
    (v0, c0, n0, g0), (v1, c1, n1, g1) = results
    assert n0 == n1 and abs(v0 - v1) < 1e-4 * abs(v0) and abs(c0 - c1) < 1e-4 * c0
    for name, g in g0.items():
        err = (g - g1[name]).abs().max().item() / g.abs().max().item()
        assert err < 1e-3, (name, err)


class FakeParam:
    """What adamw_kind reads of a parameter: its device and whether it is floating."""

    def __init__(self, is_cuda: bool, floating: bool = True):
        self.is_cuda, self._floating = is_cuda, floating

    def is_floating_point(self) -> bool:
        return self._floating


def test_adamw_is_fused_when_every_trainable_parameter_is_a_cuda_float():
    from lit_hbp.lightning.optimizer import adamw_kind

    assert adamw_kind([FakeParam(True), FakeParam(True)]) == "fused"
    assert adamw_kind([FakeParam(True), FakeParam(False)]) == "foreach"  # one on the host
    assert adamw_kind([FakeParam(True), FakeParam(True, floating=False)]) == "foreach"
    assert adamw_kind([]) == "foreach"
    assert adamw_kind([torch.nn.Parameter(torch.ones(2))]) == "foreach"
    # Where the strategy steps them decides: parameters still on the host go to the GPU with DeepSpeed.
    assert adamw_kind([FakeParam(False)], torch.device("cuda", 0)) == "fused"
    assert adamw_kind([FakeParam(True)], torch.device("cpu")) == "foreach"


def test_a_model_built_on_the_host_before_fit_gets_the_fused_adamw_of_its_gpu_strategy():
    """bench/gpu_throughput.py builds the model on the host and DeepSpeed moves it to the GPU after
    configure_optimizers: the optimizer follows the strategy's device, not the parameters' (and the
    host, under ZeRO-Offload)."""
    from types import SimpleNamespace

    module = make_module()
    for device, config, want in [
        ("cuda", {}, True),
        ("cuda", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, False),
        ("cpu", {}, False),
    ]:
        strategy = SimpleNamespace(root_device=torch.device(device), config=config)
        module._trainer = SimpleNamespace(strategy=strategy, estimated_stepping_batches=10)
        optimizer = module.configure_optimizers()["optimizer"]
        assert bool(optimizer.defaults["fused"]) == want, (device, config)
        assert next(module.parameters()).device.type == "cpu"


def test_a_fused_adamw_steps_under_bf16_mixed_precision_with_clipping(
    chat_data, toy_tokenizer, tmp_path, monkeypatch, caplog
):
    """On an H100 the VLM demo (bf16-mixed, gradient_clip_val 1.0, no DeepSpeed) stopped at its first step:
    Lightning's mixed precision refuses to clip an optimizer that unscales inside its step (fused AdamW),
    though bf16 has no loss scale to undo. The module clips itself there (``configure_gradient_clipping``),
    so the fused kernel steps. Here the strategy's device is said to be CUDA, so the fused kernel
    (CPU-capable in torch >= 2.4) is chosen: fit runs with it, clipping or not, in bf16 or fp32."""
    import lit_hbp.lightning.module as module_file

    monkeypatch.setattr(module_file, "optimizer_device", lambda strategy: torch.device("cuda", 0))
    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    for kwargs in (
        {"precision": "bf16-mixed", "gradient_clip_val": 1.0},
        # named: the Trainer hands the module Lightning's enum of it, whose str() is not "norm"
        {"precision": "bf16-mixed", "gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"},
        {"precision": "bf16-mixed"},
        {"precision": "32-true", "gradient_clip_val": 1.0},
    ):
        module = make_module(vocab=dm.vocab_size)
        trainer = quiet_trainer(devices=1, max_steps=2, **kwargs)
        with caplog.at_level("INFO"):
            trainer.fit(module, dm)
        assert trainer.global_step == 2
        assert trainer.optimizers[0].defaults["fused"], kwargs
    assert "optimizer: AdamW (fused)" in caplog.text


@pytest.mark.parametrize("strategy", ["auto", "hbp_ddp"])
def test_a_clip_value_of_zero_or_below_clips_nothing_as_in_lightning(chat_data, toy_tokenizer, tmp_path, strategy):
    """Lightning's precision plugin clips nothing for ``gradient_clip_val <= 0``; the module's own clipping (one
    device, DDP) took -1.0 as a norm of -1 and flipped every gradient (the loss rose each step, without a word).
    Two steps with -1.0, 0.0 and no clipping end on the same weights; 1e-3 clips (the weights differ)."""
    import lit_hbp.lightning.strategy  # noqa: F401  (registers hbp_ddp)

    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    weights = {}
    for clip in (None, -1.0, 0.0, 1e-3):
        module = make_module(vocab=dm.vocab_size, lr=1e-2)
        quiet_trainer(max_steps=2, strategy=strategy, gradient_clip_val=clip).fit(module, dm)
        weights[clip] = torch.cat([p.detach().flatten() for p in module.model.parameters()])
    assert torch.equal(weights[-1.0], weights[None]) and torch.equal(weights[0.0], weights[None])
    assert not torch.allclose(weights[1e-3], weights[None])


def test_a_fit_the_modules_schedule_or_model_cannot_follow_is_refused(chat_data, toy_tokenizer, tmp_path):
    """Lightning's StochasticWeightAveraging copied the module before its model was built and averaged nothing (the
    run ended on its last step's weights, its learning rates in place of the schedule); a run with neither
    max_steps nor max_epochs stopped on an OverflowError: both refused with what to do instead."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lit_hbp.errors import ConfigError

    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    swa = quiet_trainer(max_steps=2, callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])
    with pytest.raises(ConfigError, match="StochasticWeightAveraging: it averages a copy of the module made before"):
        swa.fit(make_module(vocab=dm.vocab_size), dm)
    endless = quiet_trainer(max_steps=-1, max_epochs=-1, max_time="00:00:00:30")
    with pytest.raises(ConfigError, match="max_epochs: -1 trains without an end"):
        endless.fit(make_module(vocab=dm.vocab_size), dm)


def test_callbacks_that_would_act_on_no_model_or_another_schedule_are_refused(chat_data, toy_tokenizer, tmp_path):
    """A BaseFinetuning freezing in its setup and ModelPruning collecting layers in its setup ran before the model
    was built: nothing frozen (the "frozen" weights moved), nothing pruned, without a word; a LearningRateFinder
    inside fit set the optimizer's rate, which the schedule took back at the next step; Tuner.lr_find with
    accumulation read each step's last micro-batch's share of the loss. Each refused by name, before the model
    loads; freezing on a model built before fit, and Tuner.lr_find one micro-batch a step, are served."""
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        BatchSizeFinder,
        LearningRateFinder,
        ModelPruning,
        WeightAveraging,
    )
    from lightning.pytorch.tuner import Tuner

    from lit_hbp.errors import ConfigError

    class FreezeEmbeddings(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.model.get_input_embeddings())  # stopped on None.get_input_embeddings before

        def finetune_function(self, pl_module, epoch, optimizer):
            pass

    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    unbuilt = lambda: HBPLitModule(model=TINY, vocab_size=dm.vocab_size)  # noqa: E731
    for callback, says in (
        (FreezeEmbeddings(), "FreezeEmbeddings: it freezes the module's parameters in its setup"),
        (ModelPruning("l1_unstructured", amount=0.5), "ModelPruning: it collects the module's layers in its setup"),
        (LearningRateFinder(num_training_steps=4), "LearningRateFinder: inside fit it sets the optimizer's learning"),
        (BatchSizeFinder(), "BatchSizeFinder: a micro-batch is one pack of its level's tokens"),
    ):
        module = unbuilt()
        with pytest.raises(ConfigError, match=says):
            quiet_trainer(max_steps=2, callbacks=[callback]).fit(module, dm)
        assert module.model is None  # refused before the model loads
    for callbacks, module in (
        ([FreezeEmbeddings()], make_module(vocab=dm.vocab_size)),  # built before fit
        ([WeightAveraging(), FreezeEmbeddings()], unbuilt()),
    ):  # built by the averaging's setup
        quiet_trainer(max_steps=2, callbacks=callbacks).fit(module, dm)
        embeddings = module.model.get_input_embeddings()
        assert not embeddings.weight.requires_grad and embeddings.weight.grad is None
    with pytest.raises(ConfigError, match="LearningRateFinder: with accumulate_grad_batches 2 its curve reads"):
        Tuner(quiet_trainer(max_steps=2, accumulate_grad_batches=2)).lr_find(unbuilt(), dm, num_training=4)
    found = Tuner(quiet_trainer(max_steps=2)).lr_find(unbuilt(), dm, num_training=4, min_lr=1e-4, max_lr=1e-2)
    assert len(found.results["lr"]) == 4
    with pytest.raises(ConfigError, match="BatchSizeFinder: a micro-batch is one pack"):  # Lightning's: no batch_size
        Tuner(quiet_trainer(max_steps=2)).scale_batch_size(unbuilt(), datamodule=dm)


def test_a_subclass_that_drops_the_modules_own_callbacks_is_refused_before_a_step(chat_data, toy_tokenizer, tmp_path):
    """A subclass's configure_callbacks without super()'s: the callback refusals never ran and the step's metrics
    were logged after every callback had read them (a ModelCheckpoint of train/loss ranked each save by the step
    before's). Refused naming the subclass before a step; with super()'s list and its own, it trains."""
    from lit_hbp.errors import ConfigError

    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    steps = []
    count = type("Count", (L.Callback,), {"on_train_batch_start": lambda self, *a: steps.append(1)})
    own = type("Own", (HBPLitModule,), {"configure_callbacks": lambda self: [count()]})
    with pytest.raises(
        ConfigError, match=r"^Own.configure_callbacks\(\) drops HBPLitModule's own callbacks: return supe"
    ):
        quiet_trainer(max_steps=2).fit(own(model=TINY, vocab_size=dm.vocab_size), dm)
    assert steps == []
    kept = type(
        "Kept",
        (HBPLitModule,),
        {"configure_callbacks": lambda self: super(kept, self).configure_callbacks() + [count()]},
    )
    quiet_trainer(max_steps=2).fit(kept(model=TINY, vocab_size=dm.vocab_size), dm)
    assert len(steps) == 2


def test_a_validation_of_a_checkpoint_holds_out_the_records_its_fit_held_out(chat_data, toy_tokenizer, tmp_path):
    """Trainer.validate(ckpt_path=...) in a later session with another data seed drew another val_fraction hold-out:
    records the checkpoint trained on (its val/loss read 7.5% low), without a word. Refused naming the seed and the
    share to give; given them, the validation's records are the fit's held-out ones."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_hbp.errors import ConfigError

    def data(seed: int, fraction: float = 0.25) -> HBPDataModule:
        return HBPDataModule(
            sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
            val_fraction=fraction, seed=seed, cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip

    def held_out(dm: HBPDataModule) -> set:
        return set(zip(dm.val_store.source_of.tolist(), dm.val_store.row_of.tolist()))

    fit = data(3)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[saves]).fit(make_module(vocab=fit.vocab_size), fit)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    for seed, fraction in ((0, 0.25), (3, 0.2)):
        other = data(seed, fraction)
        with pytest.raises(ConfigError, match=r"the checkpoint held out 0.25 of the training records with data seed 3"):
            quiet_trainer().validate(HBPLitModule(model=TINY, vocab_size=other.vocab_size), other, ckpt_path=last)
        assert held_out(other) != held_out(fit)  # what it would have validated on: other records
    again = data(3)
    quiet_trainer().validate(HBPLitModule(model=TINY, vocab_size=again.vocab_size), again, ckpt_path=last)
    assert held_out(again) == held_out(fit)


def test_a_validation_holds_out_the_fits_records_whatever_else_changed(chat_data, toy_tokenizer, tmp_path):
    """The hold-out is a seeded draw over every source's records: a validation of a checkpoint with a source added or
    the list reordered (seed and share the fit's) validated on records the checkpoint trained on, without a word;
    so did one of weights from ``load_from_checkpoint`` (no data state restored at all). Refused on both paths, with
    a fit that held out nothing too; the same records moved to another folder or tokenized by another chat template
    validate. Reference: the raw lines each run holds out and trains on."""
    import shutil
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_hbp.errors import ConfigError

    lines = chat_data.read_text().splitlines()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:20]) + "\n")
    b.write_text("\n".join(lines[20:]) + "\n")
    (tmp_path / "moved").mkdir()
    for f in (a, b):
        shutil.copy(f, tmp_path / "moved" / f.name)

    def data(paths, fraction=0.25, seed=3, **kw) -> HBPDataModule:
        return HBPDataModule(
            sources=[{"path": str(x)} for x in paths], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
            val_fraction=fraction, seed=seed, cache_dir=str(tmp_path / "cache"), **kw,
        )  # fmt: skip

    def raw(store) -> set:
        return {Path(store.sources[s].source.path).read_text().splitlines()[r]
                for s, r in zip(store.source_of.tolist(), store.row_of.tolist())}  # fmt: skip

    def fitted(dm: HBPDataModule, name: str) -> str:
        saves = ModelCheckpoint(dirpath=tmp_path / name, save_last=True)
        quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[saves]).fit(
            make_module(vocab=dm.vocab_size), dm
        )
        return str(tmp_path / name / "last.ckpt")

    fit = data([a, b])
    last = fitted(fit, "ckpt")
    refused = r"^data.sources: this validation holds out \d+ records, the checkpoint's fit held out \d+ others"
    for other in (data([b, a]), data([a, b, chat_data])):
        with pytest.raises(ConfigError, match=refused):
            quiet_trainer().validate(HBPLitModule(model=TINY, vocab_size=other.vocab_size), other, ckpt_path=last)
        with pytest.raises(ConfigError, match=refused):
            quiet_trainer().validate(HBPLitModule.load_from_checkpoint(last), other)
        assert raw(other.val_store) & raw(fit.store)  # what it would have validated on: records the fit trained on
    with pytest.raises(ConfigError, match=refused):  # another seed, through load_from_checkpoint
        quiet_trainer().validate(HBPLitModule.load_from_checkpoint(last), data([a, b], seed=4))
    template = CHAT_TEMPLATE.replace("|>\n", "|> ")  # the same records rendered to other tokens
    assert template != CHAT_TEMPLATE
    for same in (data([tmp_path / "moved" / "a.jsonl", tmp_path / "moved" / "b.jsonl"]),
                 data([a, b], chat_template=template)):  # fmt: skip
        quiet_trainer().validate(HBPLitModule.load_from_checkpoint(last), same)
        quiet_trainer().validate(HBPLitModule(model=TINY, vocab_size=same.vocab_size), same, ckpt_path=last)
        assert raw(same.val_store) == raw(fit.val_store)
    unheld = fitted(data([a, b], fraction=0.0), "unheld")
    with pytest.raises(ConfigError, match=r"this validation holds out 10 records, the checkpoint's fit held out 0 "):
        quiet_trainer().validate(HBPLitModule.load_from_checkpoint(unheld), data([a, b]))


def test_a_data_module_set_up_again_under_another_world_size_plans_for_it(chat_data, toy_tokenizer, tmp_path):
    """A data module given to a second Trainer kept the first one's plans (keyed by epoch alone) and skipped its
    checks: after a 2-rank plan a 1-rank run trained half the data; a Trainer with use_distributed_sampler went
    unrefused. Reference: a fresh data module's plan under the same stand-in trainer."""
    from types import SimpleNamespace

    from lit_hbp.errors import ConfigError

    def data() -> HBPDataModule:
        return HBPDataModule(
            sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
            val_fraction=0.25, cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip

    def stand_in(world: int, accumulate: int = 1):
        return SimpleNamespace(world_size=world, global_rank=0, accumulate_grad_batches=accumulate, callbacks=[],
                               current_epoch=0, num_devices=world, loggers=[], lightning_module=None,
                               is_global_zero=True)  # fmt: skip

    reused = data()
    for world, accumulate in ((2, 1), (1, 1), (1, 2), (2, 2)):
        fresh = data()
        for dm in (reused, fresh):
            dm.trainer = stand_in(world, accumulate)
            dm.setup("fit")
        for plan, reference in (
            (reused.plan_for_epoch(0), fresh.plan_for_epoch(0)),
            (reused.val_plan(), fresh.val_plan()),
        ):
            assert (plan.world_size, plan.accumulate) == (world, reference.accumulate)
            for field in ("members", "offsets", "step_level"):
                assert getattr(plan, field).tolist() == getattr(reference, field).tolist()
        assert reused.plan_for_epoch(0).accumulate == accumulate
    with pytest.raises(ConfigError, match=r"set Trainer\(use_distributed_sampler=False\)"):
        reused.trainer = None
        quiet_trainer(use_distributed_sampler=True).validate(make_module(vocab=reused.vocab_size), reused)


def test_weight_averaging_under_deepspeed_is_refused_where_no_checkpoint_would_hold_the_average(
    chat_data, toy_tokenizer, tmp_path
):
    """Lightning's EMAWeightAveraging puts its average in a checkpoint's state_dict, which a DeepSpeed save leaves
    out (its folder holds the engine's weights): the export of a DeepSpeed run held the current weights, 4.3e-3 off
    the average, without a word. Refused before the first step."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lit_hbp.lightning.strategy import HBPStrategy, release_process_groups

    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=[{"pack_len": 128}],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    steps = []
    count = type("Count", (L.Callback,), {"on_train_batch_start": lambda self, *a: steps.append(1)})()
    trainer = quiet_trainer(max_steps=2, strategy=HBPStrategy(stage=2), callbacks=[EMAWeightAveraging(), count])
    try:
        with pytest.raises(ConfigError, match="EMAWeightAveraging: under DeepSpeed .* the averaged weights reach no"):
            trainer.fit(make_module(vocab=dm.vocab_size), dm)
    finally:
        release_process_groups()
    assert steps == []


def test_a_setting_the_model_cannot_take_is_a_config_error_naming_it():
    """freeze_vision on a text-only model stopped with a plain ValueError (a traceback from the command line):
    a ConfigError naming model.freeze_vision now (the CLI's short error, exit 2)."""
    from lit_hbp.errors import ConfigError

    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, freeze_vision=True, self_check=False)
    with pytest.raises(ConfigError, match="^model.freeze_vision: freeze_vision: LlamaForCausalLM has no vision tower"):
        module.configure_model()


def test_the_modules_clipping_is_torchs_clipping_by_the_global_norm():
    """``configure_gradient_clipping`` where nothing scales the gradients: every gradient times
    max_norm / (global L2 norm + 1e-6) when the norm exceeds max_norm, computed here by hand; under
    the norm, untouched; with fp16's loss scaler (or by value) Lightning's own clipping is called."""
    import types

    module = make_module()
    params = [p for p in module.model.parameters() if p.requires_grad]
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p) * 3
    want = [p.grad.clone() for p in params]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in want))
    from lightning.pytorch.strategies import SingleDeviceStrategy

    plugin = types.SimpleNamespace(scaler=None)
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    module._trainer = types.SimpleNamespace(precision_plugin=plugin, strategy=strategy)
    optimizer = torch.optim.SGD(params, lr=0.1)
    module.configure_gradient_clipping(optimizer, 1.0, "norm")
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad.double(), g.double() * (1.0 / (norm + 1e-6)), rtol=1e-5, atol=1e-7)
    module.configure_gradient_clipping(optimizer, 1e9, "norm")  # under the norm: untouched
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad.double(), g.double() * (1.0 / (norm + 1e-6)), rtol=1e-5, atol=1e-7)
    called = []
    module.clip_gradients = lambda *a: called.append(a)
    plugin.scaler = object()
    module.configure_gradient_clipping(optimizer, 1.0, "norm")
    plugin.scaler = None
    module.configure_gradient_clipping(optimizer, 0.5, "value")
    module._trainer.strategy = types.SimpleNamespace()  # a sharding strategy's norm is over shards: Lightning's
    module.configure_gradient_clipping(optimizer, 1.0, "norm")
    assert [a[1:] for a in called] == [(1.0, "norm"), (0.5, "value"), (1.0, "norm")]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_configure_optimizers_uses_and_logs_the_chosen_adamw(kind, monkeypatch, caplog):
    import types

    import lit_hbp.lightning.module as module_file

    seen = []
    monkeypatch.setattr(module_file, "adamw_kind", lambda params, device: seen.append(len(params)) or kind)
    module = make_module()
    strategy = types.SimpleNamespace(root_device=torch.device("cpu"))
    module._trainer = types.SimpleNamespace(strategy=strategy, estimated_stepping_batches=10)
    with caplog.at_level("INFO"):
        optimizer = module.configure_optimizers()["optimizer"]
    assert seen == [sum(1 for p in module.model.parameters() if p.requires_grad)]
    assert optimizer.defaults["fused"] is (True if kind == "fused" else None)
    assert f"optimizer: AdamW ({kind})" in caplog.text


def test_fit_trains_offloaded_tiled_levels_and_warns_of_one_that_will_not_fit(
    chat_data, toy_tokenizer, tmp_path, monkeypatch
):
    """A level's offload and mlp_tiles reach the model at every micro-step; on a GPU whose memory a level's
    predicted peak exceeds, fit warns naming the level (the GPU's memory faked: 1.5 GiB, less than the
    2 GB the cost model reserves for a CUDA context)."""
    import lit_hbp.lightning.module as module_mod
    from lit_hbp import offload as offload_mod

    monkeypatch.setattr(module_mod, "device_memory", lambda device: 1.5 * 2**30)
    packed = []
    pack = offload_mod.HostOffload._pack
    monkeypatch.setattr(offload_mod.HostOffload, "_pack", lambda self, t: packed.append(t.shape) or pack(self, t))
    tiled = []
    tiled_forward = TiledMLP.forward
    monkeypatch.setattr(
        TiledMLP, "forward", staticmethod(lambda ctx, f, n, *a: tiled.append(n) or tiled_forward(ctx, f, n, *a))
    )
    dm = HBPDataModule(
        sources=[{"path": str(chat_data)}],
        tokenizer=toy_tokenizer,
        levels=[{"pack_len": 40}, {"pack_len": 256, "ckpt_layers": 3, "offload": True, "mlp_tiles": 4}],
        cache_dir=str(tmp_path / "cache"),
    )
    module = make_module(vocab=dm.vocab_size)
    seen = []

    class Levels(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch.level, batch.offload, batch.mlp_tiles))

    trainer = quiet_trainer(devices=1, max_epochs=1, callbacks=[Levels()])
    with pytest.warns(UserWarning) as warned:
        trainer.fit(module, dm)
    lines = [str(w.message) for w in warned if "will not fit" in str(w.message)]
    assert len(lines) == 2 and "level 0 (40 tokens, sp 1, ckpt 0) will not fit: 1.9 GiB" in lines[0]
    assert "level 1 (256 tokens, sp 1, ckpt 3 offload mlp_tiles 4) will not fit" in lines[1]
    assert "the device has 1.5 GiB" in lines[1] and "raise mlp_tiles, sp or the ZeRO stage" in lines[1]
    assert (1, True, 4) in seen and (0, False, 1) in seen
    hidden = module.model.config.hidden_size
    level1 = sum(1 for level, _, _ in seen if level == 1)
    assert len(packed) == 3 * level1 and all(shape[-1] == hidden for shape in packed)  # 3 inputs per step, to the host
    assert tiled and set(tiled) == {4}  # only the 256-token level's MLPs ran tiled


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gpt_oss", "mamba2", "zamba"])
def test_configure_optimizers_decays_what_hf_trainer_decays_but_vectors(family):
    """The decay groups are Hugging Face Trainer's (no decay for any name with a bias or a norm: a MoE's 2-D
    expert biases, a state-space layer's dt bias) but for parameters of fewer than two dimensions, which are
    never decayed (A_log, D, scales: nanoGPT's and Mamba's rule): every parameter in exactly one group."""
    import types

    from families import small_config
    from transformers import Trainer

    module = make_module(small_config(family), weight_decay=0.1)
    module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    module._trainer.estimated_stepping_batches = 10
    groups = module.configure_optimizers()["optimizer"].param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    plain = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    hf = set(Trainer.get_decay_parameter_names(None, module.model))
    params = dict(module.model.named_parameters())
    expected = {id(p) for name, p in params.items() if name in hf and p.dim() >= 2}
    assert decayed == expected
    assert plain == {id(p) for p in params.values()} - expected


def test_a_training_step_taking_lightnings_dataloader_iter_is_refused_at_fit_start(chat_data, toy_tokenizer, tmp_path):
    """Lightning hands a ``training_step(dataloader_iter)`` module's batch hooks no batch and moves none to the
    device: the run died at its first micro-batch saying it got no PackedBatch; it stops before, naming the hook."""

    class IterModule(HBPLitModule):
        def training_step(self, dataloader_iter):
            batch, batch_idx, _ = next(dataloader_iter)
            return super().training_step(batch, batch_idx)

    dm = HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    torch.manual_seed(0)
    module = IterModule(model=TINY, vocab_size=dm.vocab_size, self_check=False)
    with pytest.raises(ConfigError, match=r"IterModule.training_step\(dataloader_iter\): .*take it"):
        quiet_trainer(devices=1, max_steps=2).fit(module, dm)


def test_a_checkpoint_whose_groups_decayed_2d_biases_resumes_on_its_own_groups(chat_data, toy_tokenizer, tmp_path):
    """A run saved when the AdamW groups decayed every parameter of two or more dimensions not named norm (gpt-oss's
    2-D expert biases among them) resumes: torch's optimizer refused the saved state ("a parameter group that
    doesn't match the size"); the run keeps the checkpoint's groups and says so. Reference: the old rule, written
    here by hand."""
    from families import small_config
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lit_hbp.lightning.module as module_file

    def old_rule(model, weight_decay, saved=None):
        decay, plain = [], []
        for name, p in model.named_parameters():
            (plain if p.dim() < 2 or "norm" in name.lower() else decay).append(p)
        return [dict(params=decay, weight_decay=weight_decay), dict(params=plain, weight_decay=0.0)]

    def data():
        return HBPDataModule(sources=[{"path": str(chat_data)}], tokenizer=toy_tokenizer, levels=["96:1", "256:1"],
                             cache_dir=str(tmp_path / "cache"))  # fmt: skip

    config = {k: v for k, v in small_config("gpt_oss").items() if k != "vocab_size"}  # the tokenizer's
    dm = data()
    module = make_module(config, vocab=dm.vocab_size, weight_decay=0.1, self_check=False)
    real = module_file.decay_groups
    module_file.decay_groups = old_rule
    try:
        saving = ModelCheckpoint(dirpath=tmp_path, filename="old", every_n_train_steps=2)  # at the step, in the epoch
        trainer = quiet_trainer(devices=1, max_steps=2, enable_checkpointing=True, callbacks=[saving])
        trainer.fit(module, dm)
        saved = [len(g["params"]) for g in trainer.optimizers[0].param_groups]
    finally:
        module_file.decay_groups = real
    assert saved != [len(g["params"]) for g in real(module.model, 0.1)]  # the two rules differ on this model
    module = make_module(config, vocab=dm.vocab_size, weight_decay=0.1, self_check=False)
    trainer = quiet_trainer(devices=1, max_steps=3)
    with pytest.warns(UserWarning, match="the resumed run keeps its groups"):
        trainer.fit(module, data(), ckpt_path=str(tmp_path / "old.ckpt"))
    assert trainer.global_step == 3
    assert [len(g["params"]) for g in trainer.optimizers[0].param_groups] == saved


def test_lora_settings_that_match_nothing_in_the_model_are_refused():
    """peft takes ``modules_to_save`` naming no module and ``bias: all`` on a model without biases and trains what it
    would without them, saying nothing; each is refused naming the setting. What matches trains: ``lm_head`` saved
    (its weight trains), a model with biases (Qwen2's projections) trains them with ``bias: all``."""
    with pytest.raises(ConfigError, match="model.lora.modules_to_save: 'nope' is no module of LlamaForCausalLM"):
        make_module(lora={"rank": 4, "modules_to_save": ["nope"]})
    with pytest.raises(ConfigError, match="model.lora.bias: 'all' trains the model's biases, and LlamaForCausalLM has"):
        make_module(lora={"rank": 4, "bias": "all"})
    for lora, says in (  # peft's own refusals: one ConfigError line (the command line's exit 2), not a traceback
        ({"target_modules": ["nonexistent"]}, r"Target modules \{'nonexistent'\} not found"),
        ({"layers_to_transform": [99]}, "`layers_to_transform` cannot be used when `target_modules` is a str"),
    ):
        with pytest.raises(
            ConfigError, match=rf"^model.lora: peft refuses these settings on LlamaForCausalLM: .*{says}"
        ):
            make_module(lora={"rank": 4, **lora})
    saved = make_module(lora={"rank": 4, "modules_to_save": ["lm_head"]})
    trained = {name for name, p in saved.model.named_parameters() if p.requires_grad}
    assert any("lm_head" in name and "lora" not in name for name in trained), sorted(trained)
    qwen2 = make_module({**TINY, "model_type": "qwen2"}, lora={"rank": 4, "bias": "all"})
    trained = {name for name, p in qwen2.model.named_parameters() if p.requires_grad}
    assert any(name.endswith("q_proj.base_layer.bias") for name in trained), sorted(trained)


def test_a_config_mappings_dtype_is_the_exports_and_the_model_trains_in_the_runs_precision():
    """``model: {..., dtype: bfloat16}``: transformers' ``from_config`` built the weights in bf16 whatever the run's
    precision, so a ``32-true`` run took AdamW steps on bf16 weights (three quarters of them unchanged by 2 steps at
    lr 2e-5); a folder whose config says bf16 loads in the run's precision. Now both: the weights in the default
    dtype the run's precision sets (fp32, or bf16 under ``bf16-true``), the mapping's dtype kept for the export."""
    from lit_hbp.model.build import SAVED_DTYPE

    mapping = {**TINY, "dtype": "bfloat16"}
    module = make_module(mapping)
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}
    assert getattr(module.model, SAVED_DTYPE) == "bfloat16"
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what Lightning's bf16-true sets around configure_model
    try:
        half = make_module(mapping)
    finally:
        torch.set_default_dtype(before)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
