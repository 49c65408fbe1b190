"""Where a run resumes from: ``--ckpt_path`` checked before anything is built (a whole checkpoint, of the
kind the run's strategy loads, through the weights-only unpickler), ``--ckpt_path auto`` (the newest complete
checkpoint of the run's folders, or a fresh start, said either way), and a resumed run's logs kept in the
run folder it resumes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_hbp.cli.checks import is_deepspeed, is_instance_entry
from lit_hbp.cli.launch import world_size_of
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.checkpoints import (
    WEIGHTS_ONLY,
    check_checkpoint,
    client_state_file,
    find_resumable,
    holds_training_state,
    safe_load,
    trusted_load,
)
from lit_hbp.lightning.resume_checks import check_resumed_settings, plan_seed

AUTO = "auto"  # --ckpt_path auto: the newest complete checkpoint of the run's folders, if there is one
# Loggers whose run folder is known from the config: class (or a subclass) -> (the init argument that names
# the run folder, that argument's default).
NAMED_LOGGERS = {"TensorBoardLogger": ("name", "lightning_logs"), "CSVLogger": ("name", "lightning_logs"),
                 "WandbLogger": ("project", "lightning_logs")}  # fmt: skip


def _run_folder_argument(logger: Any) -> tuple[str, str] | None:
    """``NAMED_LOGGERS``' entry for a config's logger, asked by class (a subclass keeps its base's folders)."""
    from lightning.pytorch import loggers

    for name, entry in NAMED_LOGGERS.items():
        if is_instance_entry(logger, getattr(loggers, name)):
            return entry
    return None


def _saving(section: Any) -> tuple[Path, list[str | None], Any]:
    """What decides where a run of this config saves: ``default_root_dir``, each ModelCheckpoint's ``dirpath``
    (None where unset) and the first logger (no logger given: Lightning's default TensorBoardLogger; False for
    ``logger: false``)."""
    callbacks = section.get("trainer.callbacks") or []
    dirpaths = [(cb.get("init_args") or {}).get("dirpath") for cb in callbacks if _is_model_checkpoint(cb)]
    logger = section.get("trainer.logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    if logger is None or logger is True:
        logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {}}
    return Path(section.get("trainer.default_root_dir") or "."), dirpaths, logger if logger != [] else False


def _run_base(root: Path, logger: Any) -> tuple[Path, Any] | None:
    """A known logger's ``<save_dir>/<name>`` and its pinned version (None: the next one); None for a logger
    whose folders are not known here."""
    named = _run_folder_argument(logger) if hasattr(logger, "get") else None
    if named is None:
        return None
    key, default = named
    args = logger.get("init_args") or {}
    return Path(args.get("save_dir") or root) / str(args.get(key) or default), args.get("version")


def checkpoint_folders(section: Any) -> list[Path]:
    """The folders a run of this config writes checkpoints into, over all its versions: each
    ``ModelCheckpoint``'s ``dirpath``; ``<save_dir>/<name>/<version>/checkpoints`` of the first logger
    (where Lightning's checkpoint callbacks and ``interrupted.ckpt`` go; no logger given: Lightning's default
    TensorBoardLogger's, ``<default_root_dir>/lightning_logs``), or ``<default_root_dir>/checkpoints`` with
    ``logger: false``; ``default_root_dir`` (SLURM's
    ``hpc_ckpt_<n>.ckpt``). A logger whose folders are not known here is refused unless every
    checkpoint callback has a ``dirpath``."""
    root, dirpaths, logger = _saving(section)
    folders = [root] + [Path(d) for d in dirpaths if d]
    if logger is False:
        return folders + [root / "checkpoints"]
    run = _run_base(root, logger)
    if run is None:
        if dirpaths and all(dirpaths):
            return folders
        raise ConfigError(
            f"--ckpt_path {AUTO}: where {logger.get('class_path')} puts checkpoints is not known here; give each "
            "ModelCheckpoint a dirpath (trainer.callbacks), or resume with --ckpt_path <file>"
        )
    base, version = run
    if version is not None:
        return folders + [_version_folder(base, version)]
    return folders + [
        v / "checkpoints" for v in (sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else [])
    ]


def _is_model_checkpoint(callback: Any) -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return hasattr(callback, "get") and is_instance_entry(callback, ModelCheckpoint)


def resolve_auto_resume(section: Any, validating: bool = False) -> None:
    """``--ckpt_path auto``: the newest complete checkpoint of the run's folders
    (``checkpoint_folders``, ``lit_hbp.lightning.checkpoints.find_resumable``), or none (training starts from
    the beginning; a validation, which would score the weights ``model.model`` builds, is refused); said in the log
    either way, with each checkpoint it passed over and why (a truncated ``last.ckpt``, a save cut short). A
    requeued or restarted job resumes with the same command line."""
    if section.get("ckpt_path") != AUTO:
        return
    folders = checkpoint_folders(section)
    found, skipped = find_resumable(folders, training=not validating)
    section.ckpt_path = found
    for path, why in skipped:
        rank_zero_info(f"--ckpt_path {AUTO}: skipped {path}: {why}")
    if found:
        check_resume(section)
        rank_zero_info(f"--ckpt_path {AUTO}: resuming from {found}, the newest complete checkpoint of the run")
    else:
        where = ", ".join(str(f) for f in dict.fromkeys(folders))
        none = "no complete checkpoint" if skipped else "no checkpoint"
        if validating:
            raise ConfigError(
                f"--ckpt_path {AUTO}: {none} in {where}: nothing of this run to validate; give the checkpoint's "
                "path (or drop --ckpt_path to validate the weights model.model names)"
            )
        rank_zero_info(f"--ckpt_path {AUTO}: {none} in {where}: training starts from the beginning")


KEYWORDS = ("last", "best", "hpc", "registry")  # --ckpt_path values Lightning resolves itself
RESUME_INSTEAD = "give the checkpoint's path, or --ckpt_path auto (the newest complete checkpoint of the run)"
UNSERVED = {  # keywords a command line's fresh process cannot serve (Lightning stops on them with a traceback)
    "best": f"Lightning's best model of a fit earlier in the same process; a new process has none: {RESUME_INSTEAD}",
    "registry": f"Lightning's model registry (the litmodels package and its service, not here): {RESUME_INSTEAD}",
}

CKPT_PATH_HELP = {
    "fit": "the checkpoint to resume from: a .ckpt file, a DeepSpeed checkpoint folder (trainer.strategy hbp), "
    "'auto' (the newest complete checkpoint of this run's folders, else a fresh start) or 'last' (the last "
    "checkpoint of a ModelCheckpoint with a dirpath); checked before anything is built",
    "validate": "the checkpoint whose weights are validated: a .ckpt file, a DeepSpeed checkpoint folder "
    "(trainer.strategy hbp), 'auto' (the newest complete checkpoint of this run's folders) or 'last' (the last "
    "checkpoint of a ModelCheckpoint with a dirpath)",
}


def check_resume(section: Any) -> None:
    """``--ckpt_path`` (a local file or folder; Lightning's keywords and remote URLs are left to it) checked
    before anything is built: there, a whole checkpoint (not truncated, not some other file), of the kind
    the run's strategy loads (a DeepSpeed folder for ``hbp``, a file otherwise) and, unless
    ``--weights_only false``, read by torch's weights-only unpickler with lit-hbp's allow-list
    (``lit_hbp.lightning.checkpoints``). Lightning then loads it with ``weights_only=True`` and the same allow-list
    (``main``)."""
    ckpt = section.get("ckpt_path")
    if "weights_only" in section and section.get("weights_only") is None:
        section.weights_only = True  # torch's default since 2.6, said here for every torch and environment
    if str(ckpt) in UNSERVED:
        raise ConfigError(f"--ckpt_path {ckpt}: {UNSERVED[str(ckpt)]}")
    if str(ckpt) == "hpc" and not any(Path(section.get("trainer.default_root_dir") or ".").glob("hpc_ckpt_*.ckpt")):
        raise ConfigError(
            f"--ckpt_path hpc: no HPC checkpoint (hpc_ckpt_*.ckpt) in {section.get('trainer.default_root_dir')}, where "
            f"Lightning's SLURM requeue saves one: {RESUME_INSTEAD}"
        )
    if str(ckpt) == "last":
        section.ckpt_path = ckpt = resolve_last(section)
    if not ckpt or str(ckpt) in (AUTO, *KEYWORDS) or "://" in str(ckpt):
        return  # auto: checked once resolve_auto_resume found the checkpoint
    path = Path(ckpt)
    trust = section.get("weights_only") is False
    check_checkpoint(path, trust=trust)
    chosen = section.get("trainer.strategy")
    if hasattr(chosen, "get") and (chosen.get("init_args") or {}).get("load_full_weights"):
        return  # DeepSpeed's load_full_weights: a ZeRO-3 run that loads a file; Lightning decides
    deepspeed = is_deepspeed(chosen)
    if path.is_dir() and not deepspeed:
        raise ConfigError(
            f"--ckpt_path {path} is a DeepSpeed checkpoint folder: resume it with the strategy that saved it "
            "(--trainer.strategy hbp, or its hbp_stage_N)"
        )
    if path.is_file() and deepspeed:
        raise ConfigError(
            f"--ckpt_path {path} is a checkpoint file, and DeepSpeed (trainer.strategy "
            f"{chosen}) resumes from the checkpoint folder it saved: give that folder"
        )
    if path.is_dir() and not trust:
        check_resumed_world(path, world_size_of(section.get("trainer") or {}))


def check_training_state(section: Any) -> None:
    """A fit resumed from a weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``): Lightning stops
    in a ``KeyError`` traceback once the data is read. Refused before anything is built (a validation reads its
    weights as it reads any checkpoint's)."""
    ckpt = section.get("ckpt_path")
    if not ckpt or str(ckpt) in (AUTO, *KEYWORDS) or "://" in str(ckpt) or not Path(ckpt).exists():
        return
    if section.get("weights_only") is not False and holds_training_state(ckpt) is False:
        raise ConfigError(
            f"--ckpt_path {ckpt}: {WEIGHTS_ONLY}; resume from a full checkpoint of the run, or start a new run from "
            f"its weights (python -m lit_hbp.export {ckpt} OUT, then --model.model OUT)"
        )


def last_folders(section: Any) -> list[Path] | None:
    """Where Lightning's ``--ckpt_path last`` looks for a checkpoint a run of this config saved before: each
    ModelCheckpoint's ``dirpath``, ``<default_root_dir>/checkpoints`` with ``logger: false``, a logger's pinned
    ``version`` folder; None where it is the next version of a versioned logger (a new process's, empty)."""
    root, dirpaths, logger = _saving(section)
    if any(dirpaths):
        return [Path(d) for d in dirpaths if d]
    if logger is False:
        return [root / "checkpoints"]
    run = _run_base(root, logger)
    if run is None or run[1] is None:
        return None
    return [_version_folder(*run)]


def _version_folder(base: Path, version: Any) -> Path:
    """A versioned logger's run folder's checkpoints: ``version`` a name, or a number (``version_<n>``)."""
    return base / (version if isinstance(version, str) else f"version_{version}") / "checkpoints"


def resolve_last(section: Any) -> str:
    """``--ckpt_path last`` as Lightning resolves it (the newest ``last*.ckpt`` where its ModelCheckpoint saves,
    ``last_folders``), resolved here so that it is checked as a path is; refused where it would find none (Lightning
    warns and trains, or validates, the weights ``model.model`` builds)."""
    folders = last_folders(section)
    if folders is None:
        raise ConfigError(
            "--ckpt_path last: Lightning looks for the last checkpoint in the folder its ModelCheckpoint saves into, "
            "which for this config is a new run folder (the logger's next version) holding none yet, and would train "
            f"from the start: {RESUME_INSTEAD}"
        )
    found = sorted((p for f in folders if f.is_dir() for p in f.glob("last*.ckpt")), key=lambda p: p.stat().st_mtime)
    if not found:
        where = ", ".join(str(f) for f in folders)
        raise ConfigError(f"--ckpt_path last: no last checkpoint (last*.ckpt) in {where}: {RESUME_INSTEAD}")
    rank_zero_info(f"--ckpt_path last: {found[-1]}")
    return str(found[-1])


def check_resumed_world(path: Path, world: int | None) -> None:
    """A DeepSpeed folder resumed on another number of processes: DeepSpeed's load stopped in a traceback
    ("used a DP world size of 2 but the current world size is 1"); the plan of a run on another world differs
    anyway (``loader``'s refusal of a file saved so). Refused before anything is built."""
    saved = safe_load(client_state_file(path), mmap=True).get("dp_world_size")
    if world is not None and isinstance(saved, int) and saved != world:
        raise ConfigError(
            f"--ckpt_path {path}: its run trained on {saved} processes and this one has {world} (trainer.devices x "
            "trainer.num_nodes): DeepSpeed's partitions and the epoch's plan are per process; resume on "
            f"{saved}, or start a new run from the exported model (python -m lit_hbp.export CKPT OUT)"
        )


def resume_in_run_folder(section: Any) -> None:
    """A run resumed with ``--ckpt_path <save_dir>/<name>/<version>/checkpoints/x.ckpt`` logs into that
    ``<version>`` folder (its curves continue where they stopped) rather than a new ``version_N+1``,
    when the config's logger writes to ``<save_dir>/<name>`` and pins no version of its own."""
    ckpt = section.get("ckpt_path")
    logger = section.get("trainer.logger")
    if not ckpt or ckpt in ("last", "best", "hpc", "registry") or not logger or isinstance(logger, (bool, list)):
        return
    args = logger.get("init_args")
    if args is None or args.get("version") is not None or args.get("save_dir") is None:
        return
    run_dir = Path(ckpt).resolve().parent
    if run_dir.name == "checkpoints":
        run_dir = run_dir.parent
    name = args.get("name")
    expected = Path(args.save_dir) / name if name else Path(args.save_dir)
    if run_dir.parent == expected.resolve():
        if str(logger.get("class_path") or "").endswith("CSVLogger"):
            # Lightning's CSVLogger deletes the metrics.csv of a version folder it opens again
            rank_zero_info(f"resuming {run_dir}: the CSVLogger logs (and checkpoints without a dirpath) go into a "
                           "new version folder: it would erase this one's metrics.csv")  # fmt: skip
            return
        # version_N as the number N: the loggers name its folder the same, and the progress bar shows
        # v_num=N (a string version shows its last 4 characters there: "on_0").
        number = re.fullmatch(r"version_(\d+)", run_dir.name)
        args.version = int(number.group(1)) if number else run_dir.name
        rank_zero_info(f"resuming in the run folder {run_dir} (logs continue there)")
        say_later_checkpoints(Path(ckpt))


def say_later_checkpoints(ckpt: Path) -> None:
    """A resume into its run folder from a checkpoint older than another one there (a rollback, after a loss spike):
    the folder's logs go past its step, and the steps from it on are logged there a second time (the loggers keep
    both points of a step). Said, naming the later checkpoint and how to keep the curves apart."""
    step = saved_step(ckpt)
    if step is None:
        return
    steps = {p: saved_step(p) for p in ckpt.parent.glob("*.ckpt") if p.resolve() != ckpt.resolve()}
    later = {p: s for p, s in steps.items() if s is not None and s > step}
    if later:
        newest = max(later, key=later.get)
        rank_zero_warn(
            f"--ckpt_path {ckpt}: {newest.name} in its folder was saved after it, so the run folder's logs go past "
            "this checkpoint's step: the steps from it on are logged there again, beside the first run's (give "
            "trainer.logger.init_args.version a new name to log this continuation apart)"
        )


def saved_step(path: Path) -> int | None:
    """The optimizer step a checkpoint (a file, or a DeepSpeed folder's client state) was saved at; None where it
    cannot be read (its own error comes where it is loaded)."""
    try:
        step = safe_load(client_state_file(path), mmap=True).get("global_step")
    except Exception:  # noqa: BLE001 - a file cut short, not a checkpoint, unsafe: not this function's to say
        return None
    return step if isinstance(step, int) else None


def check_resumed_model(given: Any, saved: dict, validating: bool = False) -> None:
    """A resume continues the run as its checkpoint saved it: Lightning reads the module's arguments from the
    checkpoint over the config's, so a ``model.*`` value the config or command line changed would be dropped
    without a word (``--model.lr 1e-4`` trained on at the checkpoint's 3e-3). Refused, naming each one; a
    validation (``validating``) likewise."""
    if isinstance(given, (dict, Namespace)):
        check_resumed_settings(_plain(given), _plain(saved), validating=validating)


def _plain(value: Any) -> Any:
    """A config value as plain data: namespaces as dicts, tuples as lists."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def checkpoint_data_seed(section: Any) -> int | None:
    """The data seed the checkpoint ``--ckpt_path`` names planned with (its training loader's plan key): a resume
    that does not set ``data.seed`` takes it, whatever ``seed_everything`` says now (a run without one drew a
    random seed), so it re-creates the plan it stopped in. None without such a checkpoint (a fresh start,
    Lightning's ``last``, a checkpoint saved before its loader's first state)."""
    return plan_seed(saved_state(section))


def check_resumed_steps(section: Any, found: bool = False) -> str | None:
    """A resume whose ``trainer.max_steps``, ``trainer.max_epochs`` or ``trainer.max_time`` (Lightning's Timer counts
    the training time over resumes) the checkpoint has reached already would build
    the model, read the data and stop at once with status 0, having trained nothing (Lightning's loop ends there). A
    checkpoint the command named: refused, naming both numbers. One ``--ckpt_path auto`` ``found``: the run is
    complete, what a scheduler running the same line again meets; the line that says so is returned (the command
    ends there, 0)."""
    trainer = section.get("trainer") or {}
    limits = [(key, trainer.get(key)) for key in ("max_steps", "max_epochs")]
    limits = [(k, v) for k, v in limits if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if trainer.get("max_time") is not None:
        limits.append(("max_time", trainer["max_time"]))
    if not limits:
        return None  # -1 or unset: Lightning's default bound (1,000 epochs) is not a run's own
    state = saved_state(section)
    loops = (state.get("loops") or {}).get("fit_loop") or {}
    epoch = ((loops.get("epoch_progress") or {}).get("current")) or {}
    epochs = epoch.get("processed")
    if isinstance(epochs, int) and (loops.get("epoch_loop.batch_progress") or {}).get("is_last_batch"):
        # saved at its epoch's last step, before Lightning closed the epoch (FinalCheckpoint): that epoch is done
        epochs += int(epoch.get("started", epochs) > epochs)
    done = {"max_steps": state.get("global_step"), "max_epochs": epochs, "max_time": _trained_seconds(state)}
    for key, limit in limits:
        at = done[key]
        if key == "max_time":  # Lightning's Timer counts the run's training time over its resumes
            if at is None or at < _seconds(limit):
                continue
            limit, at = trainer["max_time"], f"{at:.0f} s"
        elif not isinstance(at, int) or at < limit:
            continue
        where = {"max_steps": f"at optimizer step {at}", "max_epochs": f"after {at} epoch(s)"}.get(
            key, f"after {at} of training (Lightning's Timer counts it over resumes)"
        )
        if found:
            return (
                f"--ckpt_path auto: {section.get('ckpt_path')} is {where}, trainer.{key} {limit}: the run is "
                "complete, nothing left to train"
            )
        raise ConfigError(
            f"--ckpt_path {section.get('ckpt_path')} was saved {where} and trainer.{key} is {limit}: the resumed "
            f"run would train nothing; set trainer.{key} above {at} to train on"
        )
    return None


def _trained_seconds(state: dict) -> float | None:
    """The training time Lightning's ``Timer`` counted up to the checkpoint (its state), or None without one."""
    timers = [v for k, v in (state.get("callbacks") or {}).items() if str(k).startswith("Timer")]
    seconds = ((timers[0] if timers else {}).get("time_elapsed") or {}).get("train")
    return float(seconds) if isinstance(seconds, (int, float)) else None


def _seconds(max_time: Any) -> float:
    """``trainer.max_time`` (``"DD:HH:MM:SS"``, a mapping of timedelta's fields, a timedelta) in seconds, as
    Lightning's Timer reads it."""
    from lightning.pytorch.callbacks import Timer

    return float(Timer(duration=max_time)._duration)


def saved_state(section: Any) -> dict:
    """The Lightning state (loops, global step) of the local checkpoint ``--ckpt_path`` names, memory-mapped;
    empty without one (a fresh start, Lightning's keywords, a remote path)."""
    ckpt = section.get("ckpt_path")
    if not (ckpt and str(ckpt) != AUTO and Path(ckpt).exists()):
        return {}
    load = trusted_load if section.get("weights_only") is False else safe_load
    return load(client_state_file(ckpt), mmap=True)


RESUMED_CONFIG = "config.resumed.yaml"


class ResumeSaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` writer, but a run resumed into its run folder (``resume_in_run_folder``) keeps
    the folder's ``config.yaml`` (the run's own) and writes its config beside it (``config.resumed.yaml``): a resume
    refused after set-up (another plan) replaced the run's config with the refused one."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        folder = trainer.log_dir
        resumed = self.config.get("ckpt_path") if hasattr(self.config, "get") else None
        if resumed and folder and (Path(folder) / "config.yaml").is_file() and self.config_filename == "config.yaml":
            self.config_filename = RESUMED_CONFIG
        super().setup(trainer, pl_module, stage)
