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
auto`` resumes from (``find_resumable`` also says what it passed over and why).

No pickle from a stranger: a checkpoint is a pickle, and unpickling runs whatever functions the file
names. Every checkpoint lit-hbp opens (resume, validate, export) is first read with
``torch.load(weights_only=True)`` under an allow-list of exactly what lit-hbp, Lightning and DeepSpeed
write (``SAFE_GLOBALS``, beside torch's own tensors and containers): ``check_checkpoint`` refuses
anything else with a one-line error naming the types, before any data is tokenized. A file one made
oneself, or trusts, opens with the opt-in (``--weights_only false`` for ``fit``/``validate``,
``--trust-checkpoint`` for ``python -m lit_hbp.export``; docs/finetune.md).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pickletools
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_hbp.errors import ConfigError, UserInputError

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


def client_state_file(path: str | os.PathLike) -> Path:
    """The file of checkpoint ``path`` holding Lightning's own entries (hyper-parameters, loops, callbacks): the
    file, or the first model-states file of the tag a DeepSpeed folder's ``latest`` names (DeepSpeed keeps the
    client state Lightning gives it there)."""
    files = checkpoint_files(path)
    return min(f for f in files if MODEL_STATES.match(f.name)) if Path(path).is_dir() else files[0]


# Lightning's WeightAveraging puts the average in a checkpoint's state_dict, which a DeepSpeed save leaves out (its
# folder holds the engine's own weights), and DeepSpeed's fp32 partitions are the current weights, not the average.
AVERAGED_UNDER_DEEPSPEED = (
    "under DeepSpeed (trainer.strategy) the averaged weights reach no checkpoint and no export (DeepSpeed saves its "
    "engine's own, the current weights): train with trainer.strategy hbp_ddp, or without the averaging"
)


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


def saved_by_zero3(path: str | os.PathLike) -> bool:
    """Whether a DeepSpeed checkpoint folder's latest tag was written by ZeRO stage 3 (each rank's partition of
    the model states, ``zero_pp_rank_N_mp_rank_00_model_states.pt``; stages 0-2 write one ``mp_rank_00_...``)."""
    tag = _latest_tag(Path(path))
    folder = Path(path) / tag if tag is not None else None
    if folder is None or not folder.is_dir():
        return False
    return any(f.name.startswith("zero_pp_rank_") and f.name.endswith("_model_states.pt") for f in folder.iterdir())


def check_zero_folder(path: str | os.PathLike, stage: int, doing: str) -> None:
    """A DeepSpeed folder is loaded under the ZeRO stage that saved it (3, or 0-2: their files differ), and a
    ZeRO-3 folder to train on only (``doing``: the trainer's ``fit``, ``validate``, ...): DeepSpeed restores its
    partitioned weights through the optimizer, which a validation has not (its own load fails there)."""
    saved3 = saved_by_zero3(path)
    if saved3 != (stage == 3):
        raise ConfigError(
            f"--ckpt_path {path}: DeepSpeed's ZeRO stage {'3' if saved3 else '0-2'} saved it, and this run's strategy "
            f"is stage {stage}: load it with the stage that saved it (trainer.strategy "
            f"{'hbp_stage_3' if saved3 else 'hbp'})"
        )
    if saved3 and doing != "fit":
        raise ConfigError(
            f"--ckpt_path {path}: a ZeRO-3 checkpoint folder resumes training but does not load to {doing} (DeepSpeed "
            "restores its partitioned weights through the optimizer): export it (python -m lit_hbp.export CKPT OUT) "
            "and give OUT as model.model, without --ckpt_path"
        )


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
    """The newest checkpoint a fit resumes from (``*.ckpt``: a file or a DeepSpeed folder, complete and holding the
    training state) directly inside any of ``folders``, by the time it was completed; None when there is none.
    Partial files (``.<name>.partial``), incomplete and weights-only checkpoints are passed over."""
    return find_resumable(folders)[0]


# --- what a resume passes over ----------------------------------------------------------------------


def why_incomplete(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a whole checkpoint (``is_complete``), in a few words; None when it is one."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if path.is_dir():
        tag = _latest_tag(path)
        if not (path / LATEST).is_file():
            if (path.parent / LATEST).is_file() and any(MODEL_STATES.match(f.name) for f in path.iterdir()):
                return f"a tag folder of the DeepSpeed checkpoint {path.parent}: give that folder"
            if (path / "config.json").is_file():
                return "a Hugging Face model folder (an export, or a base model), not a checkpoint of a run"
            inside = sorted(f.name for f in path.iterdir() if f.name.endswith(".ckpt"))
            if inside:  # a run's checkpoints/ folder: the checkpoints are in it
                named = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
                pick = "last.ckpt" if "last.ckpt" in inside else max(inside, key=lambda n: (path / n).stat().st_mtime)
                return f"a folder of checkpoints ({named}), not one: give one of them, e.g. {path / pick}"
            return "a folder without DeepSpeed's `latest` file (a save that was cut short, or not a checkpoint folder)"
        if tag is None or not (path / tag).is_dir():
            return f"its `latest` names the tag folder {tag!r}, which is not there"
        states = [f for f in (path / tag).iterdir() if MODEL_STATES.match(f.name)]
        if not states:
            return f"its tag folder {tag} holds no model-states file"
        broken = [f.name for f in states if not _whole_zip(f)]
        return f"{tag}/{broken[0]} is truncated" if broken else None
    if not path.is_file():
        return "not a regular file"
    if _whole_zip(path):
        return None
    return _why_not_zip(path)


def _why_not_zip(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not head:
        return "empty (0 bytes)"
    if head == b"PK\x03\x04":  # a zip's first entry, without the directory a zip ends with
        return "truncated: it starts as a checkpoint but its end is missing (a save that was cut short?)"
    return "not a checkpoint: not a file torch.save wrote (those are zip archives)"


WEIGHTS_ONLY = (
    "saved with weights only (a ModelCheckpoint's save_weights_only): no optimizer, scheduler or loop state to resume "
    "training from"
)


def holds_training_state(path: str | os.PathLike) -> bool | None:
    """Whether checkpoint ``path`` holds what a resumed fit restores: Lightning's ``lr_schedulers`` (and, in a file,
    ``optimizer_states``; DeepSpeed keeps its own), which a ``ModelCheckpoint(save_weights_only=True)`` save leaves
    out (Lightning's resume from it stops in a ``KeyError`` after the data is read). None where the file cannot be
    read with the allow-list (the resume's checks refuse it by name)."""
    try:
        state = safe_load(client_state_file(path), mmap=True)
    except (UserInputError, OSError, ValueError):
        return None
    keys = ("lr_schedulers",) if Path(path).is_dir() else ("lr_schedulers", "optimizer_states")
    return isinstance(state, dict) and all(key in state for key in keys)


def find_resumable(
    folders: Iterable[str | os.PathLike], training: bool = True
) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete checkpoint directly inside any of ``folders``, by the time it was completed, or None;
    each checkpoint-named entry passed over, with why): what ``--ckpt_path auto`` resumes from and what it says it
    skipped. A left-over ``.<name>.partial`` file is a save that was cut short; for ``training`` (a fit's resume) a
    newer weights-only save is passed over too."""
    found: list[tuple[float, str]] = []
    skipped: list[tuple[str, str]] = []
    for folder in dict.fromkeys(Path(f) for f in folders):
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.ckpt")):
            if path.name.startswith("."):
                continue
            why = why_incomplete(path)
            if why is None:
                found.append((_written_at(path), str(path)))
            else:
                skipped.append((str(path), why))
        for path in sorted(folder.glob(f".*.ckpt{PARTIAL}")):
            skipped.append((str(path), "a save that was cut short (written beside its name, never renamed)"))
    for _, path in sorted(found, reverse=True):
        if not training or holds_training_state(path) is not False:
            return path, skipped
        skipped.append((path, WEIGHTS_ONLY))
    return None, skipped


# --- no pickle from a stranger ----------------------------------------------------------------------

# What lit-hbp's runs write beyond torch's own weights-only allow-list (tensors, dtypes, OrderedDict...),
# name -> where it comes from. Lightning's checkpoint (a plain file, the CLI's default) holds nothing
# more: its loops, callbacks, optimizer and scheduler states and hyper-parameters are plain containers.
SAFE_GLOBALS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": "DeepSpeed ZeRO's optimizer state (zero_stage)",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "DeepSpeed's optimizer state (a static loss scale)",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "DeepSpeed's optimizer state (fp16's dynamic loss scale)",
    "deepspeed.utils.tensor_fragment.fragment_address": "DeepSpeed's optimizer state (param_slice_mappings)",
}
# Python 3.11's earlier releases (Debian's 3.11.2) pickle an enum member as getattr(its class, its name):
# DeepSpeed's ZeroStageEnum so. Those names load through ``enum_member``, which returns a member of an
# allow-listed enum and refuses any other attribute.
GETATTR = ("__builtin__.getattr", "builtins.getattr")
TRUST_HINT = {
    "fit": "--weights_only false",
    "export": "--trust-checkpoint",
}


class UnsafeCheckpoint(UserInputError):
    """A checkpoint whose pickle names something outside the allow-list (``SAFE_GLOBALS``)."""


def safe_globals(names: Iterable[str] | None = None) -> list:
    """The objects of ``SAFE_GLOBALS`` (those among ``names`` if given) whose modules are installed:
    DeepSpeed's, imported only here, and only for a file that names them (an export of a plain run does
    not import DeepSpeed)."""
    import importlib

    found = []
    for name in SAFE_GLOBALS if names is None else [n for n in SAFE_GLOBALS if n in set(names)]:
        module, attr = name.rsplit(".", 1)
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # DeepSpeed absent or reorganised: its checkpoints are refused
            continue
    return found


def enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as a pickle written by Python 3.11.0-3.11.4 calls it for an enum member:
    only a member of an enum ``SAFE_GLOBALS`` names; anything else is refused, nothing is read."""
    import enum

    allowed = isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" in SAFE_GLOBALS
    if allowed and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r:.60}, {name!r:.40}): not a member of an allow-listed enum")


@contextlib.contextmanager
def allow_listed(names: Iterable[str] | None = None) -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside accepts what ``SAFE_GLOBALS`` names (those among ``names``
    if given: what the file's pickles name) and an enum member pickled as ``getattr`` (``enum_member``),
    nothing else."""
    with torch.serialization.safe_globals([*safe_globals(names), *((enum_member, name) for name in GETATTR)]):
        yield


def pickled_globals(data: bytes) -> list[str]:
    """Every function or class a pickle names (``module.name``), read statically: nothing runs.
    GLOBAL and INST name theirs; STACK_GLOBAL takes the two strings pushed before it."""
    names: list[str] = []
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.append(".".join(str(arg).split(" ", 1)))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and op.name.endswith("UNICODE"):
                strings.append(arg)
    except (ValueError, pickle.UnpicklingError, EOFError):  # an unreadable rest: the load below refuses it
        pass
    return list(dict.fromkeys(names))


def _pickles(path: Path) -> Iterator[tuple[str, bytes]]:
    """(member, pickle bytes) of each pickle a torch.save zip holds (``data.pkl``; torch's later formats
    add none that names functions)."""
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.endswith(".pkl"):
                yield name, z.read(name)


def named_globals(path: str | os.PathLike) -> list[str]:
    """Every function or class the pickles of torch.save file ``path`` name (read statically)."""
    return list(dict.fromkeys(g for _, data in _pickles(Path(path)) for g in pickled_globals(data)))


def unsafe_globals(path: str | os.PathLike, named: list[str] | None = None) -> list[str]:
    """What a torch.save file's pickles name (``named``, read from ``path`` if not given) beyond torch's
    weights-only allow-list and ``SAFE_GLOBALS``."""
    from torch import _weights_only_unpickler as unpickler  # torch's own allow-list (no public accessor)

    allowed = set(unpickler._get_allowed_globals()) | set(SAFE_GLOBALS) | set(GETATTR)
    return [g for g in (named_globals(path) if named is None else named) if g not in allowed]


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The torch.save files a load of checkpoint ``path`` reads: the file, or every ``.pt`` file of the
    tag folder a DeepSpeed folder's ``latest`` names."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    return sorted(p for p in (path / (_latest_tag(path) or "")).glob("*.pt") if p.is_file())


def check_checkpoint(path: str | os.PathLike, trust: bool = False, opt_in: str = TRUST_HINT["fit"]) -> None:
    """Refuse, with a one-line ``UserInputError``, a checkpoint path that is missing, a folder that is
    not a DeepSpeed checkpoint, a truncated file or one that is not a checkpoint, and (unless ``trust``)
    one whose pickles name anything outside the allow-list: each file is read by torch's weights-only
    unpickler (memory-mapped, so its tensors are not read), so nothing it names runs. ``opt_in``: the
    option that trusts a file, named in the refusal."""
    path = Path(path)
    if not path.exists():
        from lit_hbp.errors import did_you_mean

        near = did_you_mean(path.name, (p.name for p in path.parent.iterdir())) if path.parent.is_dir() else ""
        raise UserInputError(f"checkpoint not found: {path}{near}")
    why = why_incomplete(path)
    if why is not None:
        kind = "folder" if path.is_dir() else "file"
        raise UserInputError(f"not a checkpoint that can be loaded: {path} ({kind}): {why}")
    if trust:
        return
    for file in checkpoint_files(path):
        safe_load(file, opt_in=opt_in, mmap=True)


def safe_load(path: str | os.PathLike, map_location: Any = "cpu", opt_in: str = TRUST_HINT["fit"], mmap: bool = False):
    """``torch.load(path, weights_only=True)`` with the allow-list; a file that names anything else is an
    ``UnsafeCheckpoint`` naming what (and ``opt_in``), a file that does not unpickle a ``UserInputError``."""
    path = Path(path)
    try:
        named: list[str] | None = named_globals(path)
    except (OSError, zipfile.BadZipFile):  # not a zip: torch's weights-only unpickler below is the guard
        named = None
    unsafe = [] if named is None else unsafe_globals(path, named)
    if unsafe:
        raise UnsafeCheckpoint(_refusal(path, unsafe, opt_in))
    try:
        with allow_listed(named):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # what the static read could not name (torch's message names it)
        marks = ("GLOBAL", "Unsupported", "allow-listed enum")  # torch's own words, or enum_member's
        detail = next((line for line in str(e).splitlines() if any(m in line for m in marks)), "")
        raise UnsafeCheckpoint(_refusal(path, [detail.strip() or type(e).__name__], opt_in)) from None
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserInputError(f"cannot read checkpoint {path}: {first}") from None


def _refusal(path: Path, names: list[str], opt_in: str) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"refused to open {path}: its pickle names {shown}, which lit-hbp, Lightning and DeepSpeed never write "
        f"(unpickling would run it); only for a file you trust: {opt_in} (docs/finetune.md)"
    )


def trusted_load(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` of a file the user said they trust (the opt-in): any pickle."""
    return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
