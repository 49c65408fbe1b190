"""A resumed run trains what the uninterrupted one trains (the same micro-batches at the same optimizer steps, the
same weights), or its checkpoint is refused by name: an epoch-bounded run resumed mid-epoch, a run stopped
mid-epoch (``max_time``, early stopping, a callback), a stop inside an optimizer step, an accumulation scheduled
by epoch. Each case trained otherwise before without a word (the epoch again from its first micro-batch; the rest
of an epoch skipped; a step on one micro-batch)."""

import logging
import types

import lightning as L
import pytest
import torch
from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from lit_hbp.callbacks import FinalCheckpoint
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.module import HBPLitModule

EPOCHS = dict(max_steps=-1, max_epochs=2, limit_train_batches=6)  # 3 optimizer steps an epoch, accumulate 2


class Trained(L.Callback):
    """The micro-batches trained: (epoch, micro-batch of the epoch's plan, global step after it)."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((batch.epoch, batch.micro_index, trainer.global_step))


class StopAt(L.Callback):
    """Sets ``should_stop`` after micro-batch ``at`` of the first epoch, as Lightning's Timer does at max_time."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.at:
            trainer.should_stop = True


class OwnModule(L.LightningModule):
    """A project's own module (docs/lightning.md): ``prepare_model`` + ``packed_loss``, its own optimizer."""

    def __init__(self, vocab_size: int):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        from lit_hbp import prepare_model

        config = AutoConfig.for_model(**TINY_LLAMA, vocab_size=vocab_size)
        self.model = prepare_model(AutoModelForCausalLM.from_config(config))

    def training_step(self, batch, batch_idx):
        from lit_hbp import packed_loss

        return packed_loss(self.model, batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def fit(
    root, demo, callbacks=(), ckpt_path=None, own_module=False, model=TINY_LLAMA, data=None, module=None,
    tokenizer=None, **trainer_kw,
):  # fmt: skip
    L.seed_everything(0)
    dm = chat_datamodule(demo, str(tokenizer or demo / "tokenizer"), root.parent / "cache", **(data or {}))
    torch.manual_seed(0)
    if own_module:
        module = OwnModule(dm.vocab_size)
    else:
        module = HBPLitModule(
            model=model, vocab_size=dm.vocab_size, **{"lr": 1e-3, "self_check": False, **(module or {})}
        )
    trained = Trained()
    kw = {"accumulate_grad_batches": 2, "default_root_dir": root, **EPOCHS, **trainer_kw}
    trainer = quiet_trainer(callbacks=[*callbacks, trained], **kw)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return types.SimpleNamespace(rows=trained.rows, weights=module.state_dict())


def assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_demo):
    """The uninterrupted run, with a checkpoint at every optimizer step."""
    from conftest import ProcessState

    root = tmp_path_factory.mktemp("resume") / "reference"
    every = ModelCheckpoint(root / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    state = ProcessState()
    try:
        run = fit(root, small_demo, [every], enable_checkpointing=True)
    finally:
        state.restore()
    run.ckpt = root / "ckpt"
    return run


def test_an_epoch_bounded_run_resumed_mid_epoch_continues_where_it_stopped(tmp_path, small_demo, reference):
    """``max_epochs`` without ``max_steps``: Lightning built the train loader to count the schedule's steps before
    the checkpoint was restored, and that loader never got its position: epoch 0 trained again from micro-batch 0."""
    assert [r[:2] for r in reference.rows] == [(e, k) for e in (0, 1) for k in range(6)]
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(reference.ckpt / "step=2.ckpt"))
    assert resumed.rows == reference.rows[4:]
    assert_same_weights(resumed.weights, reference.weights)


def test_an_epoch_bounded_deepspeed_run_resumed_mid_epoch_continues_where_it_stopped(tmp_path, small_demo):
    """The same under HBPStrategy, whose checkpoint DeepSpeed restores after its set-up: the schedule's steps are
    counted while the run names no checkpoint yet."""
    from lit_hbp.lightning.strategy import HBPStrategy, release_process_groups

    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    run = fit(tmp_path / "reference", small_demo, [every], strategy=HBPStrategy(stage=2), enable_checkpointing=True)
    release_process_groups()  # as at a run's exit (DeepSpeed's cached groups too); the suite's fixture does the rest
    resumed = fit(
        tmp_path / "resumed",
        small_demo,
        strategy=HBPStrategy(stage=2),
        ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"),
    )
    assert resumed.rows == run.rows[4:]
    assert_same_weights(resumed.weights, run.weights)


class Saves(FinalCheckpoint):
    """FinalCheckpoint, noting the optimizer steps it wrote a checkpoint at."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def save_final(self, trainer):
        written = super().save_final(trainer)
        self.steps += [trainer.global_step] if written else []
        return written


@pytest.mark.parametrize(
    "at, monitor", [(3, None), (2, None), (3, "train/loss")], ids=["at_a_steps_end", "inside_a_step", "ranked"]
)
def test_a_run_stopped_mid_epoch_resumes_the_rest_of_that_epoch(tmp_path, small_demo, reference, at, monitor):
    """A stop (``should_stop``, as max_time's Timer sets it at any micro-batch): FinalCheckpoint saves it at the
    step's end, before Lightning closes the epoch, holding a stop asked inside a step until its end. A save after
    the epoch closed resumed at the next epoch (the rest of this one never trained); one inside a step lacked the
    gradient of its first micro-batch. A callback ranking by a metric at the epoch's end (no validation) wrote
    last.ckpt again after the epoch closed, and no checkpoint of the run resumed: it ranks there as in Lightning
    (its top-k file is Lightning's), last.ckpt stays the step's."""
    last, saves = ModelCheckpoint(tmp_path / "ckpt", save_last=True, monitor=monitor, filename="{step}"), Saves()
    logs = dict(log_every_n_steps=1)  # train/loss at every step (the module logs at the steps loggers write)
    stopped = fit(tmp_path / "stopped", small_demo, [StopAt(at), last, saves], enable_checkpointing=True, **logs)
    assert stopped.rows == reference.rows[:4] and saves.steps == [2]
    files = ["last.ckpt", *(["step=2.ckpt"] if monitor else [])]  # the final step ranked best: the only one kept
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files
    assert last.save_last is True  # given back after the epoch's end
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.rows == reference.rows[4:]
    assert_same_weights(resumed.weights, reference.weights)


@pytest.mark.parametrize(
    "at, refused",
    [
        (2, r"saved inside an optimizer step \(epoch 0, micro-batch 3 of 6"),
        (3, r"stopped in epoch 0, micro-batch 4 of 6 and the checkpoint was written after Lightning closed the epoch"),
    ],
)
def test_a_checkpoint_no_resume_can_continue_exactly_is_refused(tmp_path, small_demo, at, refused):
    """Without FinalCheckpoint, Lightning's own ``last.ckpt`` after a stop is written once the epoch is closed: a
    resume started the next epoch, stepping at once on a micro-batch inside a step."""
    last = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "stopped", small_demo, [StopAt(at), last], enable_checkpointing=True)
    with pytest.raises(ConfigError, match=refused):
        fit(tmp_path / "resumed", small_demo, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


def test_a_resume_whose_limit_ends_the_epoch_before_the_checkpoints_position_is_refused(
    tmp_path, small_demo, reference
):
    """trainer.limit_train_batches lowered on resume to or below the checkpoint's position in its epoch: the log said
    the epoch was trained to its end and the next began, while Lightning trained the epoch again from its first
    micro-batch (samples twice, more steps than the schedule spans). Refused, naming the limit and the position; a
    limit past the position resumes where the run stopped."""
    with pytest.raises(ConfigError, match=r"trainer.limit_train_batches 4: it was saved at micro-batch 4 of epoch 0, "
                                          r"whose end the limit now puts at 4"):  # fmt: skip
        fit(tmp_path / "lowered", small_demo, ckpt_path=str(reference.ckpt / "step=2.ckpt"), limit_train_batches=4)
    resumed = fit(tmp_path / "same", small_demo, ckpt_path=str(reference.ckpt / "step=2.ckpt"))
    assert resumed.rows == reference.rows[4:]


def test_a_restore_no_command_line_read_refuses_other_settings_and_another_model_config(
    tmp_path, small_demo, reference
):
    """A checkpoint restored without the command line's checks (SLURM's requeue of hpc_ckpt_*.ckpt, a project's own
    ``Trainer.fit(ckpt_path=...)``) trained on with the module arguments it was given (``loss: sum`` for the
    checkpoint's ``ave_token``) and with a model folder's config edited since (RoPE's theta), without a word; only
    the optimizer's arguments were compared. Both are refused by name, and so is another tokenizer's vocabulary (it
    ended in torch's size-mismatch traceback); the same settings resume exactly."""
    ckpt = str(reference.ckpt / "step=2.ckpt")
    with pytest.raises(ConfigError, match=r"ckpt_path resumes the run as its checkpoint saved it, .* model.loss: "
                                          r"'sum' \(the checkpoint's 'ave_token'\)"):  # fmt: skip
        fit(tmp_path / "loss", small_demo, ckpt_path=ckpt, module={"loss": "sum"})
    from transformers import AutoTokenizer

    wider = AutoTokenizer.from_pretrained(small_demo / "tokenizer")
    wider.add_tokens([f"<extra_{i}>" for i in range(100)])  # another tokenizer: its embedding 100 rows larger
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ConfigError, match=r"model.vocab_size: \d+ \(the checkpoint's \d+\)"):  # not torch's traceback
        fit(tmp_path / "tokenizer", small_demo, ckpt_path=ckpt, tokenizer=tmp_path / "wider")
    rope = {**TINY_LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    with pytest.raises(ConfigError, match=r"model.model now builds another config: rope_parameters: .*500.0"):
        fit(tmp_path / "rope", small_demo, ckpt_path=ckpt, model=rope)
    resumed = fit(tmp_path / "same", small_demo, ckpt_path=ckpt)
    assert resumed.rows == reference.rows[4:]
    assert_same_weights(resumed.weights, reference.weights)


def test_a_stop_held_by_min_steps_is_saved_once_when_it_stops(tmp_path, small_demo):
    """Lightning trains on past ``should_stop`` until ``min_steps``: nothing is saved before then (a checkpoint at
    every step, under ZeRO a full one each), the final step once."""
    saves = Saves()
    ckpt = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    fit(
        tmp_path / "run",
        small_demo,
        [StopAt(1), ckpt, saves],
        enable_checkpointing=True,
        min_steps=4,
        min_epochs=0,
        limit_train_batches=12,
    )
    assert saves.steps == [4]


@pytest.mark.parametrize(
    "own_module, workers", [(False, 0), (True, 0), (False, 2)], ids=["hbp_module", "own_module", "loader_workers"]
)
def test_an_accumulation_scheduled_by_epoch_resumes_with_the_epochs_accumulation(
    tmp_path, small_demo, own_module, workers
):
    """A GradientAccumulationScheduler sets the accumulation at an epoch's start, which Lightning skips on a
    restart: resumed mid-epoch 1 (4 a step) it stepped on every micro-batch; resumed at epoch 0's end it was refused
    (its plan compared with epoch 1's accumulation). The loader sets it as its first batch is fetched (after the
    scheduler's own check at the fit's start: a loader with workers draws its first indices before that), so a
    project's own module resumes so too."""
    schedule = dict(accumulate_grad_batches=1, limit_train_batches=8, reload_dataloaders_every_n_epochs=1)
    schedule.update(own_module=own_module, data=dict(num_workers=workers))
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")
    reference = fit(
        tmp_path / "reference", small_demo, [every, GradientAccumulationScheduler({0: 2, 1: 4})],
        enable_checkpointing=True, **schedule,
    )  # fmt: skip
    assert [r[2] for r in reference.rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    for name, rest in (("epoch=0-step=4.ckpt", 8), ("epoch=1-step=5.ckpt", 12)):
        resumed = fit(
            tmp_path / name, small_demo, [GradientAccumulationScheduler({0: 2, 1: 4})],
            ckpt_path=str(tmp_path / "ckpt" / name), **schedule,
        )  # fmt: skip
        assert resumed.rows == reference.rows[rest:], name
        assert_same_weights(resumed.weights, reference.weights)


def test_a_resume_at_an_epochs_last_step_trains_all_of_a_longer_next_epoch(tmp_path, small_demo):
    """Resumed from the checkpoint of epoch 0's last step, a next epoch with more micro-batches (an accumulation
    scheduled by epoch, 2 then 4 a step: its steps padded alike; a seeded packer's draw) trained only the difference
    of the two lengths (2 of epoch 1's 36) and stopped, without a word: Lightning carried epoch 0's batch count into
    epoch 1. The resumed run trains what the uninterrupted one trains."""
    scheduled = [GradientAccumulationScheduler({0: 2, 1: 4})]
    run = dict(limit_train_batches=1.0, reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=1)

    def lengths(seed: int) -> list[int]:  # the two epochs' micro-batches of a data seed's draw of the chats
        dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache", **data(seed))
        dm.trainer = quiet_trainer(callbacks=[GradientAccumulationScheduler({0: 2, 1: 4})], **run)
        dm.setup("fit")
        return [dm.plan_for_epoch(epoch, say=False).n_micro_steps for epoch in (0, 1)]

    def data(seed: int) -> dict:
        return dict(packer="bfd", seed=seed, sources=[{"path": str(small_demo / "short.jsonl"), "repeat": 0.3}])

    seed = next(seed for seed in range(50) if (n := lengths(seed))[1] > n[0])
    run["data"] = data(seed)
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")
    reference = fit(tmp_path / "reference", small_demo, [every, *scheduled], enable_checkpointing=True, **run)
    epochs = [[r for r in reference.rows if r[0] == e] for e in (0, 1)]
    assert len(epochs[1]) > len(epochs[0])  # the case: a longer epoch 1
    last = epochs[0][-1][2]
    resumed = fit(
        tmp_path / "resumed",
        small_demo,
        scheduled,
        ckpt_path=str(tmp_path / "ckpt" / f"epoch=0-step={last}.ckpt"),
        **run,
    )
    assert resumed.rows == epochs[1]
    assert_same_weights(resumed.weights, reference.weights)


class DrawsAtStart(L.Callback):
    """Draws from torch's global generator when the fit starts, as a project's callback may."""

    def on_train_start(self, trainer, pl_module):
        torch.rand(3)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("at_step", [2, 3])
def test_dropout_draws_after_a_resume_the_masks_of_the_uninterrupted_run(tmp_path, small_demo, at_step, workers):
    """Lightning's checkpoints hold no random state: a resumed run drew its seed's dropout masks again (weights off
    the uninterrupted run's). Each rank's generators are saved with the loader's position and set as the first
    micro-batch is fetched (after the fit's start, whose callbacks may draw; with loader workers too); a
    validation between the save and the next step (after step 2) no longer moves them (the loaders draw from
    their own generator). Step 3 ends epoch 0: with workers and no reload the loader drew epoch 0's indices
    again (its sampler's epoch was set after the workers drew)."""
    dropout = {**TINY_LLAMA, "attention_dropout": 0.5}
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    run = dict(model=dropout, data=dict(val_fraction=0.1, num_workers=workers), val_check_interval=4)
    run.update(limit_val_batches=1, callbacks=[DrawsAtStart()])
    reference = fit(tmp_path / "reference", small_demo, [every, *run["callbacks"]], enable_checkpointing=True,
                    **{k: v for k, v in run.items() if k != "callbacks"})  # fmt: skip
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(tmp_path / "ckpt" / f"step={at_step}.ckpt"), **run)
    assert resumed.rows == reference.rows[2 * at_step :]
    assert_same_weights(resumed.weights, reference.weights)


class SavedAt(L.Callback):
    """The epoch's micro-batches trained at each checkpoint Lightning writes (the trainer's ``save_checkpoint``)."""

    def setup(self, trainer, pl_module, stage):
        self.at, save = [], trainer.save_checkpoint

        def recorded(*args, **kwargs):
            self.at.append(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            return save(*args, **kwargs)

        trainer.save_checkpoint = recorded


SAVES = {
    "steps": (dict(every_n_train_steps=1), {}),
    "steps_and_last": (dict(every_n_train_steps=1, save_last=True), {}),
    "steps_monitored": (dict(every_n_train_steps=1, monitor="val/loss"), {}),
    "after_validation": ({}, {}),
    "after_validation_by_share": ({}, dict(val_check_interval=0.5)),
    "after_validation_on_steps": ({}, dict(val_check_interval=4)),
    "no_validation_batches": ({}, dict(limit_val_batches=0)),
    "no_validation_data": ({}, dict(val_fraction=0.0)),
    "at_epoch_end": (dict(save_on_train_epoch_end=True), {}),
    "last_linked_without_top_k": (
        dict(every_n_train_steps=2, save_top_k=0, save_last="link"),
        dict(val_check_interval=7, limit_train_batches=12),
    ),
    "last_without_top_k": (dict(save_top_k=0, save_last=True), {}),
}


@pytest.mark.parametrize("case", SAVES)
def test_a_checkpoint_callback_is_refused_at_set_up_exactly_when_lightning_would_save_inside_a_step(
    tmp_path, small_demo, case, monkeypatch
):
    """``check_checkpoint_positions`` against where Lightning's ModelCheckpoint really saves (the check bypassed
    for the run): refused (before the data is read, or once the plan's length is known for a share of the epoch)
    exactly when a save falls inside an optimizer step. Validations every 3 micro-batches unless the case says."""
    import lit_hbp.lightning.datamodule as datamodule
    import lit_hbp.lightning.plan_checks as plan_checks
    from lit_hbp.lightning.plan_checks import check_checkpoint_positions

    checkpoint, run = SAVES[case]
    val_fraction = run.pop("val_fraction", 0.1)
    for bypassed in (
        datamodule,
        plan_checks,
    ):  # at set-up (the plan checks') and once the plan is known (the data module's)
        monkeypatch.setattr(bypassed, "check_checkpoint_positions", lambda *a, **k: None)
    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache", val_fraction=val_fraction)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    saved = SavedAt()
    kw = dict(accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1, **EPOCHS)
    kw.update(max_epochs=1, **run)
    callbacks = [ModelCheckpoint(tmp_path / "ckpt", **checkpoint), saved]
    trainer = quiet_trainer(callbacks=callbacks, enable_checkpointing=True, default_root_dir=tmp_path, **kw)
    trainer.fit(module, dm)
    assert saved.at, "the case saves something"
    inside = any(at % 2 for at in saved.at)
    validates = val_fraction > 0
    micro_steps = dm.plan_for_epoch(0).n_micro_steps
    refused = []
    for args in ((trainer, validates), (trainer, validates, micro_steps, 2)):
        try:
            check_checkpoint_positions(*args)
        except ConfigError:
            refused.append(args)
    assert bool(refused) == inside, (saved.at, refused)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_of_an_epochs_end_resumes_the_next_epoch_with_its_random_state(tmp_path, small_demo, workers):
    """Written in ``on_train_epoch_end`` (an epoch-end ModelCheckpoint) of a run bounded by ``max_epochs``:
    Lightning restores no loader position then (it never calls the loader's ``load_state_dict``) and builds the
    iterator before it sets the sampler's epoch: with workers they drew epoch 0's micro-batches again, and the
    random state (once the loader's) was never set. Built lazily, with the generators in the data module's state."""
    dropout = {**TINY_LLAMA, "attention_dropout": 0.5}
    ends = ModelCheckpoint(tmp_path / "ckpt", save_on_train_epoch_end=True, save_top_k=-1, filename="{epoch}")
    run = dict(model=dropout, data=dict(num_workers=workers))
    reference = fit(tmp_path / "reference", small_demo, [ends], enable_checkpointing=True, **run)
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"), **run)
    assert resumed.rows == reference.rows[6:]
    assert_same_weights(resumed.weights, reference.weights)


def test_a_checkpoint_of_an_epochs_end_in_a_run_bounded_by_steps_is_refused(tmp_path, small_demo):
    """Lightning resumes it with the next epoch's micro-batches as the finished epoch's (plain Lightning too): at
    the epoch's end (epoch=0.ckpt, step 3) and after max_steps stopped inside an epoch (epoch=1.ckpt, step 5 of 6;
    it trained epoch 2's first micro-batches as epoch 1's rest). A resume with nothing left to train is no error."""
    ends = ModelCheckpoint(tmp_path / "ckpt", save_on_train_epoch_end=True, save_top_k=-1, filename="{epoch}")
    fit(tmp_path / "reference", small_demo, [ends], enable_checkpointing=True, max_steps=5, max_epochs=-1)
    refused = {
        "epoch=0.ckpt": r"written at the end of epoch 0 \(on_train_epoch_end\) of a run bounded",
        "epoch=1.ckpt": r"written after its run stopped in epoch 1 at micro-batch 4 of 6 and Lightning closed it",
    }
    for name, says in refused.items():
        with pytest.raises(ConfigError, match=says):
            fit(tmp_path / name, small_demo, ckpt_path=str(tmp_path / "ckpt" / name), max_steps=6, max_epochs=-1)
    done = fit(tmp_path / "done", small_demo, ckpt_path=str(tmp_path / "ckpt" / "epoch=1.ckpt"), max_steps=5)
    assert done.rows == []


def test_with_final_checkpoint_an_epoch_end_checkpoint_of_a_run_bounded_by_steps_resumes_exactly(tmp_path, small_demo):
    """The case above with FinalCheckpoint (the CLI adds it): what the callback saves at an epoch's end is saved at
    that epoch's last step's end, before Lightning closes the epoch, and resumes exactly. A run with Lightning's
    default checkpoint callback alone (``configs/llama_1b_1gpu.yaml``) killed past its first epoch had no checkpoint
    a resume accepted."""
    ends = ModelCheckpoint(tmp_path / "ckpt", save_on_train_epoch_end=True, save_top_k=-1, filename="{epoch}")
    steps = dict(max_steps=6, max_epochs=-1)
    reference = fit(tmp_path / "reference", small_demo, [ends, FinalCheckpoint()], enable_checkpointing=True, **steps)
    assert torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["global_step"] == 3
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"), **steps)
    assert resumed.rows == reference.rows[6:]
    assert_same_weights(resumed.weights, reference.weights)


def test_a_resume_with_more_activation_checkpointing_or_without_the_curriculum_after_epoch_0_continues_exactly(
    tmp_path, small_demo, caplog
):
    """A level's ``ckpt_layers`` does not change the plan (more checkpointing is how a run that ran out of memory
    goes on), nor does ``HBPCurriculum`` after the first epoch: both were refused as "another plan". The resumed run
    trains the uninterrupted one's micro-batches to the same weights. A resume past the curriculum's warm-up does
    not announce it again (it said the warm-up came first, at a step after it)."""
    from lit_hbp.callbacks import HBPCurriculum

    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    curriculum = HBPCurriculum(warmup_steps=2)
    with caplog.at_level(logging.INFO):
        reference = fit(tmp_path / "reference", small_demo, [every, curriculum], enable_checkpointing=True)
    assert caplog.text.count("curriculum: 2 of 2 requested warm-up steps") == 1, caplog.text
    caplog.clear()
    more = dict(levels=["256:1:1", "1024:1:2"])
    with caplog.at_level(logging.INFO):
        resumed = fit(tmp_path / "ckpt_layers", small_demo, [HBPCurriculum(warmup_steps=2)], data=more,
                      ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))  # fmt: skip
    assert "requested warm-up steps" not in caplog.text and "moved to the front" in caplog.text
    assert resumed.rows == reference.rows[4:]
    assert_same_weights(resumed.weights, reference.weights)
    resumed = fit(tmp_path / "epoch_1", small_demo, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    assert resumed.rows == reference.rows[8:] and resumed.rows[0][0] == 1
    assert_same_weights(resumed.weights, reference.weights)


def test_a_resumed_run_does_not_save_its_checkpoints_step_again_inside_the_next_step(tmp_path, small_demo):
    """A ModelCheckpoint keeps no record of the step it saved last: resumed at step 2 with ``every_n_train_steps``
    it saved step 2 again after the first micro-batch, inside step 3, over the very file resumed from (which a
    later resume then refused)."""
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    reference = fit(tmp_path / "reference", small_demo, [every], enable_checkpointing=True)
    saved = SavedAt()
    again = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    step2 = str(tmp_path / "ckpt" / "step=2.ckpt")
    resumed = fit(tmp_path / "resumed", small_demo, [again, saved], step2, enable_checkpointing=True)
    assert saved.at and not any(at % 2 for at in saved.at), saved.at
    assert resumed.rows == reference.rows[4:]
    again_from_it = fit(tmp_path / "again", small_demo, ckpt_path=step2)
    assert again_from_it.rows == reference.rows[4:]


@pytest.mark.parametrize("at", [1, 2], ids=["between_logged_steps", "at_a_logged_step"])
def test_the_first_train_loss_after_a_resume_is_the_uninterrupted_runs(tmp_path, small_demo, at):
    """``train/loss`` averages every micro-step since the last logged step (here every second step): a checkpoint
    between two logged steps carries the loss of its steps since (a resumed run's first ``train/loss`` averaged
    only the steps after the resume); one saved at a logged step's end, read right after the save, carries none."""
    from test_hot_path import MemoryLogger

    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    whole, resumed = MemoryLogger(), MemoryLogger()
    fit(tmp_path / "whole", small_demo, [every], enable_checkpointing=True, logger=whole, log_every_n_steps=2)
    ckpt = str(tmp_path / "ckpt" / f"step={at}.ckpt")
    fit(tmp_path / "resumed", small_demo, logger=resumed, log_every_n_steps=2, ckpt_path=ckpt)
    want, got = whole.values("train/loss"), resumed.values("train/loss")
    assert sorted(want) == [1, 3, 5]  # the logger's step: global_step - 1
    assert sorted(got) == [step for step in (1, 3, 5) if step >= at]
    assert got == pytest.approx({step: want[step] for step in got}, rel=1e-6)


def test_a_run_that_never_logs_saves_its_checkpoints_with_the_loss_since_its_start(tmp_path, small_demo):
    """``log_every_n_steps=0`` (Lightning then never logs; ``barebones=True`` sets it): a save inside the step's end
    asked the logging schedule ``step % 0`` and failed; the checkpoint carries every micro-step's loss."""
    from lit_hbp.lightning.meter import PENDING_LOSS

    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(tmp_path / "run", small_demo, [every], enable_checkpointing=True, log_every_n_steps=0, max_steps=2)
    carried = [torch.load(tmp_path / "ckpt" / f"step={s}.ckpt", weights_only=False)[PENDING_LOSS] for s in (1, 2)]
    assert 0 < carried[0]["targets"] < carried[1]["targets"] and carried[0]["ce_sum"] < carried[1]["ce_sum"]


@pytest.mark.parametrize("max_steps", [-1, 100], ids=["bounded_by_epochs", "bounded_by_steps_too"])
def test_the_final_checkpoint_of_a_run_max_epochs_ends_is_lightnings_checkpoint_of_that_step(
    tmp_path, small_demo, max_steps
):
    """A run that ``max_epochs`` ends: FinalCheckpoint's file of its last step is the one Lightning's own
    ``every_n_train_steps`` callback writes at that step (its name, ``epoch=0-step=3.ckpt``, its stored epoch and loop
    state), and it resumes as that one does. Saved once Lightning had closed the epoch it was ``epoch=1-step=3.ckpt``
    (stored epoch 1), which a run with a ``max_steps`` resumed training nothing of epoch 1."""
    lightnings = ModelCheckpoint(tmp_path / "every", every_n_train_steps=1, save_top_k=-1)
    latest = ModelCheckpoint(tmp_path / "latest", every_n_train_steps=2)  # keeps its newest: step 2, then the final
    run = dict(max_steps=max_steps, data=dict(val_fraction=0.1), limit_val_batches=1)
    fit(tmp_path / "run", small_demo, [lightnings, latest, FinalCheckpoint()], enable_checkpointing=True,
        max_epochs=1, **run)  # fmt: skip
    (final,) = (tmp_path / "latest").iterdir()
    reference = tmp_path / "every" / final.name
    assert final.name == "epoch=0-step=3.ckpt" and reference.exists()
    saved, want = (torch.load(p, weights_only=False) for p in (final, reference))
    assert (saved["epoch"], saved["global_step"], saved["loops"]) == (want["epoch"], want["global_step"], want["loops"])
    resumed = fit(tmp_path / "resumed", small_demo, ckpt_path=str(final), max_epochs=2, **run)
    by_lightning = fit(tmp_path / "by_lightning", small_demo, ckpt_path=str(reference), max_epochs=2, **run)
    assert resumed.rows == by_lightning.rows and [r[:2] for r in resumed.rows] == [(1, k) for k in range(6)]
    assert_same_weights(resumed.weights, by_lightning.weights)


def test_a_finished_max_epochs_runs_own_final_checkpoint_is_complete(tmp_path, small_demo):
    """FinalCheckpoint saves the last step of the last epoch before Lightning closes it, so the checkpoint counts
    that epoch unprocessed: ``--ckpt_path auto`` on the finished run's line trained on (nothing to train, a new
    checkpoint with another random state that ``auto`` then preferred) instead of saying the run is complete, and a
    named one was not refused. The uninterrupted run's own checkpoint, read as the CLI reads it."""
    from lit_hbp.cli.resume import check_resumed_steps

    last = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "run", small_demo, [last, FinalCheckpoint()], enable_checkpointing=True)  # 2 epochs (EPOCHS)
    path = str(tmp_path / "ckpt" / "last.ckpt")
    said = check_resumed_steps({"ckpt_path": path, "trainer": {"max_epochs": 2, "max_steps": -1}}, found=True)
    assert said is not None and "after 2 epoch(s), trainer.max_epochs 2: the run is complete" in said
    with pytest.raises(ConfigError, match="was saved after 2 epoch"):
        check_resumed_steps({"ckpt_path": path, "trainer": {"max_epochs": 2, "max_steps": -1}})
    assert check_resumed_steps({"ckpt_path": path, "trainer": {"max_epochs": 3, "max_steps": -1}}) is None


def test_a_resume_validating_on_other_records_is_refused_where_a_callback_ranks_val_scores(tmp_path, small_demo):
    """``data.val_sources`` changed between a run and its resume: the val/ scores of the two sets are not
    comparable, and a ModelCheckpoint monitoring val/loss ranked (and deleted) checkpoints by both without a word.
    Refused then; said (a warning) without such a callback; the same records from a moved file resume as before."""
    import json
    import shutil

    def chats(path, words):
        rows = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
                for w in words]  # fmt: skip
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    first = chats(tmp_path / "val_a.jsonl", ["red", "green", "blue", "amber"])
    other = chats(tmp_path / "val_b.jsonl", ["one", "two", "three"])
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    steps = dict(max_steps=2, max_epochs=-1, limit_val_batches=0)
    fit(tmp_path / "reference", small_demo, [every], enable_checkpointing=True, data={"val_sources": [{"path": first}]},
        **steps)  # fmt: skip
    ckpt = str(tmp_path / "ckpt" / "step=1.ckpt")
    ranks = ModelCheckpoint(tmp_path / "best", monitor="val/loss")
    with pytest.raises(ConfigError, match=r"this run validates on 3 records, the checkpoint's run on 4 others \("
                       r"data.val_sources\): ModelCheckpoint \(monitor 'val/loss'\) would rank"):  # fmt: skip
        fit(tmp_path / "ranked", small_demo, [ranks], enable_checkpointing=True, ckpt_path=ckpt,
            data={"val_sources": [{"path": other}]}, **steps)  # fmt: skip
    with pytest.warns(UserWarning, match=r"validates on nothing, the checkpoint's run on 4 others .*not comparable"):
        fit(tmp_path / "none", small_demo, ckpt_path=ckpt, **steps)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(first, moved / "val_a.jsonl")
    same = fit(tmp_path / "same", small_demo, [ModelCheckpoint(tmp_path / "best2", monitor="val/loss")],
               enable_checkpointing=True, ckpt_path=ckpt, data={"val_sources": [{"path": str(moved / "val_a.jsonl")}]},
               **steps)  # fmt: skip
    assert len(same.rows) == 2  # step 2's micro-batches, trained on


@pytest.mark.parametrize(
    "changed, says",
    [
        (dict(gradient_clip_val=0.05), r"trainer.gradient_clip_val None -> 0.05 from the checkpoint's run"),
        (
            dict(precision="bf16-true"),
            r"trainer.precision '32-true' -> 'bf16-true' .*\(its fp32 weights and optimizer "
            r"state are cast to the new precision\)",
        ),  # fmt: skip
    ],
)
def test_a_resume_with_other_clipping_or_precision_says_so(tmp_path, small_demo, changed, says):
    """Lightning applies the config's clipping and precision to a resumed run without a word: a run resumed with
    clipping it never had trained on otherwise (weights 1.7e-3 off the run it continues), and one resumed in
    ``bf16-true`` cast the fp32 weights and AdamW moments. Said, naming each; the same settings say nothing."""
    import warnings

    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    steps = dict(max_steps=3, max_epochs=-1)
    fit(tmp_path / "reference", small_demo, [every], enable_checkpointing=True, **steps)
    ckpt = str(tmp_path / "ckpt" / "step=2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "same", small_demo, ckpt_path=ckpt, **steps)
    assert not [w for w in caught if "from the checkpoint's run" in str(w.message)]
    with pytest.warns(UserWarning, match=says):
        fit(tmp_path / "changed", small_demo, ckpt_path=ckpt, **steps, **changed)


def test_a_resume_refusal_names_the_data_settings_that_changed():
    """The plan key's ``settings`` turned into the words of a refusal, by setting; none for an older checkpoint's
    key (no settings kept), and the edited sources where no setting changed."""
    from lit_hbp.lightning.data_identity import data_changes, edited_sources, older_key_note
    from lit_hbp.lightning.plan_checks import planned_by

    settings = dict(
        sources=[{"path": "a.jsonl"}, {"path": "b.jsonl", "repeat": 2.0}],
        train_on="assistant", over_length="error", val_fraction=0.0, tokenizer="t1", chat_template="c1",
        processor=None, renderers={"jinja2": "3.1.6", "transformers": "5.24.0"},
    )  # fmt: skip
    saved = dict(data="x", settings=settings, content=["d1", "d2"])

    def now(**changes):
        return dict(data="y", settings={**settings, **changes}, content=["d1", "d2"])

    assert planned_by(saved, 0) == planned_by({**now(), "data": "x"}, 0)  # settings and content: said, not compared
    assert data_changes(saved, now(train_on="all")) == ["data.train_on: assistant -> all"]
    assert data_changes(saved, now(chat_template="c2", tokenizer="t2")) == [
        "data.chat_template: the tokenizer's chat template is another"
    ]
    assert data_changes(saved, now(tokenizer="t2")) == [
        "data.tokenizer: its vocabulary, special tokens or encoding are other"
    ]
    assert data_changes(saved, now(renderers={"jinja2": "3.1.6", "transformers": "5.25.0"})) == [
        "transformers 5.24.0 -> 5.25.0 (it renders or splits records otherwise)"
    ]
    assert data_changes(saved, now(sources=[{"path": "a.jsonl"}, {"path": "b.jsonl"}])) == [
        "data.sources[1] (b.jsonl) repeat: 2.0 -> None"
    ]
    assert data_changes(saved, now(sources=settings["sources"][::-1])) == [
        "data.sources: ['a.jsonl', 'b.jsonl'] -> ['b.jsonl', 'a.jsonl']"
    ]
    edited = {**now(), "content": ["d1", "d3"]}
    assert data_changes(saved, edited) == [
        "the records of data.sources[1] (b.jsonl) hold other tokens (edited in place?)"
    ]
    assert edited_sources(saved, edited) == ["data.sources[1] (b.jsonl)"]
    older = dict(data="x")  # a checkpoint of a lit-hbp that kept neither
    assert data_changes(older, now()) == [] and edited_sources(older, edited) == []
    assert "kept no record of its data settings" in older_key_note(older) and older_key_note(saved) == ""
