"""Validation: a held-out split that never meets training, every sample evaluated once per run over
ranks and SP groups, val/loss equal to a single-process token mean, and validation interleaved
with a mid-epoch resume."""

import copy
import json

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_LLAMA, quiet_trainer
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule

TINY = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    rng = np.random.default_rng(11)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    folder = tmp_path_factory.mktemp("val")
    for name, n_rec in (("train.jsonl", 120), ("extra.jsonl", 15)):
        with (folder / name).open("w") as f:
            for i in range(n_rec):
                n = int(rng.integers(60, 150)) if i % 9 == 0 else int(rng.integers(2, 25))
                q, a = " ".join(rng.choice(words, n)), " ".join(rng.choice(words, rng.integers(2, 20)))
                f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return folder


def datamodule(chats, tokenizer, cache, levels=("96:1", "384:1"), **kw) -> HBPDataModule:
    return HBPDataModule(
        sources=[{"path": str(chats / "train.jsonl"), "repeat": 2}],
        tokenizer=tokenizer,
        levels=list(levels),
        cache_dir=str(cache),
        **kw,
    )


def test_held_out_records_never_train_and_val_sources_join_them(chats, toy_tokenizer, tmp_path):
    dm = datamodule(
        chats, toy_tokenizer, tmp_path, val_fraction=0.1, val_sources=[{"path": str(chats / "extra.jsonl")}]
    )
    dm.setup("fit")
    train = {(int(s), int(r)) for s, r in zip(dm.store.source_of, dm.store.row_of)}
    val = [(int(s), int(r)) for s, r in zip(dm.val_store.source_of, dm.val_store.row_of)]
    held = [x for x in val if x[0] == 0]
    extra = [x for x in val if x[0] == 1]
    assert len(held) == 12 and len(set(held)) == 12 and not set(held) & train  # 10% of 120 records
    assert sorted(r for _, r in extra) == list(range(15))
    # Every repeat of a held-out record left training: 108 records x 2 repeats remain.
    assert dm.store.lengths.size == 2 * 108
    # The same split on every rank and every run (seeded).
    again = datamodule(chats, toy_tokenizer, tmp_path, val_fraction=0.1)
    again.setup("fit")
    assert np.array_equal(again.val_store.row_of, dm.val_store.row_of[: len(held)])
    with pytest.raises(ValueError, match="val_sources: .* has a repeat or weight"):
        datamodule(chats, toy_tokenizer, tmp_path, val_sources=[{"path": str(chats / "extra.jsonl"), "repeat": 2}])


def validate_on_world(chats: str, tokenizer: str, cache: str) -> dict:
    """A 2-process HBPStrategy run (levels sp 1 and sp 2) that validates after its first step with
    lr 0; returns val/loss, the samples each rank evaluated and the weights."""
    from pathlib import Path

    import deepspeed

    from lit_hbp.lightning.strategy import HBPStrategy

    seen = []

    class Seen(L.Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if not trainer.sanity_checking:
                seen.append((batch.sp, batch.sp_rank, batch.sample_index.tolist()))

    dm = datamodule(Path(chats), tokenizer, cache, levels=("96:1", "384:2"), val_fraction=0.25)
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lr=0.0, weight_decay=0.0)
    trainer = quiet_trainer(
        devices=2,
        strategy=HBPStrategy(stage=2),
        max_steps=1,
        val_check_interval=1,
        num_sanity_val_steps=0,
        callbacks=[Seen()],
    )
    trainer.fit(module, dm)
    params = list(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        weights = {n: p.detach().clone() for n, p in params}
    # `trainer.validate` alone, as `lit-hbp validate` runs it: DeepSpeed's inference engine on CPU.
    alone = quiet_trainer(devices=2, strategy=HBPStrategy(stage=2)).validate(module, dm, verbose=False)
    return dict(
        loss=float(trainer.callback_metrics["val/loss"]), alone=alone[0]["val/loss"], seen=seen, weights=weights
    )


@pytest.mark.slow
def test_validation_loss_on_two_ranks_with_sp_equals_one_process(chats, toy_tokenizer, tmp_path, shared_pool2):
    results = shared_pool2.run(validate_on_world, str(chats), toy_tokenizer, str(tmp_path / "cache"))
    dm = datamodule(chats, toy_tokenizer, tmp_path / "cache", val_fraction=0.25)  # the same split on one process
    dm.setup("fit")
    # Every validation sample evaluated once: by one SP group (both of its ranks hold it), or one rank at sp 1.
    owners = [i for r in results for sp, sp_rank, ids in r["seen"] if sp_rank == 0 for i in ids]
    assert sorted(owners) == list(range(dm.val_store.lengths.size))
    assert {sp for r in results for sp, *_ in r["seen"]} == {1, 2}
    # The single-process reference: HF's own attention, each sample alone, token mean over the set.
    torch.manual_seed(0)
    ref = HBPLitModule(model=TINY, vocab_size=dm.vocab_size)
    ref.configure_model()
    net = copy.deepcopy(ref.model)
    net.set_attn_implementation("sdpa")
    net.load_state_dict(results[0]["weights"])
    ce, targets = 0.0, 0
    with torch.no_grad():
        for i in range(dm.val_store.lengths.size):
            ids, target = dm.val_store.tokens(i)
            ids = torch.as_tensor(ids).long()
            labels = torch.where(torch.as_tensor(target[1:]), ids[1:], -100)
            logits = net(input_ids=ids[None], use_cache=False).logits[0, :-1]
            ce += F.cross_entropy(logits, labels, reduction="sum").item()
            targets += int((labels != -100).sum())
    for r in results:
        assert r["loss"] == pytest.approx(ce / targets, abs=1e-5)
        assert r["alone"] == pytest.approx(r["loss"], rel=1e-6)


class Trace(L.Callback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append((trainer.current_epoch, batch.micro_index, tuple(batch.sample_index.tolist())))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def fit_with_validation(chats, tokenizer, tmp_path, name, max_steps, ckpt_path=None):
    L.seed_everything(0)
    dm = HBPDataModule(
        sources=[{"path": str(chats / "train.jsonl")}],
        tokenizer=tokenizer,
        levels=["96:1", "384:1"],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.2,
    )
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lr=1e-3)
    trace = Trace()
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / name, every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    trainer = quiet_trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=0,
        callbacks=[trace, saver],
        enable_checkpointing=True,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trace


@pytest.mark.slow
def test_validation_and_a_mid_epoch_resume_interleave(chats, toy_tokenizer, tmp_path):
    full = fit_with_validation(chats, toy_tokenizer, tmp_path, "full", 8)
    assert [step for step, _ in full.val] == [2, 4, 6, 8]
    resumed = fit_with_validation(chats, toy_tokenizer, tmp_path, "again", 8, tmp_path / "full" / "step=3.ckpt")
    assert resumed.train == full.train[6:]
    assert [s for s, _ in resumed.val] == [4, 6, 8]
    np.testing.assert_allclose([v for _, v in resumed.val], [v for _, v in full.val[1:]], rtol=1e-6)


def test_validate_without_a_validation_split_is_a_config_error(chats, toy_tokenizer, tmp_path):
    """`lit-hbp validate` on data without a split would evaluate nothing and say nothing."""
    from lit_hbp.errors import ConfigError

    dm = datamodule(chats, toy_tokenizer, tmp_path)
    with pytest.raises(ConfigError, match="nothing to validate: .* set data.val_fraction .* or data.val_sources"):
        dm.setup("validate")
    dm.setup("fit")  # training without validation is fine


def test_a_training_set_the_over_length_policy_empties_is_refused_by_its_cause(chats, toy_tokenizer, tmp_path):
    """Every sample over the largest level: the set-up passed with none, and the plan stopped with "empty dataset:
    every source empty, or every sample skipped", naming neither the levels nor over_length."""
    from lit_hbp.errors import DataError

    dm = datamodule(chats, toy_tokenizer, tmp_path / "cache", levels=("2:1",), over_length="drop")
    with pytest.raises(DataError, match=r"every training sample \(240\) is longer than the largest level \(2 tokens\) "
                       r"and data.over_length: drop left none: add a larger level"):  # fmt: skip
        dm.setup("fit")


def test_a_second_call_of_the_same_trainer_takes_its_own_data_modules_levels(chats, toy_tokenizer, tmp_path):
    """``trainer.fit(m, dm1)`` then ``trainer.validate(m, dm2)`` with other levels: the strategy kept the first call's
    levels as if its caller had given them, and refused ("give the levels once"). Reference: the same weights
    validated on dm2 by a fresh trainer."""
    from lit_hbp.lightning.strategy import HBPDDPStrategy

    dm1 = datamodule(chats, toy_tokenizer, tmp_path / "cache", val_fraction=0.1)
    dm2 = datamodule(chats, toy_tokenizer, tmp_path / "cache", levels=("384:1",), val_fraction=0.1)
    module = HBPLitModule(model=TINY, vocab_size=dm1.vocab_size, self_check=False)
    trainer = quiet_trainer(strategy=HBPDDPStrategy(), max_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, dm1)
    got = trainer.validate(module, dm2, verbose=False)[0]["val/loss"]
    fresh = quiet_trainer(strategy=HBPDDPStrategy(), default_root_dir=tmp_path)
    assert got == pytest.approx(fresh.validate(module, dm2, verbose=False)[0]["val/loss"], rel=1e-6)


def test_each_modules_mode_is_kept_through_the_sanity_validation_into_training(chats, toy_tokenizer, tmp_path):
    """A layer the user put in eval mode (no dropout there) was put back in train mode as training started, as
    Lightning does not: its evaluation loop restores each module's mode, and a fit starts in the modes it is given.
    The rest of a checkpoint folder's model trains in train mode (``from_pretrained`` returns it in eval)."""
    modes = []

    class Peek(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:
                modes.extend([module.model.training, module.model.model.layers[0].training,
                              module.model.model.layers[1].training])  # fmt: skip

    dm = datamodule(chats, toy_tokenizer, tmp_path / "cache", val_fraction=0.1)
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, self_check=False)
    module.configure_model()
    module.model.model.layers[0].eval()
    trainer = quiet_trainer(max_steps=1, default_root_dir=tmp_path, num_sanity_val_steps=2, callbacks=[Peek()])
    trainer.fit(module, dm)
    assert trainer.sanity_checking is False and modes == [True, False, True]


def test_a_deepspeed_folder_given_to_hbp_ddp_is_refused_by_name(chats, toy_tokenizer, tmp_path):
    """``Trainer.validate(ckpt_path=<HBPStrategy's folder>)`` under HBPDDPStrategy stopped in torch's
    IsADirectoryError; the folder is named, with what loads it."""
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.strategy import HBPDDPStrategy

    folder = tmp_path / "step=2.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    torch.save({"module": {}}, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    (folder / "latest").write_text("checkpoint")
    dm = datamodule(chats, toy_tokenizer, tmp_path / "cache", val_fraction=0.1)
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(strategy=HBPDDPStrategy(), default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"step=2.ckpt: a DeepSpeed checkpoint folder \(HBPStrategy's\), which"):
        trainer.validate(module, dm, ckpt_path=str(folder))


@pytest.fixture(scope="module")
def duplicated(tmp_path_factory, toy_tokenizer):
    """Two sources whose records repeat on other lines and in the other source (as scraped chat sets do):
    each source's tokens and its records' raw lines."""
    from transformers import AutoTokenizer

    from lit_hbp.data.sources import Source
    from lit_hbp.data.tokenize import tokenize_source

    rng = np.random.default_rng(3)
    pool = [{"prompt": f"question {i}", "response": " ".join(["fox"] * int(rng.integers(1, 6)))} for i in range(30)]
    folder = tmp_path_factory.mktemp("dups")
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    out = []
    for name, n in (("a.jsonl", 40), ("b.jsonl", 15)):
        lines = [json.dumps(pool[int(i)]) for i in rng.integers(0, len(pool), n)]
        (folder / name).write_text("\n".join(lines) + "\n")
        out.append((tokenize_source(Source(str(folder / name)), tok, progress=False), lines))
    # More distinct records than the largest fraction drawn holds out (0.3 of 55 lines): the chosen records and
    # their copies always leave some to train (else the hold-out refuses, as the next test checks).
    assert len({line for _, lines in out for line in lines}) > round(0.3 * 55)
    return out


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.02, 0.3), seed=st.integers(0, 2**31), repeat=st.sampled_from([1, 2]))
def test_no_copy_of_a_held_out_record_trains(duplicated, fraction, seed, repeat):
    """The hold-out takes every copy of a chosen record (its line repeated elsewhere, in either source) with it:
    no raw record validates and trains; the rest of the records all train; at least the fraction asked is held."""
    from dataclasses import replace as with_repeat

    from lit_hbp.data.store import SampleStore

    sources = [with_repeat(t, source=with_repeat(t.source, repeat=repeat)) for t, _ in duplicated]
    store = SampleStore.build(sources, None)
    rest, held_source, held_row = store.hold_out(fraction, seed)

    def line(k, row):
        return duplicated[k][1][int(sources[k].rows[row]) - 1]

    val = {line(k, r) for k, r in zip(held_source, held_row)}
    train = {line(k, r) for k, r in zip(rest.source_of, rest.row_of)}
    every = {line(k, r) for k in range(2) for r in range(len(sources[k]))}
    assert not val & train and val | train == every
    assert len(held_source) >= max(1, round(fraction * sum(len(s) for s in sources)))
    assert rest.lengths.size == repeat * (sum(len(s) for s in sources) - len(held_source))


def test_a_hold_out_whose_copies_take_every_record_is_refused(duplicated):
    """One record on every line: holding it out holds out all its copies, so nothing would train: refused, naming
    the fraction and the copies, rather than a run with no training record."""
    from lit_hbp.data.store import SampleStore
    from lit_hbp.errors import DataError

    (tokens, lines), _ = duplicated
    line_of = [lines[int(tokens.rows[r]) - 1] for r in range(len(tokens))]
    most = max(line_of, key=line_of.count)
    first = [r for r, line in enumerate(line_of) if line == most]
    assert len(first) > 1  # the fixture repeats it
    store = SampleStore.from_rows([tokens], np.zeros(len(first), np.int64), np.asarray(first, np.int64))
    copies = len(first) - 1
    with pytest.raises(DataError, match=rf"val_fraction 0.1 leaves no training record of {len(first)}: with their "
                                        rf"copies \({copies} records equal to a held-out one\)"):  # fmt: skip
        store.hold_out(0.1, 0)


@pytest.mark.parametrize("val_fraction", [0.0, 0.1])
def test_val_sources_records_that_train_are_counted_and_named(chats, toy_tokenizer, tmp_path, val_fraction):
    """A val_sources line equal to a training line that trains (copied, even twice) is counted in the report and
    the summary; lines held out of training (val_fraction) or new ones are not. Reference: the raw lines."""
    train_lines = (chats / "train.jsonl").read_text().splitlines()
    extra_lines = (chats / "extra.jsonl").read_text().splitlines()
    val_lines = [train_lines[3], extra_lines[0], train_lines[40], train_lines[40], *extra_lines[1:4], train_lines[99]]
    (tmp_path / "val.jsonl").write_text("\n".join(val_lines) + "\n")
    dm = datamodule(
        chats, toy_tokenizer, tmp_path / "cache", val_fraction=val_fraction, val_sources=[str(tmp_path / "val.jsonl")]
    )
    dm.setup("fit")

    def line_of(where: str) -> int:
        return int(where.rsplit(":", 1)[1])

    trains = {train_lines[line_of(dm.store.where(i)) - 1] for i in range(dm.store.lengths.size)}
    assert len(trains) == (120 if not val_fraction else 108)
    expected = [k for k, line in enumerate(val_lines) if line in trains]
    report = dm.val_store.report
    assert report["records_that_train"] == len(expected) > 0
    assert all(w.startswith(str(tmp_path / "val.jsonl")) for w in report["records_that_train_where"])
    assert [line_of(w) - 1 for w in report["records_that_train_where"]] == expected[:3]
    assert f"{len(expected)} record(s) of val_sources equal a training record" in dm.val_store.summary()
    without = datamodule(chats, toy_tokenizer, tmp_path / "cache", val_sources=[str(chats / "extra.jsonl")])
    without.setup("fit")
    assert without.val_store.report["records_that_train"] == 0
    assert "equal a training record" not in without.val_store.summary()


def test_over_length_error_names_the_training_samples_and_the_held_out_ones(chats, toy_tokenizer, tmp_path):
    """With ``over_length: error`` the validation set was checked first: the error named its one over-long sample
    "in all" and none of the training set's. Reference: the training samples ``drop`` drops, by their lines."""
    import re

    from lit_hbp.errors import DataError

    kept = datamodule(chats, toy_tokenizer, tmp_path / "cache", levels=("48:1", "96:1"), val_fraction=0.1,
                      over_length="drop")  # fmt: skip
    kept.setup("fit")
    dropped = kept.store.final_report()["dropped"]  # every training sample dropped, by file:line
    refused = datamodule(chats, toy_tokenizer, tmp_path / "cache", levels=("48:1", "96:1"), val_fraction=0.1)
    with pytest.raises(DataError) as e:
        refused.setup("fit")
    said = str(e.value)
    assert int(re.match(r"(\d+) sample\(s\) longer than the largest level", said).group(1)) == len(dropped), said
    assert f"{dropped[0]} (" in said, said
    # and the held-out ones in the same error, not one error at a time
    held = kept.val_store.final_report()["dropped"]
    assert held, "the held-out share has an over-long sample"
    assert re.search(rf"and of the validation set: {len(held)} sample\(s\) longer than the largest level", said), said
    assert f"{held[0]} (" in said and said.endswith("Add a larger level, or set over_length: drop | truncate"), said
