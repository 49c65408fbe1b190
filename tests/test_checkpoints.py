"""Checkpoint files survive a kill at any moment of a save: a process SIGKILLed in the middle of
writing leaves the previous checkpoint loadable and nothing truncated under a checkpoint's name;
``newest_checkpoint`` (``--ckpt_path auto``) picks the newest complete one; the CLI's folders of a run."""

import multiprocessing
import os
import signal
import types
from pathlib import Path

import pytest
import torch
from conftest import HANG_S
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lit_hbp.cli.app import checkpoint_folders
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.checkpoints import (
    LATEST,
    AtomicCheckpointIO,
    is_complete,
    newest_checkpoint,
    save_deepspeed,
    write_atomically,
)

FORK = multiprocessing.get_context("fork")


def state(step: int) -> dict:
    """A checkpoint's entries as a fit's save has them (the optimizer's and the schedulers' states: a resumable one)."""
    return {
        "global_step": step,
        "weights": torch.full((4096,), float(step)),
        "optimizer_states": [],
        "lr_schedulers": [],
    }


def die_after(n_bytes: int, f):
    """A writer that writes ``n_bytes`` of a checkpoint, then is SIGKILLed (a preemption past its grace
    period, the OOM killer)."""

    class Cut:
        def __init__(self):
            self.n = 0

        def write(self, b):
            room = n_bytes - self.n
            if room <= 0:
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(bytes(b[:room]))
            self.n += min(room, len(b))
            if len(b) > room:
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return len(b)

        def flush(self):
            f.flush()

    return Cut()


def killed_while_saving(target, *args) -> None:
    p = FORK.Process(target=target, args=args)
    p.start()
    p.join(HANG_S)
    assert p.exitcode == -signal.SIGKILL


def _save_cut(path: str, step: int, n_bytes: int) -> None:
    write_atomically(path, lambda f: torch.save(state(step), die_after(n_bytes, f)))


@settings(max_examples=8, deadline=None)
@given(fraction=st.floats(0.0, 0.999))
def test_a_kill_during_a_file_save_leaves_the_previous_checkpoint(tmp_path_factory, fraction):
    folder = tmp_path_factory.mktemp("ckpt")
    last = folder / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(state(3), last)
    size = len(_bytes_of(state(4)))
    killed_while_saving(_save_cut, str(last), 4, int(fraction * size))
    assert torch.load(last, weights_only=False)["global_step"] == 3
    assert (folder / ".last.ckpt.partial").exists()  # the cut write is beside it, never under its name
    assert newest_checkpoint([folder]) == str(last)
    AtomicCheckpointIO().save_checkpoint(state(5), last)  # the next save replaces the partial file
    assert torch.load(last, weights_only=False)["global_step"] == 5
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def _bytes_of(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_truncated_file_is_not_complete(tmp_path):
    whole = _bytes_of(state(2))
    for cut in (0, 10, len(whole) // 2, len(whole) - 1):
        (tmp_path / "x.ckpt").write_bytes(whole[:cut])
        assert not is_complete(tmp_path / "x.ckpt")
    (tmp_path / "x.ckpt").write_bytes(whole)
    assert is_complete(tmp_path / "x.ckpt")


class FakeDeepSpeed:
    """The part of a one-process DeepSpeedStrategy that ``save_deepspeed`` uses; its engine writes a
    tag folder as DeepSpeed does (model states, then the optimizer's shard), optionally killed after
    ``cut`` bytes of the second file."""

    is_global_zero = True
    exclude_frozen_parameters = False

    def __init__(self, cut: int | None = None):
        self.deepspeed_engine = types.SimpleNamespace(save_checkpoint=self._engine_save)
        self.cut = cut

    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass

    def _engine_save(self, folder, client_state, tag, save_latest, exclude_frozen_parameters):
        assert save_latest is False
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        torch.save({**client_state, "module": state(client_state["global_step"])},
                   os.path.join(folder, tag, "mp_rank_00_model_states.pt"))  # fmt: skip
        with open(os.path.join(folder, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb") as f:
            out = f if self.cut is None else die_after(self.cut, f)
            torch.save(state(client_state["global_step"]), out)


def _ds_save_cut(folder: str, step: int, cut: int) -> None:
    save_deepspeed(FakeDeepSpeed(cut), {"global_step": step, "lr_schedulers": []}, folder)


def _ds_save_then_die(folder: str, step: int) -> None:
    """Killed after every rank wrote its files, before ``latest`` is replaced."""
    import lit_hbp.lightning.checkpoints as ck

    real = ck.write_atomically
    ck.write_atomically = lambda path, write: (
        os.kill(os.getpid(), signal.SIGKILL) if path.endswith(LATEST) else real(path, write)
    )
    save_deepspeed(FakeDeepSpeed(), {"global_step": step, "lr_schedulers": []}, folder)


def _ds_step(folder: Path) -> int:
    tag = (folder / LATEST).read_text()
    return torch.load(folder / tag / "mp_rank_00_model_states.pt", weights_only=False)["global_step"]


def test_a_kill_during_a_deepspeed_save_leaves_the_previous_tag(tmp_path):
    folder = tmp_path / "last.ckpt"
    save_deepspeed(FakeDeepSpeed(), {"global_step": 3, "lr_schedulers": []}, str(folder))
    assert _ds_step(folder) == 3 and is_complete(folder)
    killed_while_saving(_ds_save_cut, str(folder), 4, 100)
    assert _ds_step(folder) == 3 and is_complete(folder)
    killed_while_saving(_ds_save_then_die, str(folder), 4)
    assert _ds_step(folder) == 3 and is_complete(folder)
    assert newest_checkpoint([tmp_path]) == str(folder)
    # The same step saved again goes to a new tag (the one `latest` names is never written over), and
    # the older tag folders, the killed saves' included, are removed once `latest` names the new one.
    save_deepspeed(FakeDeepSpeed(), {"global_step": 3, "lr_schedulers": []}, str(folder))
    assert (folder / LATEST).read_text() == "global_step3.1"
    save_deepspeed(FakeDeepSpeed(), {"global_step": 5, "lr_schedulers": []}, str(folder))
    assert _ds_step(folder) == 5
    assert sorted(p.name for p in folder.iterdir()) == ["global_step5", LATEST]


def test_a_deepspeed_folder_without_latest_is_not_complete(tmp_path):
    folder = tmp_path / "last.ckpt"
    killed_while_saving(_ds_save_cut, str(folder), 1, 100)  # the first save of a run, cut
    assert not is_complete(folder)
    assert newest_checkpoint([tmp_path]) is None


def test_the_newest_complete_checkpoint_is_chosen(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    AtomicCheckpointIO().save_checkpoint(state(1), a / "epoch=0-step=1.ckpt")
    AtomicCheckpointIO().save_checkpoint(state(2), b / "last.ckpt")
    (a / "newer-but-cut.ckpt").write_bytes(_bytes_of(state(3))[:100])
    (a / ".hidden.ckpt").write_bytes(_bytes_of(state(4)))
    # Completed in this order, a minute apart (set, not waited for: a file system's clock may be coarse).
    order = [a / "epoch=0-step=1.ckpt", b / "last.ckpt", a / "newer-but-cut.ckpt", a / ".hidden.ckpt"]
    for k, path in enumerate(order):
        os.utime(path, (1_700_000_000 + 60 * k,) * 2)
    assert newest_checkpoint([a, b, tmp_path / "missing"]) == str(b / "last.ckpt")
    assert newest_checkpoint([a]) == str(a / "epoch=0-step=1.ckpt")
    assert newest_checkpoint([]) is None


def section(**trainer) -> Namespace:
    return Namespace(trainer=Namespace(**{"default_root_dir": "runs", "callbacks": None, "logger": None, **trainer}))


def test_the_folders_of_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for v in ("version_0", "version_1"):
        (tmp_path / "logs/exp" / v).mkdir(parents=True)
    tb = Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace(save_dir="logs", name="exp")
    )
    ckpt = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=Namespace(dirpath="mine"))
    assert checkpoint_folders(section(logger=tb)) == [
        Path("runs"), Path("logs/exp/version_0/checkpoints"), Path("logs/exp/version_1/checkpoints")
    ]  # fmt: skip
    assert checkpoint_folders(section(logger=False, callbacks=[ckpt])) == [
        Path("runs"),
        Path("mine"),
        Path("runs/checkpoints"),
    ]
    pinned = Namespace(class_path=tb.class_path, init_args=Namespace(save_dir="logs", name="exp", version=3))
    assert checkpoint_folders(section(logger=[pinned, tb])) == [Path("runs"), Path("logs/exp/version_3/checkpoints")]
    other = Namespace(class_path="my.Logger", init_args=Namespace())
    with pytest.raises(ConfigError, match="--ckpt_path auto: where my.Logger puts checkpoints is not known"):
        checkpoint_folders(section(logger=other))
    assert checkpoint_folders(section(logger=other, callbacks=[ckpt])) == [Path("runs"), Path("mine")]


class OwnCheckpoint(ModelCheckpoint):
    """A user's own checkpoint callback: it saves where ModelCheckpoint does."""


class OwnLogger(TensorBoardLogger):
    """A user's own logger: its run folder is TensorBoard's."""


def test_the_folders_of_a_run_with_a_users_own_checkpoint_callback_and_logger(tmp_path, monkeypatch):
    """Subclasses are asked by class, not name: a user's ModelCheckpoint with a dirpath is searched (missed, a
    preempted job would start over), a TensorBoardLogger subclass's folders are TensorBoard's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs/exp/version_0").mkdir(parents=True)
    own = Namespace(class_path=f"{__name__}.OwnCheckpoint", init_args=Namespace(dirpath="mine"))
    other = Namespace(class_path="my.Logger", init_args=Namespace())
    assert checkpoint_folders(section(logger=other, callbacks=[own])) == [Path("runs"), Path("mine")]
    logger = Namespace(class_path=f"{__name__}.OwnLogger", init_args=Namespace(save_dir="logs", name="exp"))
    folders = checkpoint_folders(section(logger=logger, callbacks=[own]))
    assert folders == [Path("runs"), Path("mine"), Path("logs/exp/version_0/checkpoints")]
    # A checkpoint in the subclass's folder is the one --ckpt_path auto resumes.
    (tmp_path / "mine").mkdir()
    torch.save({"state_dict": {}, "optimizer_states": [], "lr_schedulers": []}, tmp_path / "mine" / "last.ckpt")
    assert newest_checkpoint(folders) == str(Path("mine") / "last.ckpt")
