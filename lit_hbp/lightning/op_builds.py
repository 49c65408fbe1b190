"""DeepSpeed's ops (its CPU communication op, CPU Adam, ...) build at their first use into torch's extensions folder,
one folder an op, guarded by a ``lock`` file that torch's ``FileBaton`` (torch <= 2.13) waits on without a word and
without end. A build that was stopped (Ctrl-C, a killed job) leaves the lock behind: every later run on that folder
hangs at DeepSpeed's set-up. ``HBPStrategy`` reads the locks before it starts DeepSpeed and refuses one a stopped
build left. torch 2.14 holds an OS lock instead, which the kernel releases with its process: its lock file stays,
harmless to it (but not to an older torch building in the same folder), and nothing is checked there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lit_hbp.errors import ConfigError

STALE_AFTER_S = 1800.0  # longer than any op's build (nvcc builds take minutes): the build that made it is gone
RECHECK_S = 2.0  # a build releases its lock right after writing its library: a lock still there then is left


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its default root (per-Python subfolders)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _locks(root: Path) -> list[Path]:
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def _built_after(lock: Path) -> bool:
    """Whether the lock's op has a library newer than the lock (the build finished after making it)."""
    made = lock.stat().st_mtime
    return any(lib.stat().st_mtime > made for lib in lock.parent.glob("*.so"))


def check_build_locks(root: Path | None = None, recheck_s: float = RECHECK_S) -> list[str]:
    """Refuse (ConfigError) a build lock under ``root`` that a stopped build left: its op's library is newer than the
    lock (the build finished, the lock stayed) or the lock is older than ``STALE_AFTER_S``. Returns a note for each
    other lock (a build running in another process now, or one stopped moments ago)."""
    root = extensions_root() if root is None else root
    locks = _locks(root)
    if not locks:
        return []
    built_after = [lock for lock in locks if _built_after(lock)]
    if built_after and recheck_s > 0:
        time.sleep(recheck_s)  # the build that wrote the library may be releasing its lock now
    notes = []
    for lock in locks:
        try:
            made = lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        age = time.time() - made
        why = (
            "its library was built after it was made, and it is still there"
            if lock in built_after
            else f"it is {age / 60:.0f} minutes old"
            if age > STALE_AFTER_S
            else None
        )
        if why:
            raise ConfigError(
                f"{lock}: a build of {lock.parent.name} that was stopped (or one by torch >= 2.14, which keeps it) "
                f"left this lock ({why}); DeepSpeed's set-up would wait on it forever: remove it (rm {lock}) and run "
                "again"
            )
        notes.append(
            f"{lock} is {age:.0f} s old: a build of {lock.parent.name} in another process, or one that was stopped; "
            "DeepSpeed waits until it goes: if no build is running, remove it"
        )
    return notes


def waits_on_lock_files() -> bool:
    """Whether this torch's extension builds wait while a lock file exists (``FileBaton``, torch <= 2.13)."""
    from torch.utils import cpp_extension

    build = getattr(cpp_extension, "_jit_compile", None)
    return build is not None and "FileBaton" in build.__code__.co_names


def refuse_stale_build_locks() -> None:
    """``check_build_locks`` of torch's extensions folder where this torch waits on lock files, notes said on rank 0."""
    from lightning.pytorch.utilities import rank_zero_warn

    if not waits_on_lock_files():
        return
    for note in check_build_locks():
        rank_zero_warn(note)
