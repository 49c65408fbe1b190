"""Checkpoint files on disk: written atomically, checked for completeness, the newest one found.

A job killed while it saves (a preemption past its grace period, an OOM kill, a lost node) must
leave the previous checkpoint loadable and never a truncated file under a checkpoint's name:

- a file (``torch.save``) is written beside its final name (``.<name>.partial`` in the same folder,
  so the rename never crosses file systems) and renamed over it (``AtomicCheckpointIO``). Lightning's
  own ``_atomic_save`` writes into the system's temporary folder and moves the file from there:
  across file systems (a node's local ``/tmp``, the checkpoints on a shared one) that move is a copy
  a kill can cut short, and the whole checkpoint passes through the local disk;
- a DeepSpeed folder gets a new tag folder per save, and its ``latest`` file, which names the tag a
  load reads, is written (atomically) after every rank wrote its part (``save_deepspeed``). Lightning
  saves every time into the tag ``checkpoint``, over the files of the previous save, and DeepSpeed
  writes ``latest`` on rank 0 before the other ranks are done.

``newest_checkpoint`` finds the newest complete checkpoint of a run's folders, what ``--ckpt_path
auto`` resumes from.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

LATEST = "latest"  # DeepSpeed's file naming the tag folder a load reads
PARTIAL = ".partial"
MODEL_STATES = re.compile(r".*model_states\.pt$")


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a file beside ``path`` (``.<name>.partial``), flush it to disk, then rename it
    to ``path``: readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}{PARTIAL}"
    with open(partial, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a crash right after it does not undo it)."""
    with contextlib.suppress(OSError):  # some file systems refuse to open folders; the rename still happened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO with local files written by ``write_atomically``; remote paths
    (``s3://``, ...) keep Lightning's own save. The CLI installs it; in a Lightning project of one's
    own pass ``Trainer(plugins=[AtomicCheckpointIO()])``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        if get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomically(str(path).removeprefix("file://"), lambda f: torch.save(checkpoint, f))


def save_deepspeed(strategy: Any, checkpoint: dict[str, Any], folder: str, exclude: Iterable[str] = ()) -> None:
    """Save a DeepSpeed engine's checkpoint into ``folder`` so that a kill at any moment leaves the
    previous save loadable: every rank writes a new tag folder (``global_step<N>``), a barrier, then
    rank 0 writes ``latest`` atomically and removes the older tag folders. Every rank calls it (a ZeRO
    save is collective). ``strategy``: a Lightning DeepSpeedStrategy set up for training."""
    folder = strategy.broadcast(str(folder))
    tag = new_tag(folder, int(checkpoint.get("global_step", 0))) if strategy.is_global_zero else None
    tag = strategy.broadcast(tag)
    state = {k: v for k, v in checkpoint.items() if k not in set(exclude)}
    strategy.deepspeed_engine.save_checkpoint(
        folder, client_state=state, tag=tag, save_latest=False,
        exclude_frozen_parameters=strategy.exclude_frozen_parameters,
    )  # fmt: skip
    strategy.barrier("deepspeed_checkpoint_written")
    if strategy.is_global_zero:
        write_atomically(os.path.join(folder, LATEST), lambda f: f.write(tag.encode()))
        for old in _tag_folders(folder):
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    strategy.barrier("deepspeed_checkpoint_committed")


def new_tag(folder: str, step: int) -> str:
    """A tag for a save of ``step`` into ``folder`` that does not overwrite the tag ``latest`` names: a
    tag folder left by a save that was killed is removed first and reused."""
    latest = _latest_tag(Path(folder))
    tag, n = f"global_step{step}", 0
    while tag == latest:
        n += 1
        tag = f"global_step{step}.{n}"
    leftover = Path(folder) / tag
    if leftover.exists():
        shutil.rmtree(leftover)
    return tag


def _latest_tag(folder: Path) -> str | None:
    try:
        return (folder / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _tag_folders(folder: str | Path) -> list[Path]:
    """The tag folders of a DeepSpeed checkpoint folder (those holding a model-states file)."""
    return [p for p in Path(folder).iterdir() if p.is_dir() and any(MODEL_STATES.match(f.name) for f in p.iterdir())]


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole checkpoint: a ``torch.save`` file whose zip directory (written last)
    reads, or a DeepSpeed folder whose ``latest`` names a tag folder with whole model-states files.
    Cheap: no tensor is read."""
    path = Path(path)
    if path.is_dir():
        tag = _latest_tag(path)
        if tag is None or not (path / tag).is_dir():
            return False
        states = [f for f in (path / tag).iterdir() if MODEL_STATES.match(f.name)]
        return bool(states) and all(_whole_zip(f) for f in states)
    return path.is_file() and _whole_zip(path)


def _whole_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(name.endswith("data.pkl") for name in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _written_at(path: Path) -> float:
    """When a checkpoint was completed: a file's mtime, a DeepSpeed folder's ``latest``'s."""
    return (path / LATEST).stat().st_mtime if path.is_dir() else path.stat().st_mtime


def newest_checkpoint(folders: Iterable[str | os.PathLike]) -> str | None:
    """The newest complete checkpoint (``*.ckpt``: a file or a DeepSpeed folder; ``is_complete``)
    directly inside any of ``folders``, by the time it was completed; None when there is none.
    Partial files (``.<name>.partial``) and incomplete checkpoints are passed over."""
    found: list[tuple[float, str]] = []
    for folder in dict.fromkeys(Path(f) for f in folders):
        if not folder.is_dir():
            continue
        for path in folder.glob("*.ckpt"):
            if not path.name.startswith(".") and is_complete(path):
                found.append((_written_at(path), str(path)))
    return max(found)[1] if found else None
