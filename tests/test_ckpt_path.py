"""No traceback in the first hour: a bad ``--ckpt_path`` (missing, a folder, truncated, random bytes,
text, crafted, of the other strategy's kind) and a trainer value Lightning would refuse end the run at
parse time, before any data is tokenized, with one ``error:`` line first and exit status 2;
``--ckpt_path auto`` says which checkpoints it passed over and why."""

import importlib
import logging
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_hbp.cli.app import HBPCLI, check_trainer_values, main, resolve_auto_resume
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.checkpoints import find_resumable, why_incomplete

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _as_a_person_runs_it(monkeypatch):
    """The arguments come in ``args`` alone (not pytest's sys.argv), without the debug switch."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.delenv("LIT_HBP_DEBUG", raising=False)
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)


class WritesAFile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


RESUMABLE = {"optimizer_states": [], "lr_schedulers": []}  # a fit's save holds them (a weights-only one does not)


def whole(path: Path, step: int = 1) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(4096)}, **RESUMABLE}, path)
    return path


def bad_checkpoints(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (the --ckpt_path, what the error says)."""
    good = whole(tmp / "good.ckpt").read_bytes()
    (tmp / "truncated.ckpt").write_bytes(good[: len(good) // 2])
    (tmp / "random.ckpt").write_bytes(os.urandom(3000))
    (tmp / "text.ckpt").write_text("not a checkpoint\n")
    (tmp / "empty.ckpt").write_bytes(b"")
    (tmp / "folder").mkdir()
    torch.save({"hyper_parameters": {"x": WritesAFile(tmp / "ran")}}, tmp / "crafted.ckpt")
    return {
        "missing": (tmp / "goood.ckpt", f"checkpoint not found: {tmp / 'goood.ckpt'} (did you mean 'good.ckpt'?)"),
        "folder": (tmp / "folder", "(folder): a folder without DeepSpeed's `latest` file"),
        "truncated": (tmp / "truncated.ckpt", "(file): truncated: it starts as a checkpoint but its end is missing"),
        "random bytes": (tmp / "random.ckpt", "(file): not a checkpoint: not a file torch.save wrote"),
        "text": (tmp / "text.ckpt", "(file): not a checkpoint: not a file torch.save wrote"),
        "empty": (tmp / "empty.ckpt", "(file): empty (0 bytes)"),
        "crafted": (tmp / "crafted.ckpt", "its pickle names __builtin__.exec, which lit-hbp, Lightning and DeepSpeed"),
    }


# configs/tiny_cpu.yaml's levels with a 5K long level in place of its 16K one: the demo's 5K-16K samples, seconds of
# attention per validation pack on CPU (the sanity check's too), are dropped; the checkpoints are the same kinds.
SHORTER = ("--data.levels", "[{pack_len: 1024}, {pack_len: 4096, ckpt_layers: 2}, {pack_len: 5120, ckpt_layers: 4}]")


def run_cli(args, tmp_path, small_demo, capfd):
    """``lit-hbp fit`` of the tiny config with ``args``: (exit status, stdout, stderr)."""
    base = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(base + args)
    out, err = capfd.readouterr()
    return stop.value.code, out, err


@pytest.mark.parametrize("case", ["missing", "folder", "truncated", "random bytes", "text", "empty", "crafted"])
def test_a_bad_ckpt_path_is_one_line_before_any_data_is_tokenized(case, tmp_path, small_demo, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    path, says = bad_checkpoints(tmp_path)[case]
    code, out, err = run_cli(["--ckpt_path", str(path)], tmp_path, small_demo, capfd)
    assert code == 2, err
    lines = (out + err).strip().splitlines()
    assert lines[0].startswith("error: ") and says in lines[0], lines
    assert lines[1:] == ["tip: LIT_HBP_DEBUG=1 prints the traceback"], lines  # nothing else printed
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()  # nothing tokenized or logged
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_folder_for_a_run_that_saves_files_and_the_reverse(tmp_path, small_demo, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ds.ckpt"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    whole(folder / "global_step2" / "mp_rank_00_model_states.pt")
    code, _, err = run_cli(["--ckpt_path", str(folder)], tmp_path, small_demo, capfd)
    assert code == 2 and "is a DeepSpeed checkpoint folder: resume it with the strategy that saved it" in err, err
    code, _, err = run_cli(
        ["--ckpt_path", str(whole(tmp_path / "one.ckpt")), "--trainer.strategy", "hbp"], tmp_path, small_demo, capfd
    )
    assert code == 2 and "resumes from the checkpoint folder it saved" in err, err


def test_a_deepspeed_folder_resumed_on_another_number_of_processes_is_one_line(
    tmp_path, small_demo, monkeypatch, capfd
):
    """A DeepSpeed run saved on 2 processes and resumed on 1 ended in DeepSpeed's ZeRORuntimeException ("used a DP
    world size of 2 but the current world size is 1"), a 43-line traceback, exit 1, after the data was tokenized (the
    same change under DDP is refused in one line). Refused at parse time, from the folder's own dp_world_size."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ds.ckpt"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    torch.save({"dp_world_size": 2, "global_step": 2}, folder / "global_step2" / "mp_rank_00_model_states.pt")
    code, _, err = run_cli(["--ckpt_path", str(folder), "--trainer.strategy", "hbp"], tmp_path, small_demo, capfd)
    assert code == 2 and err.startswith(
        f"error: --ckpt_path {folder}: its run trained on 2 processes and this one has 1 (trainer.devices x "
        "trainer.num_nodes)"
    ), err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("max_steps", "-5", "trainer.max_steps: `max_steps` must be a non-negative integer or -1"),
        ("max_epochs", "-3", "trainer.max_epochs: `max_epochs` must be a non-negative integer or -1"),
        ("num_nodes", "0", "trainer.num_nodes: `num_nodes` must be a positive integer"),
        ("limit_val_batches", "1.5", "invalid value 1.5 for limit_val_batches"),
        ("accumulate_grad_batches", "0", "trainer.accumulate_grad_batches must be a whole number >= 1, got 0"),
        ("gradient_clip_val", "-1.0", "trainer.gradient_clip_val must be a number >= 0"),
        (
            "enable_checkpointing",
            "false",
            "trainer.enable_checkpointing: false beside trainer.callbacks[3] (ModelCheckpoint)",
        ),  # the config's own ModelCheckpoint
    ],
)
def test_a_trainer_value_lightning_would_refuse_is_refused_at_parse_time(
    option, value, says, tmp_path, small_demo, monkeypatch, capfd
):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([f"--trainer.{option}", value], tmp_path, small_demo, capfd)
    assert code == 2, err
    lines = (out + err).strip().splitlines()
    assert lines[0].startswith("error: ") and says in lines[0] and len(lines) == 2, lines
    assert not (tmp_path / "cache").exists()


# Lightning's Trainer is the reference: every value it refuses, lit-hbp refuses at parse time, and every
# value it takes (but RUN_RULES's) passes.
TRAINER_VALUES = [
    ("max_steps", -5), ("max_steps", -1), ("max_steps", 0), ("max_epochs", -2), ("max_epochs", -1),
    ("min_steps", -3), ("limit_train_batches", -1), ("limit_train_batches", 1.5), ("limit_train_batches", 0.5),
    ("limit_val_batches", 2.0), ("val_check_interval", -1), ("val_check_interval", 1.5),
    ("num_sanity_val_steps", -2), ("num_sanity_val_steps", -1), ("log_every_n_steps", -1),
    ("check_val_every_n_epoch", 1.5), ("reload_dataloaders_every_n_epochs", -1), ("num_nodes", 0),
    ("gradient_clip_algorithm", "max"), ("gradient_clip_algorithm", "norm"), ("max_time", "00:99"),
    ("max_time", "00:00:10:00"), ("val_check_interval", 0), ("log_every_n_steps", 0), ("val_check_interval", 0.25),
]  # fmt: skip


@pytest.mark.parametrize("key, value", TRAINER_VALUES)
def test_the_trainer_check_refuses_exactly_what_lightning_refuses(key, value):
    from lightning.pytorch import Trainer

    try:
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **{key: value})
        lightning_refuses = False
    except Exception:  # whatever Lightning raises for the value
        lightning_refuses = True
    section = Namespace(trainer=Namespace(**{key: value}))
    from lit_hbp.cli.checks import RUN_RULES

    stricter = key in RUN_RULES and not RUN_RULES[key][0](value)  # what lit-hbp refuses beyond Lightning, on purpose
    if lightning_refuses or stricter:
        with pytest.raises(ConfigError, match=r"^trainer"):
            check_trainer_values(section)
    else:
        check_trainer_values(section)


class _Saves(ModelCheckpoint):
    """A user's own checkpoint callback."""


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(
    "callbacks, saves", [([], False), ([ModelCheckpoint()], True), ([_Saves()], True), ([LearningRateMonitor()], False),
                         ([LearningRateMonitor(), f"{__name__}._Saves"], True),
                         ("lightning.pytorch.callbacks.ModelCheckpoint", True)],
)  # fmt: skip
def test_checkpointing_off_beside_a_checkpoint_callback_is_refused_exactly_when_lightning_refuses_it(
    enabled, callbacks, saves
):
    """Lightning's Trainer is the reference for ``enable_checkpointing`` and the callbacks (objects, or the config's
    ``class_path`` entries, one or a list); lit-hbp refuses the same pairs before the data is read."""
    from lightning.pytorch import Trainer

    def entry(c):
        return Namespace(class_path=c, init_args=Namespace()) if isinstance(c, str) else c

    def built(c):
        if not isinstance(c, str):
            return c
        module, _, name = c.rpartition(".")
        return getattr(importlib.import_module(module), name)()

    given = [entry(c) for c in callbacks] if isinstance(callbacks, list) else entry(callbacks)
    objects = [built(c) for c in callbacks] if isinstance(callbacks, list) else built(callbacks)
    try:
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=enabled, callbacks=objects)
        lightning_refuses = False
    except MisconfigurationException:
        lightning_refuses = True
    section = Namespace(trainer=Namespace(enable_checkpointing=enabled, callbacks=given))
    if lightning_refuses:
        with pytest.raises(ConfigError, match=r"^trainer.enable_checkpointing: false beside trainer.callbacks\["):
            check_trainer_values(section)
    else:
        check_trainer_values(section)
    assert lightning_refuses == (saves and not enabled)  # the reference refuses what it should


def test_auto_names_each_checkpoint_it_passed_over_and_why(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    older = whole(folder / "step=1.ckpt")
    last = whole(folder / "last.ckpt", 2)
    last.write_bytes(last.read_bytes()[:1000])  # the newest, cut short
    os.utime(older, (1, 1))
    (folder / ".last.ckpt.partial").write_bytes(b"PK\x03\x04")
    found, skipped = find_resumable([folder])
    assert found == str(older)
    assert dict(skipped) == {
        str(last): why_incomplete(last),
        str(folder / ".last.ckpt.partial"): "a save that was cut short (written beside its name, never renamed)",
    }
    assert why_incomplete(last).startswith("truncated")
    trainer = Namespace(default_root_dir=str(tmp_path), callbacks=None, logger=False, strategy=None)
    section = Namespace(ckpt_path="auto", weights_only=None, trainer=trainer)
    with caplog.at_level(logging.INFO):
        resolve_auto_resume(section)
    assert section.ckpt_path == str(older)
    assert f"--ckpt_path auto: skipped {last}: truncated" in caplog.text
    assert f"--ckpt_path auto: resuming from {older}" in caplog.text
    older.unlink()
    section.ckpt_path = "auto"
    with caplog.at_level(logging.INFO):
        resolve_auto_resume(section)
    assert section.ckpt_path is None
    assert "no complete checkpoint in" in caplog.text and "training starts from the beginning" in caplog.text


def test_a_zero3_run_that_loads_full_weights_may_resume_from_a_file(tmp_path):
    """DeepSpeed's ``load_full_weights`` loads a consolidated file: the kind check leaves it to Lightning."""
    from lit_hbp.cli.app import check_resume

    strategy = Namespace(
        class_path="lit_hbp.lightning.strategy.HBPStrategy", init_args=Namespace(stage=3, load_full_weights=True)
    )
    section = Namespace(ckpt_path=str(whole(tmp_path / "full.ckpt")), weights_only=None,
                        trainer=Namespace(strategy=strategy))  # fmt: skip
    check_resume(section)
    strategy.init_args.load_full_weights = False
    with pytest.raises(ConfigError, match="resumes from the checkpoint folder it saved"):
        check_resume(section)


def test_auto_on_the_command_line_skips_a_truncated_last_and_refuses_a_crafted_one(
    tmp_path, small_demo, monkeypatch, capfd, caplog
):
    """``--ckpt_path auto`` as a requeued job runs it: the truncated ``last.ckpt`` is named as skipped, the
    newest whole checkpoint is read with the allow-list (a crafted one is refused, its code never run),
    before any data is tokenized."""
    monkeypatch.chdir(tmp_path)
    folder = Path("runs/tiny_cpu/version_0/checkpoints")  # where the tiny config's logger puts them
    folder.mkdir(parents=True)
    last = whole(folder / "last.ckpt")
    last.write_bytes(last.read_bytes()[:2000])
    torch.save({"hyper_parameters": {"x": WritesAFile(tmp_path / "ran")}}, folder / "step=1.ckpt")
    with caplog.at_level(logging.INFO):
        code, out, err = run_cli(["--ckpt_path", "auto"], tmp_path, small_demo, capfd)
    assert code == 2, err
    assert f"--ckpt_path auto: skipped {last}: truncated" in caplog.text, caplog.text
    assert f"error: refused to open {folder / 'step=1.ckpt'}: its pickle names __builtin__.exec" in err, err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "cache").exists()


def test_a_resume_with_model_settings_other_than_its_checkpoints_is_refused_at_parse_time(
    tmp_path, small_demo, monkeypatch, capfd
):
    """Lightning reads the module's arguments from the checkpoint over the config's: ``--model.lr`` and
    ``--model.loss`` given on a resume were dropped without a word. Refused, each named beside the checkpoint's
    value; the config's own values (the checkpoint's) pass."""
    monkeypatch.chdir(tmp_path)
    config = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    hparams = dict(main(config, run=False).model.hparams)
    hparams.pop("_instantiator", None)
    folder = Path("runs/tiny_cpu/version_0/checkpoints")  # where --ckpt_path auto finds the run's newest
    folder.mkdir(parents=True)
    torch.save({"global_step": 1, "state_dict": {}, "hyper_parameters": hparams, **RESUMABLE}, folder / "last.ckpt")
    for given in (str(folder / "last.ckpt"), "auto"):  # auto: its checkpoint was resumed with the new settings
        code, _, err = run_cli(
            ["--ckpt_path", given, "--model.lr", "1e-4", "--model.loss", "sum"], tmp_path, small_demo, capfd
        )
        assert code == 2 and err.startswith("error: --ckpt_path resumes the run as its checkpoint saved it"), err
        assert f"model.lr: 0.0001 (the checkpoint's {hparams['lr']!r})" in err
        assert "model.loss: 'sum' (the checkpoint's 'ave_token')" in err
        assert "model.weight_decay" not in err and "tokenizing" not in err
    with pytest.raises(SystemExit) as stop:  # a validation scores the checkpoint: it resumes no run
        main(["validate", *config[:2], "--data.demo_dir", str(small_demo), "--ckpt_path", str(folder / "last.ckpt"),
              "--model.loss", "sum"])  # fmt: skip
    err = capfd.readouterr().err
    assert stop.value.code == 2 and err.startswith(
        "error: --ckpt_path validates the checkpoint with the model settings it saved, not"
    ), err
    assert "model.loss: 'sum' (the checkpoint's 'ave_token')" in err and "or validate from the exported model" in err
    # A DeepSpeed folder (HBPStrategy's): its settings are in its model-states file, where DeepSpeed keeps Lightning's.
    states = folder / "step=1.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt"
    states.parent.mkdir(parents=True)
    torch.save({"global_step": 1, "module": {}, "hyper_parameters": hparams, **RESUMABLE}, states)
    (folder / "step=1.ckpt" / "latest").write_text("checkpoint")
    code, _, err = run_cli(
        ["--ckpt_path", str(folder / "step=1.ckpt"), "--trainer.strategy", "hbp", "--model.lr", "1e-4"],
        tmp_path, small_demo, capfd,
    )  # fmt: skip
    assert code == 2 and err.startswith("error: --ckpt_path resumes the run as its checkpoint saved it"), err
    assert f"model.lr: 0.0001 (the checkpoint's {hparams['lr']!r})" in err and "tokenizing" not in err


def test_a_resume_may_change_how_its_steps_are_computed_and_takes_the_configs(tmp_path, small_demo, monkeypatch):
    """The attention kernel, compile, liger, the self-check and the loss's chunk choose how a step is computed, not
    what it computes: a run resumed on another machine (no flash-attn there) or with compile off must not be refused
    for them, and runs with the command line's values, not the checkpoint's; ``lr`` beside them is still refused."""
    monkeypatch.chdir(tmp_path)
    config = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    hparams = dict(main(config, run=False).model.hparams)
    hparams.pop("_instantiator", None)
    saved = {**hparams, "attn_backend": "flash_attn_2", "compile": True, "liger": True, "ce_chunk_size": 4096}
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "hyper_parameters": saved, **RESUMABLE}, path)
    now = {"attn_backend": "sdpa", "compile": False, "liger": False, "self_check": False, "ce_chunk_size": 64}
    given = [a for k, v in now.items() for a in (f"--model.{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    fitted = []  # the module the fit would train, and the checkpoint it would resume
    run = lambda cli, sub: fitted.append((dict(cli.model.hparams), cli.config[sub].ckpt_path))  # noqa: E731
    monkeypatch.setattr(HBPCLI, "_run_subcommand", run)
    main(["fit", *config, "--ckpt_path", str(path), *given])
    ((taken, resumed),) = fitted
    assert {k: taken[k] for k in now} == now and resumed == str(path)
    assert taken["lr"] == hparams["lr"]
    with pytest.raises(SystemExit) as stop:
        main(["fit", *config, "--ckpt_path", str(path), *given, "--model.lr", "1e-4"])
    assert stop.value.code == 2 and len(fitted) == 1


def run_checkpoints_folder(tmp_path, small_demo, monkeypatch) -> tuple[dict, Path]:
    """In ``tmp_path``: the tiny config's module hyper-parameters and the run folder where ``--ckpt_path auto``
    finds checkpoints (made)."""
    monkeypatch.chdir(tmp_path)
    config = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    hparams = dict(main(config, run=False).model.hparams)
    hparams.pop("_instantiator", None)
    folder = Path("runs/tiny_cpu/version_0/checkpoints")
    folder.mkdir(parents=True)
    return hparams, folder


def test_a_resume_at_or_past_its_max_steps_is_refused_and_a_complete_run_found_by_auto_ends_at_once(
    tmp_path, small_demo, monkeypatch, capfd, caplog
):
    """A checkpoint saved at step 2 resumed with ``trainer.max_steps 2`` (and 1): Lightning read the data, built the
    model and stopped at once, status 0, having trained nothing. Named by the command: one line, exit 2, a file or
    a DeepSpeed folder. Found by ``--ckpt_path auto`` (a scheduler running a finished job's line again): the run is
    complete, said in one line, exit 0. Nothing tokenized either way."""
    hparams, folder = run_checkpoints_folder(tmp_path, small_demo, monkeypatch)
    torch.save({"global_step": 2, "state_dict": {}, "hyper_parameters": hparams, **RESUMABLE}, folder / "last.ckpt")
    states = tmp_path / "ds" / "step=2.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt"
    states.parent.mkdir(parents=True)
    torch.save({"global_step": 2, "module": {}, "hyper_parameters": hparams, "dp_world_size": 1, **RESUMABLE}, states)
    (states.parents[1] / "latest").write_text("checkpoint")
    for given, more in ((folder / "last.ckpt", []), (states.parents[1], ["--trainer.strategy", "hbp"])):
        for max_steps in ("2", "1"):
            code, out, err = run_cli(["--ckpt_path", str(given), *more, "--trainer.max_steps", max_steps],
                                     tmp_path, small_demo, capfd)  # fmt: skip
            assert code == 2, err
            assert err.startswith(
                f"error: --ckpt_path {given} was saved at optimizer step 2 and trainer.max_steps is {max_steps}: "
                "the resumed run would train nothing; set trainer.max_steps above 2"
            ), err
    with caplog.at_level(logging.INFO):
        code, out, err = run_cli(["--ckpt_path", "auto"], tmp_path, small_demo, capfd)
    assert code == 0, err
    said = f"--ckpt_path auto: {folder / 'last.ckpt'} is at optimizer step 2, trainer.max_steps 2: the run is complete"
    assert said in caplog.text + out + err, caplog.text + out + err
    assert not (tmp_path / "cache").exists()


def test_auto_finds_the_checkpoints_of_lightnings_default_logger_and_last_is_refused_where_it_finds_none(
    tmp_path, small_demo, monkeypatch, capfd, caplog
):
    """With no logger given (``--trainer.logger null``) Lightning logs with its default TensorBoardLogger, whose
    checkpoints go to ``<default_root_dir>/lightning_logs/version_N/checkpoints``: ``--ckpt_path auto`` looked in
    ``<default_root_dir>/checkpoints``, found nothing and a requeued job trained from the start. Found now (the run
    complete: exit 0). ``--ckpt_path last`` with a versioned logger and no ModelCheckpoint dirpath (the shipped
    configs) trained from the start in a new version folder (Lightning's warning only): refused, naming auto."""
    hparams, _ = run_checkpoints_folder(tmp_path, small_demo, monkeypatch)
    folder = Path("runs/lightning_logs/version_0/checkpoints")  # the tiny config's default_root_dir: runs
    folder.mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {}, "hyper_parameters": hparams, **RESUMABLE}, folder / "last.ckpt")
    with caplog.at_level(logging.INFO):
        code, out, err = run_cli(["--trainer.logger", "null", "--ckpt_path", "auto"], tmp_path, small_demo, capfd)
    assert code == 0, err
    said = f"--ckpt_path auto: {folder / 'last.ckpt'} is at optimizer step 2, trainer.max_steps 2: the run is complete"
    assert said in caplog.text + out + err, caplog.text + out + err
    for logger in ([], ["--trainer.logger", "null"]):
        code, out, err = run_cli([*logger, "--ckpt_path", "last"], tmp_path, small_demo, capfd)
        assert code == 2 and err.startswith("error: --ckpt_path last: Lightning looks for the last checkpoint"), err
        assert "--ckpt_path auto" in err and not (tmp_path / "cache").exists()
    # Where Lightning finds one (logger: false saves into <default_root_dir>/checkpoints), the file is checked as a
    # path is: none there is refused (Lightning trained, or validated model.model's weights, from the start); one
    # whose max_steps it reached is refused as by its path (Lightning trained nothing, exit 0).
    code, out, err = run_cli(["--trainer.logger", "false", "--ckpt_path", "last"], tmp_path, small_demo, capfd)
    assert code == 2 and err.startswith("error: --ckpt_path last: no last checkpoint (last*.ckpt) in runs/checkpoints")
    Path("runs/checkpoints").mkdir()
    (folder / "last.ckpt").rename("runs/checkpoints/last.ckpt")
    code, out, err = run_cli(["--trainer.logger", "false", "--ckpt_path", "last"], tmp_path, small_demo, capfd)
    assert code == 2, err
    assert err.startswith("error: --ckpt_path runs/checkpoints/last.ckpt was saved at optimizer step 2 and trainer"), (
        err
    )


def test_a_resume_past_its_max_epochs_is_refused_and_a_mid_epoch_one_trains_on(
    tmp_path, small_demo, monkeypatch, capfd
):
    """``trainer.max_epochs`` bounds a run as ``max_steps`` does: a checkpoint saved at the end of epoch 1 (Lightning's
    fit loop counts it processed before ``on_train_epoch_end`` saves) resumed with ``max_epochs 1`` trained nothing,
    exit 0. Refused by name, or complete when ``auto`` finds it; saved within that epoch, it trains on."""
    from lit_hbp.cli.resume import check_resumed_steps

    hparams, folder = run_checkpoints_folder(tmp_path, small_demo, monkeypatch)

    def saved(processed: int) -> dict:
        progress = {"ready": 1, "started": 1, "processed": processed, "completed": 0}
        loops = {"fit_loop": {"epoch_progress": {"total": progress, "current": progress}}}
        return {
            "global_step": 3,
            "epoch": 0,
            "state_dict": {},
            "hyper_parameters": hparams,
            "loops": loops,
            **RESUMABLE,
        }

    torch.save(saved(1), folder / "last.ckpt")
    code, _, err = run_cli(
        ["--ckpt_path", str(folder / "last.ckpt"), "--trainer.max_steps", "-1", "--trainer.max_epochs", "1"],
        tmp_path, small_demo, capfd,
    )  # fmt: skip
    assert code == 2 and err.startswith(
        f"error: --ckpt_path {folder / 'last.ckpt'} was saved after 1 epoch(s) and trainer.max_epochs is 1: the "
        "resumed run would train nothing; set trainer.max_epochs above 1"
    ), err
    said = check_resumed_steps({"ckpt_path": str(folder / "last.ckpt"), "trainer": {"max_epochs": 1}}, found=True)
    assert said == (
        f"--ckpt_path auto: {folder / 'last.ckpt'} is after 1 epoch(s), trainer.max_epochs 1: the run is complete, "
        "nothing left to train"
    )
    torch.save(saved(0), folder / "last.ckpt")  # within its first epoch: one to go
    for trainer in ({"max_epochs": 1, "max_steps": -1}, {"max_epochs": -1, "max_steps": 4}, {"max_epochs": None}):
        assert check_resumed_steps({"ckpt_path": str(folder / "last.ckpt"), "trainer": trainer}) is None, trainer
    assert not (tmp_path / "cache").exists()


def test_a_resume_whose_max_time_its_checkpoint_spent_is_refused_or_complete(tmp_path, small_demo, monkeypatch):
    """Lightning's Timer counts a run's training time over its resumes (its state is in the checkpoint): a run stopped
    by ``trainer.max_time`` and resumed with the same bound, by its path or ``auto`` (a requeued job), built the model,
    read the data, trained nothing and ended 0, every time. Refused by name, or complete when ``auto`` finds it; a
    larger bound trains on. The reference is Lightning's own Timer: its state as it saves it, its reading of the
    bound."""
    from lightning.pytorch.callbacks import Timer

    from lit_hbp.cli.resume import check_resumed_steps

    hparams, folder = run_checkpoints_folder(tmp_path, small_demo, monkeypatch)
    timer = Timer(duration="00:00:00:08")
    timer._offset = 9.0  # as a resumed Timer holds the time its checkpoint counted
    state = {"global_step": 3, "epoch": 0, "state_dict": {}, "hyper_parameters": hparams, **RESUMABLE}
    torch.save({**state, "callbacks": {timer.state_key: timer.state_dict()}}, folder / "last.ckpt")
    section = {"ckpt_path": str(folder / "last.ckpt"), "trainer": {"max_time": "00:00:00:08", "max_steps": 100}}
    said = r"was saved after 9 s of training \(Lightning's Timer counts it over resumes\) and trainer.max_time is "
    with pytest.raises(ConfigError, match=said + r"00:00:00:08: the resumed run would train nothing"):
        check_resumed_steps(section)
    assert check_resumed_steps(section, found=True).endswith("trainer.max_time 00:00:00:08: the run is complete, "
                                                              "nothing left to train")  # fmt: skip
    for more in ("00:00:01:00", {"minutes": 1}):
        assert check_resumed_steps({**section, "trainer": {"max_time": more}}) is None


@pytest.mark.parametrize("strategy", ["auto", "deepspeed"])
def test_a_resume_on_another_learning_rate_schedule_says_where_the_rate_moves(
    strategy, tmp_path, small_demo, toy_tokenizer
):
    """A run resumed with more max_steps follows the longer cosine, as Lightning would, but not silently: at
    step 2 of a 2-step schedule the rate was at its floor (2e-6 of 2e-5), on a 4-step one it is 1.55e-5; the
    warning says both, whether Lightning loads the checkpoint before the optimizer is configured or, under
    DeepSpeed, after, and step 2 takes it; the run's own max_steps resumes without a word, another learning rate
    is refused."""
    import warnings

    from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.lightning.schedule import LR_SCHEDULE
    from lit_hbp.lightning.strategy import HBPStrategy

    ckpt = str(tmp_path / "run.ckpt")  # a file, or DeepSpeed's folder

    class Rates(L.Callback):  # the learning rate each optimizer step takes
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.taken.append(optimizer.param_groups[0]["lr"])

    rates = Rates()

    def run(steps: int, resume: bool = True, lr: float = 2e-5, **kw):
        dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache")
        module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, self_check=False, warmup_steps=1, lr=lr, **kw)
        how = HBPStrategy(stage=2) if strategy == "deepspeed" else "auto"
        # saved at the final step, as FinalCheckpoint saves it (one written after fit is refused: Lightning has
        # closed the epoch by then, so a resume would skip the rest of it)
        saves = (
            [rates]
            if resume
            else [ModelCheckpoint(tmp_path, "run", every_n_train_steps=steps, enable_version_counter=False)]
        )
        rates.taken = []
        trainer = quiet_trainer(
            max_steps=steps, strategy=how, enable_checkpointing=True, default_root_dir=tmp_path, callbacks=saves
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(module, dm, ckpt_path=ckpt if resume else None)
        finally:
            if strategy == "deepspeed" and torch.distributed.is_initialized():
                import deepspeed

                deepspeed.comm.destroy_process_group()
        said = [str(w.message) for w in caught if "learning-rate schedule" in str(w.message)]
        return trainer, said

    run(2, resume=False)
    if strategy != "deepspeed":
        assert torch.load(ckpt, weights_only=False)[LR_SCHEDULE] == {"total": 2, "warmup": 1}
    trainer, said = run(4)
    assert trainer.global_step == 4
    assert said == [
        "resumed at step 2 on a learning-rate schedule of 4 optimizer steps (1 of warm-up); the checkpoint's run "
        "followed 2 (1): the learning rate moves from 2e-06 to 1.55e-05 here and follows the new schedule (resume "
        "with the run's own max_steps, max_epochs and limit_train_batches to keep its)"
    ]
    assert rates.taken == pytest.approx([1.55e-5, 6.5e-6], rel=1e-6)  # step 2 took the old schedule's 2e-6
    trainer, said = run(2, ce_chunk_size=7)  # a setting of the run alone (the loss's chunk) is taken as given
    assert trainer.global_step == 2 and not said
    # Another learning rate: the restored schedule kept the checkpoint's while the module said the new one (the
    # command line reads a file's settings first; a DeepSpeed folder, Lightning's `last` or a fit of one's own not)
    says = r"^ckpt_path resumes the run as its checkpoint saved it, with its model settings, not these: model.lr: "
    with pytest.raises(ConfigError, match=says + r"0.0001 \(the checkpoint's 2e-05\); give the run's own"):
        run(4, lr=1e-4)


@pytest.mark.slow
def test_an_hbp_ddp_run_resumes_from_its_checkpoint_file_as_it_would_have_run_on(
    tmp_path, small_demo, monkeypatch, capfd
):
    """HBPDDPStrategy saves a file, as DDP does (``hbp_ddp`` was taken for DeepSpeed by its name, and every resume
    of it refused); a resume with a CSVLogger logs into a new version folder (Lightning's CSVLogger would erase the
    stopped run's metrics.csv in its own). The resumed run ends where the run that went on ends."""
    import csv

    steps = ["--trainer.max_steps", "4", "--trainer.strategy", "hbp_ddp", "--trainer.enable_progress_bar", "false",
             "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "runs",
             "--trainer.logger.name", "tiny_cpu", "--trainer.log_every_n_steps", "1",
             "--trainer.callbacks+=ModelCheckpoint",
             "--trainer.callbacks.dirpath", "runs/tiny_cpu/version_0/checkpoints",
             "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
             "--trainer.callbacks.filename", "{step}"]  # fmt: skip

    def fit(args):
        base = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
                "--data.cache_dir", str(tmp_path / "cache"), *SHORTER]  # fmt: skip
        main(base + steps + args)

    monkeypatch.chdir(tmp_path)
    fit([])
    run = Path("runs/tiny_cpu/version_0")
    whole_run = torch.load(run / "checkpoints/step=4.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    (run / "checkpoints/step=4.ckpt").unlink()
    logged = [r["step"] for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")]
    fit(["--ckpt_path", str(run / "checkpoints/step=2.ckpt")])
    _, err = capfd.readouterr()
    assert "resumes from the checkpoint folder" not in err
    assert [r["step"] for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")] == logged  # kept
    resumed_log = [
        r["step"] for r in csv.DictReader(open("runs/tiny_cpu/version_1/metrics.csv")) if r.get("train/loss")
    ]
    assert resumed_log == logged[2:], (resumed_log, logged)
    resumed = torch.load(run / "checkpoints/step=4.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    for name, value in whole_run.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "strategy, saves",
    [
        ("hbp", "folder"),
        ("hbp_stage_3", "folder"),
        ("deepspeed", "folder"),
        ("hbp_ddp", "file"),
        ("ddp", "file"),
        (Namespace(class_path="lit_hbp.lightning.strategy.HBPDDPStrategy"), "file"),
        (Namespace(class_path="lit_hbp.lightning.strategy.HBPStrategy"), "folder"),
    ],
)
def test_the_checkpoint_kind_a_strategy_resumes_is_its_class_not_its_name(strategy, saves, tmp_path):
    from lit_hbp.cli.app import check_resume

    folder = tmp_path / "ds.ckpt"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    whole(folder / "global_step2" / "mp_rank_00_model_states.pt")
    file = whole(tmp_path / "one.ckpt")
    for given in (folder, file):
        section = Namespace(ckpt_path=str(given), weights_only=None, trainer=Namespace(strategy=strategy))
        if (given == folder) == (saves == "folder"):
            check_resume(section)
        else:
            with pytest.raises(ConfigError):
                check_resume(section)


@pytest.mark.slow
def test_a_zero3_folder_loads_under_stage_3_to_train_and_says_how_to_validate_it(
    tmp_path, small_demo, monkeypatch, capfd
):
    """DeepSpeed restores a ZeRO-3 folder's partitioned weights through its optimizer: ``validate`` of one crashed
    in DeepSpeed (no optimizer there), and a stage-2 run given it stopped on a bare AssertionError. Both are one
    line naming the way (the stage that saved it; an export to validate)."""
    monkeypatch.chdir(tmp_path)
    run = ["--trainer.strategy", "hbp_stage_3", "--trainer.enable_progress_bar", "false"]
    main(["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
          "--data.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps", "2", *SHORTER, *run])  # fmt: skip
    folder = tmp_path / "runs/tiny_cpu/version_0/checkpoints/last.ckpt"
    assert folder.is_dir()
    base = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
            "--data.cache_dir", str(tmp_path / "cache"), "--ckpt_path", str(folder), *SHORTER]  # fmt: skip
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["validate", *base, *run])
    err = capfd.readouterr().err
    assert stop.value.code == 2 and "a ZeRO-3 checkpoint folder resumes training but does not load to validate" in err
    code, _, err = run_cli(["--trainer.strategy", "hbp", "--ckpt_path", str(folder), "--trainer.max_steps", "3"],
                           tmp_path, small_demo, capfd)  # fmt: skip
    assert code == 2 and "DeepSpeed's ZeRO stage 3 saved it, and this run's strategy is stage 2" in err, err


def boring_saves(folder: Path) -> tuple[Path, Path]:
    """(a full checkpoint of step 2, a newer weights-only one of step 2: a ``ModelCheckpoint(save_weights_only=True)``
    beside the full one), saved by Lightning from its BoringModel."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    full = ModelCheckpoint(folder, "full-{step}", every_n_train_steps=2, save_top_k=-1)
    light = ModelCheckpoint(folder, "weights-{step}", every_n_train_steps=1, save_top_k=-1, save_weights_only=True)
    trainer = L.Trainer(max_steps=2, callbacks=[full, light], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=folder)  # fmt: skip
    trainer.fit(BoringModel())
    weights = folder / "weights-step=2.ckpt"
    os.utime(weights, (os.path.getmtime(folder / "full-step=2.ckpt") + 1,) * 2)  # the newer, whatever the clock says
    return folder / "full-step=2.ckpt", weights


def test_a_weights_only_checkpoint_is_passed_over_by_auto_and_refused_by_fit(tmp_path, small_demo, monkeypatch, capfd):
    """A ``save_weights_only`` checkpoint beside the full one: ``--ckpt_path auto`` resumed from it when it was the
    newest and Lightning stopped in a ``KeyError`` after the data was read (every requeue of the job again); named, it
    was not refused either. Lightning's own resume from it is the reference: it fails, and from the full one it does
    not. A validation may read its weights."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_hbp.cli.resume import check_training_state
    from lit_hbp.lightning.checkpoints import WEIGHTS_ONLY

    full, weights = boring_saves(tmp_path / "checkpoints")
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(KeyError, match="contains only the model"):
        L.Trainer(max_steps=3, **quiet).fit(BoringModel(), ckpt_path=weights)
    resumed = L.Trainer(max_steps=3, **quiet)
    resumed.fit(BoringModel(), ckpt_path=full)
    assert resumed.global_step == 3

    assert find_resumable([full.parent]) == (str(full), [(str(weights), WEIGHTS_ONLY)])
    assert find_resumable([full.parent], training=False)[0] == str(weights)
    check_training_state(Namespace(ckpt_path=str(full), weights_only=None))
    with pytest.raises(ConfigError, match=f"--ckpt_path {weights}: saved with weights only"):
        check_training_state(Namespace(ckpt_path=str(weights), weights_only=None))

    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["--ckpt_path", str(weights)], tmp_path, small_demo, capfd)
    assert code == 2 and "saved with weights only (a ModelCheckpoint's save_weights_only)" in err, err
    assert not (tmp_path / "cache").exists()  # before any data is read


def test_a_resume_into_its_run_folder_from_an_older_checkpoint_says_the_steps_logged_again(tmp_path):
    """A rollback (``--ckpt_path`` a step's checkpoint, a later one beside it) resumed into the run folder and
    logged its steps a second time beside the first run's, without a word. Said now, by the checkpoints' steps (a
    ``save_last`` copy of the same step, written a moment later, is no later one)."""
    import warnings

    from lit_hbp.cli.resume import resume_in_run_folder

    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    old, last, copy = folder / "epoch=0-step=10.ckpt", folder / "last.ckpt", folder / "epoch=0-step=14.ckpt"
    torch.save({"global_step": 10}, old)
    torch.save({"global_step": 14}, last)
    torch.save({"global_step": 14}, copy)  # save_last's copy of the same step, written a moment later

    def section(ckpt):
        logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                           init_args=Namespace(save_dir=str(tmp_path / "runs"), name="tiny", version=None))  # fmt: skip
        return Namespace(ckpt_path=str(ckpt), trainer=Namespace(logger=logger))

    older = section(old)
    with pytest.warns(UserWarning, match=r"(last|epoch=0-step=14).ckpt in its folder was saved after it, .* again"):
        resume_in_run_folder(older)
    assert older.trainer.logger.init_args.version == 0  # still into the run folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume_in_run_folder(section(copy))
        resume_in_run_folder(section(last))
