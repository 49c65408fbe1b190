"""``python train.py fit --config configs/tiny_cpu.yaml``: LightningCLI for HBP training.

YAML configs may use OmegaConf interpolation (``${data.levels.2.pack_len}``) so a value is written
once; it is resolved after the config files and the command line are merged (``omegaconf+``), so
``--data.demo_dir X`` also moves every path written as ``${data.demo_dir}/...``. The tokenizer's
size is linked from the data module into the model.

No silent surprises (issue 14): a list given whole on the command line (``--data.sources '[...]'``)
replaces the config's list (``--data.sources+=...`` appends); a parser error is a few lines naming
the bad key and the nearest valid one (``JSONARGPARSE_DEBUG=true`` for jsonargparse's full report);
the model mapping's keys and the levels against the world size and the model's heads are checked
before any process spawns (``lit_hbp.cli.checks``); the resolved config is printed once, compact.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import yaml
from jsonargparse import Namespace, set_parsing_settings
from jsonargparse._actions import previous_config  # set while a config file is applied over earlier values
from jsonargparse._typehints import ActionTypeHint  # jsonargparse exports no public name for it
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf.errors import OmegaConfBaseException

from lit_hbp.callbacks.defaults import with_default_callbacks
from lit_hbp.callbacks.interrupt import InterruptCheckpoint
from lit_hbp.callbacks.lost_rank import LostRankReport
from lit_hbp.callbacks.summary import HBPModelSummary
from lit_hbp.cli.checks import (
    check_run_config,
    check_trainer_values,
    class_arguments,
    compact_config,
    compact_yaml,
    dataclass_defaults,
)
from lit_hbp.cli.resume import (  # noqa: F401  (public here too: their first home)
    AUTO,
    check_resume,
    checkpoint_folders,
    resolve_auto_resume,
    resume_in_run_folder,
)
from lit_hbp.errors import ConfigError, UserInputError, did_you_mean
from lit_hbp.lightning.checkpoints import (
    TRUST_HINT,
    AtomicCheckpointIO,
    UnsafeCheckpoint,
    allow_listed,
    safe_load,
    trusted_load,
)
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.lightning.strategy import config_zero_stage  # (registers --trainer.strategy hbp, hbp_stage_N)
from lit_hbp.model.build import check_model_before_data

TERMINATED = 128 + 15  # a shell's status for a program ended by SIGTERM
RUNS = "runs"  # the run folder's root (default_root_dir), relative to the working directory
DEBUG_ENV = "LIT_HBP_DEBUG"  # the full traceback instead of the short error
PARSER_DEBUG_ENV = "JSONARGPARSE_DEBUG"  # jsonargparse's own switch: raise with its full report instead of exiting
CLASS_OPTION = re.compile(r"Problem with given class_path '([^']+)':\s*(?:- )?(?:Option|Key) '([^']+)' is not")
CLASS_REQUIRED = re.compile(
    r"Problem with given class_path '([^']+)':\s*(?:- )?the following arguments are required: (.+)"
)
PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
UNKNOWN_OPTION = re.compile(r"does not accept option '([^']+)'|Option '([^']+)' is not accepted|"
                            r"unrecognized arguments: -*([^\s=]+)")  # fmt: skip


def check_resumed_model(given: Any, saved: dict) -> None:
    """A resume continues the run as its checkpoint saved it: Lightning reads the module's arguments from the
    checkpoint over the config's, so a ``model.*`` value the config or command line changed would be dropped
    without a word (``--model.lr 1e-4`` trained on at the checkpoint's 3e-3). Refused, naming each one."""
    if not isinstance(given, (dict, Namespace)):
        return
    given = _plain(given)
    changed = [
        f"model.{key}: {given[key]!r} (the checkpoint's {_plain(value)!r})"
        for key, value in saved.items()
        if not key.startswith("_") and key in given and given[key] != _plain(value)
    ]
    if changed:
        raise ConfigError(
            f"--ckpt_path resumes the run as its checkpoint saved it, with its model settings, not these: "
            f"{'; '.join(changed)}; give the run's own values (or drop them), or start a new run from the exported "
            "model (python -m lit_hbp.export CKPT OUT, then model.model: OUT)"
        )


def _plain(value: Any) -> Any:
    """A config value as plain data: namespaces as dicts, tuples as lists."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _debug() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true") for name in (DEBUG_ENV, PARSER_DEBUG_ENV))


def user_error_in(error: BaseException) -> UserInputError | None:
    """The user's mistake behind ``error``: itself, or the ``UserInputError`` it was raised from (a config
    value checked while jsonargparse instantiates a class, e.g. a data source, surfaces wrapped in its
    ValueError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserInputError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def report_user_error(error: Exception) -> NoReturn:
    """A user's mistake (``lit_hbp.errors.UserInputError``: config, data, paths) as one short paragraph
    on stderr and exit status 2, printed once (rank 0); the traceback is for bugs, or ``LIT_HBP_DEBUG=1``."""
    if rank_zero_only.rank == 0:
        sys.stderr.write(f"error: {error}\ntip: {DEBUG_ENV}=1 prints the traceback\n")
    sys.exit(2)


def _option_keys(parser: argparse.ArgumentParser) -> set[str]:
    """Every option key of ``parser`` and of its subcommands' parsers (``trainer.max_steps``, ...)."""
    keys, stack = set(), [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += list(action.choices.values())
            elif action.dest not in (argparse.SUPPRESS, "help"):
                keys.add(action.dest)
    return keys


ALIASES = {  # what users of other trainers type, and lit-hbp's key for it
    "learning_rate": "lr",
    "lr_rate": "lr",
    "weight_decay_rate": "weight_decay",
    "model_name_or_path": "model",
    "model_path": "model",
    "checkpoint": "model",
    "max_seq_length": "levels",
    "max_length": "levels",
    "seq_len": "levels",
    "gradient_accumulation_steps": "accumulate_grad_batches",
    "grad_accum": "accumulate_grad_batches",
    "max_grad_norm": "gradient_clip_val",
    "num_train_epochs": "max_epochs",
    "epochs": "max_epochs",
    "seed": "seed_everything",
    "warmup_ratio": "warmup_steps",
    "bf16": "precision",
    "fp16": "precision",
    "gpus": "devices",
    "num_gpus": "devices",
}


def alias_of(option: str, keys: Iterable[str]) -> str:
    """`` (did you mean 'model.lr'?)`` for an option another trainer names otherwise (``learning_rate``),
    when the key it stands for is a valid one next to it; else the nearest valid key."""
    section, _, name = option.lstrip("-").rpartition(".")
    keys = set(keys)
    wanted = ALIASES.get(name)
    if wanted is not None:
        near = [k for k in keys if k.rsplit(".", 1)[-1] == wanted]
        same = [k for k in near if k.rpartition(".")[0] == section] or sorted(near, key=len)
        if same:
            return f" (did you mean {same[0]!r}?)"
    return did_you_mean(option, keys)


def config_file_error(message: str, args: list[str] | None) -> str:
    """A YAML error of a config file names the file (jsonargparse says ``<unicode string>``): the first
    ``--config`` file of the command line that does not parse as YAML."""
    if "<unicode string>" not in message:
        return message
    argv = sys.argv[1:] if args is None else list(args)
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in files:
        try:
            yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError:
            return message.replace('"<unicode string>"', str(path)).replace("<unicode string>", str(path))
        except OSError:
            continue
    return message


def short_error(message: str, parser: argparse.ArgumentParser) -> str:
    """jsonargparse's error report cut to what says what is wrong: an unknown init argument of a class
    (with the class, the nearest valid argument and the valid ones), a missing required one, an unknown
    option with the nearest valid one (or the key it stands for, ``ALIASES``), a config file's YAML
    error with the file; any other message as it is."""
    found = CLASS_OPTION.search(message)
    if found:
        class_path, option = found.groups()
        arg = option.removeprefix("init_args.").split(".")[0]
        key = PARSER_KEY.search(message)
        valid = list(class_arguments(class_path))
        text = f"{key.group(1) + ': ' if key else ''}{class_path} has no argument {arg!r}{did_you_mean(arg, valid)}"
        return text + (f"\n  {class_path.rsplit('.', 1)[-1]} takes: {', '.join(valid)}" if valid else "")
    found = CLASS_REQUIRED.search(message)
    if found:
        key = PARSER_KEY.search(message)
        return f"{key.group(1) + ': ' if key else ''}{found.group(1)} needs {found.group(2).strip()}"
    found = UNKNOWN_OPTION.search(message)
    if found:
        option = next(g for g in found.groups() if g)
        return message.splitlines()[0] + alias_of(option, _option_keys(parser))
    return config_file_error(message, getattr(parser, "_hbp_args", None))


class HBPArgumentParser(LightningArgumentParser):
    """LightningArgumentParser with short errors: the bad key, the class it belongs to and the nearest
    valid key come first, without the 70-line usage listing that buried them (``JSONARGPARSE_DEBUG=true``
    restores jsonargparse's behaviour: an exception carrying the full report)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # argparse would take --trainer.max_step as --trainer.max_steps: a prefix is an unknown option here.
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if _debug() or not self.exit_on_error or callable(getattr(self, "_error_handler", None)):
            return super().error(message, ex)
        self._logger.error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {short_error(message, parser)}\n")
        sys.stderr.write(f"tip: `{prog} --help` lists the options; {PARSER_DEBUG_ENV}=true prints the full report\n")
        self.exit(2)


class _ListReplacingAction(ActionTypeHint):
    """A list-typed option whose value, given as a whole list on the command line or in a later config
    file, replaces the list set before. jsonargparse merges two lists of the same length entry by entry
    (entry i of ``--data.sources '[...]'`` would inherit the ``repeat`` of the config's entry i);
    ``--key+=...`` (``key+:`` in a config file) still appends."""

    def __call__(self, *args: Any, **kwargs: Any):
        if len(args) == 4:  # parser, cfg, value, option string: the option on the command line
            _, cfg, value, option = args
            whole_list = isinstance(value, list) or (isinstance(value, str) and value.lstrip().startswith("["))
            if option in self.option_strings and whole_list:
                cfg[self.dest] = None
        return super().__call__(*args, **kwargs)

    def _check_type(self, value, append=False, cfg=None, mode=None):
        if cfg and not append and isinstance(value, list) and previous_config.get() is not None:
            cfg = cfg.clone()  # a config file given after another: its list does not see the earlier one
            cfg[self.dest] = None
        return super()._check_type(value, append=append, cfg=cfg, mode=mode)


def replace_lists_from_command_line(parser: argparse.ArgumentParser) -> None:
    """Make every list-typed option of ``parser`` replace, not merge, when given a whole list."""
    for action in parser._actions:
        if type(action) is ActionTypeHint and ActionTypeHint.supports_append(action):
            action.__class__ = _ListReplacingAction


class HBPCLI(LightningCLI):
    """LightningCLI for HBPLitModule and HBPDataModule, with the short errors of HBPArgumentParser,
    command-line lists that replace the config's, and the config's checks before anything spawns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", HBPArgumentParser)
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Lightning's parsing; an interpolation the merged config cannot resolve (``${data.levels.2...}``
        after ``--data.levels`` gave two levels) is a short error naming the key, not a traceback. The
        parsers keep the command line they parse, whose config files an error may need to name."""
        stack = [parser]
        while stack:
            p = stack.pop()
            p._hbp_args = None if args is None else list(args)
            stack += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
        try:
            super().parse_arguments(parser, args)
        except OmegaConfBaseException as e:
            if _debug() or not parser.exit_on_error:
                raise
            where = f" (in {e.full_key})" if getattr(e, "full_key", None) else ""
            sys.stderr.write(f"error: {str(e).splitlines()[0]}{where}\n")
            parser.exit(2)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        replace_lists_from_command_line(parser)

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer with the config's callbacks plus lit-hbp's console and run hygiene, each unless
        the config has one of its kind (``lit_hbp.callbacks.with_default_callbacks``): the final step
        checkpointed, the step progress bar, the per-level epoch summary, no log folder left by a run
        that failed before its first step; checkpoint files written atomically (``AtomicCheckpointIO``)."""
        config = self._get(self.config_init, "trainer", default={})
        kwargs.setdefault(
            "callbacks", with_default_callbacks(config.get("callbacks"), config.get("enable_progress_bar", True))
        )
        summary = config.get("enable_model_summary") is not False and not config.get("barebones")
        if summary and not any(isinstance(c, ModelSummary) for c in kwargs["callbacks"]):
            # Lightning's default summary prints FLOPs it never counted (lit_hbp.callbacks.summary); with
            # enable_model_summary left on it would also say it skipped its own for this one.
            kwargs["callbacks"] = [*kwargs["callbacks"], HBPModelSummary()]
            kwargs["enable_model_summary"] = False
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # not one the config chose
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path`` checked (``check_resume``: a short error and exit 2) before Lightning reads the
        checkpoint's hyper-parameters into the config, as LightningCLI does here; they are read as it
        reads them, but with lit-hbp's allow-list and memory-mapped (the tensors of a large checkpoint
        are not read in just to find them)."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        section = self.config[subcommand]
        self._guard(check_resume, section)
        ckpt = section.get("ckpt_path")
        if not (ckpt and str(ckpt) != AUTO and Path(ckpt).is_file()):
            return
        load = trusted_load if section.get("weights_only") is False else safe_load
        hparams = load(ckpt, mmap=True).get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        self._guard(check_resumed_model, section.get("model"), hparams)
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _guard(self, check, *args: Any) -> None:
        """Run ``check``; a ``UserInputError`` is a short error and exit 2 (raised under the debug switch
        or a parser that does not exit)."""
        try:
            check(*args)
        except UserInputError as e:
            if _debug() or not self.parser.exit_on_error:
                raise
            report_user_error(e)

    def _set_seed(self) -> None:
        """Seeded after the config's checks (``before_instantiate_classes``), as LightningCLI seeds, without
        its "Seed set to ..." line: the resolved config printed after set-up names the seed, and an error
        is the first line a refused run prints."""

    def before_instantiate_classes(self) -> None:
        """Before anything is built or spawned: the config's own checks, the trainer's values Lightning
        would refuse (``check_trainer_values``) and the checkpoint ``--ckpt_path auto`` found
        (``check_resume``), each a short error and exit 2; then the seed."""
        section = self.config.get(self.subcommand) if self.subcommand else self.config
        try:
            # A subcommand trains with the config's callbacks; a tool that parses without one may drop them.
            check_run_config(section.as_dict(), trains=bool(self.subcommand))
            config = section.as_dict()
            check_model_before_data(
                (config.get("model") or {}).get("model"),
                (config.get("data") or {}).get("levels"),
                zero_stage=config_zero_stage((config.get("trainer") or {}).get("strategy")),
            )
        except ValueError as e:
            if _debug() or not self.parser.exit_on_error:
                raise
            report_user_error(e)
        self._guard(check_trainer_values, section)
        self._guard(resolve_auto_resume, section)
        resume_in_run_folder(section)
        seed = self._get(self.config, "seed_everything")
        if seed is not False:
            seed = seed_everything(None if seed is True else seed, workers=True, verbose=False)
            (self.config[self.subcommand] if self.subcommand else self.config)["seed_everything"] = seed

    def after_instantiate_classes(self) -> None:
        """The resolved config, once (rank 0), once model, data module and trainer are built: a mistake
        their set-up finds (a data source that is not there, a tokenizer folder without a tokenizer) is
        the first thing a refused run prints, not the last after 50 lines of config."""
        super().after_instantiate_classes()
        rank_zero_info(self.config_summary())

    def config_summary(self) -> str:
        """The resolved config (files, command line and interpolations merged) as YAML, without the
        values that equal the defaults: what this run sets."""
        parser = self._parser(self.subcommand)
        section = self.config.get(self.subcommand) if self.subcommand else self.config
        config = yaml.safe_load(parser.dump(section, skip_validation=True, skip_none=False, skip_link_targets=False))
        defaults = yaml.safe_load(parser.dump(parser.get_defaults(), skip_validation=True, skip_none=False))
        entries = {a.dest: dataclass_defaults(a._typehint) for a in parser._actions if isinstance(a, ActionTypeHint)}
        compact = compact_config(config, defaults, {k: v for k, v in entries.items() if v})
        return f"resolved config (what differs from the defaults):\n{compact_yaml(compact)}"


class PreviewArgumentParser(HBPArgumentParser):
    """``lit-hbp preview``'s parser: it parses every section of the config as ``fit`` does, and its help
    lists what preview uses: its own options and the data module's (the trainer's, the model's and the
    optimizer's sections, read but unused, are left out: 470 lines before the data options otherwise)."""

    SHOWN = ("data", "help", "config", "print_config", "n", "json")

    def format_help(self) -> str:
        groups = self._action_groups
        self._action_groups = [
            g
            for g in groups
            if not g._group_actions or any(a.dest.split(".")[0] in self.SHOWN for a in g._group_actions)
        ]
        try:
            return super().format_help()
        finally:
            self._action_groups = groups


class PreviewCLI(HBPCLI):
    """``lit-hbp preview``: the config parsed as ``fit`` parses it (files, command line, interpolations),
    only the data module built, and its first samples printed (``lit_hbp.cli.preview``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", PreviewArgumentParser)
        super().__init__(*args, **kwargs)

    def after_instantiate_classes(self) -> None:
        """Nothing: the samples are what preview prints, not the config."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--n", type=int, default=3, help="how many samples to show")
        parser.add_argument(
            "--json", action="store_true",
            help='one JSON object per sample and line: {"source", "line", "input_ids", "supervised"}',
        )  # fmt: skip

    def before_instantiate_classes(self) -> None:
        if self.config.n < 1:
            report_user_error(ConfigError(f"--n must be >= 1, got {self.config.n}"))

    def instantiate_classes(self) -> None:
        data = LightningArgumentParser(exit_on_error=False)
        data.add_lightning_class_args(HBPDataModule, "data")
        self.datamodule = data.instantiate_classes(data.parse_object({"data": self.config.data.as_dict()})).data


PREVIEW_USAGE = "lit-hbp preview --config CONFIG [--data.KEY VALUE ...] [--n N] [--json]"
PREVIEW_HELP = (
    "The config's first training samples as they train: the chat template's rendering, each supervised "
    "token marked (lit_hbp.cli.preview). The config is read as fit reads it (files, command line, "
    "interpolations); only its data section is built. Its own options and the data module's (--data.*) "
    "follow; the trainer's and the model's sections are read but not used."
)


def preview_main(args: list[str]) -> PreviewCLI:
    """``lit-hbp preview --config CONFIG [--data.* ...] [--n N] [--json]``; its ``--help`` starts with its
    own usage and options (not LightningCLI's 70-line usage of every trainer option)."""
    from lit_hbp.cli.preview import preview

    parser_kwargs = {"parser_mode": "omegaconf+", "prog": "lit-hbp preview", "usage": PREVIEW_USAGE,
                     "description": PREVIEW_HELP}  # fmt: skip
    try:
        # The arguments come in ``args`` alone: LightningCLI warns when it also sees them in sys.argv.
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            cli = PreviewCLI(
                HBPLitModule, HBPDataModule, parser_kwargs=parser_kwargs, args=args, run=False,
                save_config_callback=None,
            )  # fmt: skip
        preview(cli.datamodule, cli.config.n, cli.config.json)
    except ValueError as e:
        if _debug() or user_error_in(e) is None:
            raise
        report_user_error(user_error_in(e))
    return cli


class _DropAdvert(logging.Filter):
    """Drops Lightning's "Tip: ... try installing litlogger" line, printed by every run without a
    LitLogger: an advertisement for a hosted service, nothing about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "try installing [litlogger]" not in str(record.msg)


def quiet_what_a_user_cannot_act_on() -> None:
    """Silence, precisely (message, category and the module it is attributed to), what a plain run printed
    that no user can act on: torch >= 2.13 deprecates the ``isinstance(treespec, LeafSpec)`` check that
    Lightning 2.6's own ``lightning.pytorch.utilities._pytree`` makes for every fit's data loaders (a
    FutureWarning about Lightning's code, not the user's), and Lightning's litlogger advertisement.
    Every other warning is left as it is."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvert) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdvert())


def main(args: list[str] | None = None, run: bool = True) -> HBPCLI:
    """Parse the command line (or ``args``), build trainer, model and data; fit unless ``run=False``.
    A mistake in the config or the data (``UserInputError``) ends it with a short error and exit status 2.
    ``preview`` shows the data's first samples as they train (``lit_hbp.cli.preview``)."""
    # Configs write ${data.x} whether or not a subcommand (fit.) prefixes the parsed tree.
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    quiet_what_a_user_cannot_act_on()
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["preview"]:
        return preview_main(argv[1:])
    try:
        with allow_listed():  # Lightning's resume loads with weights_only=True (check_resume): lit-hbp's allow-list
            cli = HBPCLI(
                HBPLitModule,
                HBPDataModule,
                parser_kwargs={"parser_mode": "omegaconf+"},
                # runs/ (git-ignored) holds what a run writes, with a logger or without: the resolved config,
                # checkpoints, logs; a run from the checkout's root leaves `git status` clean.
                trainer_defaults={
                    "use_distributed_sampler": False,
                    "reload_dataloaders_every_n_epochs": 1,
                    "default_root_dir": RUNS,
                },  # fmt: skip
                save_config_kwargs={"overwrite": True},
                args=args,
                run=run,
            )
    except ValueError as e:  # UserInputError is a ValueError
        if _debug() or user_error_in(e) is None:
            raise
        report_user_error(user_error_in(e))
    except pickle.UnpicklingError as e:  # a checkpoint Lightning found itself (--ckpt_path last, hpc, ...)
        if _debug():
            raise
        detail = next((line for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        report_user_error(
            UnsafeCheckpoint(
                f"refused to open the checkpoint: {detail.strip()}; only for a file you trust: "
                f"{TRUST_HINT['fit']} (docs/finetune.md)"
            )
        )
    except Exception as e:
        # said which rank is gone: its traceback adds nothing
        if getattr(e, LostRankReport.MARK, None) and not _debug():
            sys.stderr.write(f"tip: {DEBUG_ENV}=1 prints the traceback\n")
            sys.exit(1)
        raise
    except SIGTERMException:  # Lightning's: a SIGTERM before training started, when its own handler held it
        rank_zero_info("SIGTERM before the first optimizer step: stopped, nothing to save")
        sys.exit(TERMINATED)
    status = next((c.exit_status for c in cli.trainer.callbacks if isinstance(c, InterruptCheckpoint)), None)
    if status and not launched_by_rank_zero(cli.trainer):
        sys.exit(status)  # saved and stopped early: `fit ... && export ...` must not go on, a scheduler sees it
    return cli


def launched_by_rank_zero(trainer: Any) -> bool:
    """Whether this process is a rank Lightning's own launcher started from a node's rank 0 (``devices: N``
    without torchrun or SLURM). Its exit status is read by rank 0's watch over its children, which
    kills rank 0 at once on a non-zero one: such a rank ends with 0 after a signal's stop, and rank 0,
    the process the user or the scheduler started, reports the stop."""
    environment = trainer._accelerator_connector.cluster_environment  # the trainer has no public accessor
    return type(environment) is LightningEnvironment and trainer.local_rank > 0
