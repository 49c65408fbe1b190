"""DeepSpeed's ops build into torch's extensions folder under a lock file that torch waits on forever: a build that
was stopped (Ctrl-C, a killed job) left one, and every later run hung at DeepSpeed's set-up without a word (a
two-process MeasuredSelector fit sat 8 minutes at "initializing deepspeed distributed", both ranks in torch's
FileBaton.wait). HBPStrategy reads the locks first and refuses a stale one by its path."""

import os
import time

import pytest

from lit_hbp.errors import ConfigError
from lit_hbp.lightning.op_builds import STALE_AFTER_S, check_build_locks


def op(root, name="deepspeed_shm_comm", lock_age=0.0, library_age=None):
    """An op's build folder: its lock made ``lock_age`` seconds ago, its library (if any) ``library_age`` ago."""
    folder = root / name
    folder.mkdir(parents=True)
    now = time.time()
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (now - lock_age, now - lock_age))
    if library_age is not None:
        lib = folder / f"{name}.so"
        lib.write_bytes(b"\x7fELF")
        os.utime(lib, (now - library_age, now - library_age))
    return lock


def test_no_lock_says_nothing(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert check_build_locks(tmp_path, recheck_s=0) == []


def test_a_lock_older_than_its_library_is_refused_by_its_path(tmp_path):
    """The build finished (its library is newer) and the lock stayed: the process was stopped before releasing it."""
    lock = op(tmp_path, lock_age=120, library_age=30)
    with pytest.raises(ConfigError, match=rf"{lock}: a build of deepspeed_shm_comm that was stopped .* \(rm {lock}\)"):
        check_build_locks(tmp_path, recheck_s=0.01)


def test_a_lock_older_than_any_build_is_refused(tmp_path):
    lock = op(tmp_path / "py311_cpu", "cpu_adam", lock_age=STALE_AFTER_S + 60)  # torch's default root: per-Python
    with pytest.raises(ConfigError, match=r"cpu_adam/lock: .* \(it is 31 minutes old\)"):
        check_build_locks(tmp_path, recheck_s=0)
    assert lock.exists()  # refused, never removed behind the user's back


def test_a_young_lock_is_a_build_running_elsewhere_and_only_noted(tmp_path):
    lock = op(tmp_path, lock_age=20, library_age=3600)  # a rebuild over an old library
    (note,) = check_build_locks(tmp_path, recheck_s=0)
    assert note.startswith(f"{lock} is 20 s old: a build of deepspeed_shm_comm in another process")


def test_a_lock_released_while_checked_is_no_refusal(tmp_path, monkeypatch):
    """The build that wrote the library releases its lock right after: what is gone at the second look is fine (the
    release happens during the check's wait, without a timer a loaded machine could delay)."""
    from lit_hbp.lightning import op_builds

    lock = op(tmp_path, lock_age=60, library_age=0)
    waited = []
    monkeypatch.setattr(op_builds.time, "sleep", lambda s: (waited.append(s), lock.unlink()))
    assert check_build_locks(tmp_path, recheck_s=1.0) == [] and waited == [1.0]


@pytest.mark.parametrize("waits", [True, False], ids=["torch <= 2.13: FileBaton", "torch 2.14: an OS lock"])
def test_hbpstrategy_refuses_a_stale_lock_before_deepspeed_waits_on_it(tmp_path, monkeypatch, waits):
    """Where torch waits on a lock file's existence the strategy refuses a stale one; torch 2.14's builds hold an OS
    lock and leave their lock file behind as a matter of course (the CI's compatibility part failed on it): nothing
    is refused there."""
    from lightning.pytorch import Trainer

    from lit_hbp.lightning import op_builds
    from lit_hbp.lightning.strategy import HBPStrategy

    lock = op(tmp_path, lock_age=300, library_age=60)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(op_builds, "waits_on_lock_files", lambda: waits)
    started = []
    monkeypatch.setattr(HBPStrategy, "_init_deepspeed_distributed", lambda self: started.append(self))
    trainer = Trainer(strategy=HBPStrategy(stage=2), accelerator="cpu", devices=1, logger=False)
    if waits:
        with pytest.raises(ConfigError, match=f"rm {lock}"):
            trainer.strategy.setup_distributed()
        assert not started  # DeepSpeed's set-up (where torch would wait on the lock) never began
        lock.unlink()
    trainer.strategy.setup_distributed()
    assert started


def test_which_torch_waits_on_lock_files():
    """Read off torch's own build function: its source names FileBaton (a lock file's existence) or a FileLock."""
    import inspect

    import torch
    from torch.utils import cpp_extension

    from lit_hbp.lightning.op_builds import waits_on_lock_files

    source = inspect.getsource(cpp_extension._jit_compile)
    assert waits_on_lock_files() == ("FileBaton(" in source)
    major_minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert waits_on_lock_files() == (major_minor <= (2, 13))  # 2.14 moved to filelock (pytorch#189245)
