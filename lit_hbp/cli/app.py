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
import pickle
import sys
import warnings
from typing import Any
from unittest import mock

import yaml
from jsonargparse import Namespace, set_parsing_settings
from jsonargparse._typehints import ActionTypeHint  # jsonargparse exports no public name for it
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf.errors import OmegaConfBaseException

from lit_hbp.callbacks.defaults import with_default_callbacks
from lit_hbp.callbacks.interrupt import InterruptCheckpoint
from lit_hbp.callbacks.lost_rank import LostRankReport
from lit_hbp.callbacks.summary import HBPModelSummary
from lit_hbp.cli.checks import (
    check_logging_callbacks,
    check_refused_callbacks,
    check_run_config,
    check_trainer_values,
    check_yaml_texts,
)
from lit_hbp.cli.compact import compact_config, compact_yaml, dataclass_defaults
from lit_hbp.cli.parser import (
    DEBUG_ENV,
    HBPArgumentParser,
    debugging,
    replace_lists_from_command_line,
    report_user_error,
    user_error_in,
)
from lit_hbp.cli.program import program
from lit_hbp.cli.resume import (  # noqa: F401  (public here too: their first home)
    AUTO,
    CKPT_PATH_HELP,
    ResumeSaveConfig,
    check_resume,
    check_resumed_model,
    check_resumed_steps,
    check_training_state,
    checkpoint_data_seed,
    checkpoint_folders,
    resolve_auto_resume,
    resume_in_run_folder,
    saved_state,
)
from lit_hbp.errors import ConfigError, UserInputError
from lit_hbp.lightning.checkpoints import (
    TRUST_HINT,
    AtomicCheckpointIO,
    UnsafeCheckpoint,
    allow_listed,
)
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.lightning.resume_checks import EXECUTION
from lit_hbp.lightning.strategy import config_zero_stage  # (registers --trainer.strategy hbp, hbp_stage_N)
from lit_hbp.model.build import check_liger_before_data, check_lora_strategy, check_model_before_data

TERMINATED = 128 + 15  # a shell's status for a program ended by SIGTERM
RUNS = "runs"  # the run folder's root (default_root_dir), relative to the working directory
VALIDATE_WHAT = (
    "validate without --ckpt_path scores the model as model.model builds it, and a config mapping builds random "
    "weights: give --ckpt_path (a checkpoint of a fit), or model.model a checkpoint folder"
)


class HBPCLI(LightningCLI):
    """LightningCLI for HBPLitModule and HBPDataModule, with the short errors of HBPArgumentParser,
    command-line lists that replace the config's, and the config's checks before anything spawns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", HBPArgumentParser)
        # HBPLitModule configures its own AdamW and schedule (model.lr, betas, warmup_steps, ...): LightningCLI's
        # --optimizer / --lr_scheduler would be dropped (a scheduler without an optimizer) or fail on a model
        # configure_model has not built yet, so they are not offered; given, the parser names them.
        kwargs.setdefault("auto_configure_optimizers", False)
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
            if debugging() or not parser.exit_on_error:
                raise
            where = f" (in {e.full_key})" if getattr(e, "full_key", None) else ""
            sys.stderr.write(f"error: {str(e).splitlines()[0]}{where}\n")
            parser.exit(2)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's fit and validate: HBPLitModule has no test or predict loop (``command.NOT_OFFERED``)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's subcommand parser, its ``--ckpt_path`` help saying what this command line serves."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        for action in parser._actions:
            if action.dest == "ckpt_path":
                action.help = CKPT_PATH_HELP[subcommand]
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        replace_lists_from_command_line(parser)

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer with the config's callbacks plus lit-hbp's console and run hygiene, each unless
        the config has one of its kind (``lit_hbp.callbacks.with_default_callbacks``): the final step
        checkpointed, the step progress bar, the per-level epoch summary, no log folder left by a run
        that failed before its first step; checkpoint files written atomically (``AtomicCheckpointIO``)."""
        config = self._get(self.config_init, "trainer", default={})
        bar = config.get("enable_progress_bar")
        bar = not config.get("barebones") if bar is None else bar  # barebones: none (Lightning refuses one then)
        kwargs.setdefault("callbacks", with_default_callbacks(config.get("callbacks"), bar))
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
        if subcommand == "fit":
            self._guard(check_training_state, section)
        self._read_checkpoint_model(subcommand, section)

    def _read_checkpoint_model(self, subcommand: str, section: Any) -> None:
        """The model settings of the checkpoint ``--ckpt_path`` names (a file or a DeepSpeed folder; ``auto``'s once
        found), checked against the config's and read into it, as LightningCLI reads a file's, but for the
        ``EXECUTION`` settings, which stay the config's. (Lightning's keywords, ``last``, are found by the trainer:
        the module checks them when the checkpoint loads.)"""
        hparams = saved_state(section).get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        self._guard(check_resumed_model, section.get("model"), hparams, subcommand == "validate")
        for key in EXECUTION:  # the config's: how this run computes its steps
            hparams.pop(key, None)
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _guard(self, check, *args: Any) -> Any:
        """Run ``check``; a ``UserInputError`` is a short error and exit 2 (raised under the debug switch
        or a parser that does not exit)."""
        try:
            return check(*args)
        except UserInputError as e:
            if debugging() or not self.parser.exit_on_error:
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
            zero_stage = config_zero_stage((config.get("trainer") or {}).get("strategy"))
            model = config.get("model") or {}
            levels = (config.get("data") or {}).get("levels")
            freeze = bool(model.get("freeze_vision"))
            check_model_before_data(model.get("model"), levels, zero_stage=zero_stage, freeze=freeze)
            check_lora_strategy(model.get("lora"), zero_stage)
            if model.get("liger"):
                check_liger_before_data((config.get("trainer") or {}).get("accelerator"))
        except ValueError as e:
            if debugging() or not self.parser.exit_on_error:
                raise
            report_user_error(e)
        self._guard(check_trainer_values, section)
        if (
            self.subcommand == "validate"
            and not section.get("ckpt_path")
            and not isinstance(section.get("model.model"), str)
        ):  # a config mapping builds random weights: their loss says nothing of a run
            report_user_error(ConfigError(VALIDATE_WHAT))
        if self.subcommand == "fit":  # (Lightning's callbacks that need a logger ask for it in fit alone)
            self._guard(check_logging_callbacks, section.get("trainer"))
            self._guard(check_refused_callbacks, (section.get("trainer") or {}).get("callbacks"))
        auto = section.get("ckpt_path") == AUTO
        self._guard(resolve_auto_resume, section, self.subcommand == "validate")
        if auto and self.subcommand:  # the checkpoint found: its model settings, as an explicit --ckpt_path's
            self._read_checkpoint_model(self.subcommand, section)
            section = self.config[self.subcommand]
        if self.subcommand == "fit" and (complete := self._guard(check_resumed_steps, section, auto)):
            rank_zero_info(complete)
            sys.exit(0)
        resume_in_run_folder(section)
        seed = self._get(self.config, "seed_everything")
        section = self.config[self.subcommand] if self.subcommand else self.config
        if seed is not False:
            seed = seed_everything(None if seed is True else seed, workers=True, verbose=False)
            section["seed_everything"] = seed
        # The data order follows the run's seed (a seed sweep draws other orders, as a shuffled DataLoader would)
        # unless data.seed is given; a resume keeps its checkpoint's, so it re-creates the plan it stopped in.
        if isinstance(section.get("data"), Namespace) and section.get("data.seed") is None:
            saved = checkpoint_data_seed(section)
            section["data.seed"] = saved if saved is not None else (0 if seed is False else seed)

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
        # The model is not built: a config of only the data section (and the run's, without its model) previews.
        parser.set_defaults({"model.model": ""})
        parser.add_argument("--n", type=int, default=3, help="how many samples to show")
        parser.add_argument(
            "--json", action="store_true",
            help='one JSON object per sample and line: {"source", "line", "input_ids", "supervised"}',
        )  # fmt: skip

    def before_instantiate_classes(self) -> None:
        """``--n`` checked; ``data.seed`` as fit takes it (the run's ``seed_everything`` where the data names none),
        so the hold-out and the drawn subsets are fit's (seed 0 previewed a run of seed 7's validation records)."""
        if self.config.n < 1:
            report_user_error(ConfigError(f"--n must be >= 1, got {self.config.n}"))
        seed = self.config.get("seed_everything")
        if self.config.get("data.seed") is None and seed is not None:
            if seed is True:
                rank_zero_warn("seed_everything: true draws a new seed for each fit: previewed with data.seed 0")
            self.config["data.seed"] = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0

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

    parser_kwargs = {"parser_mode": "omegaconf+", "prog": f"{program()} preview", "usage": PREVIEW_USAGE,
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
        if debugging() or user_error_in(e) is None:
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


SUBCOMMANDS = ("fit", "validate", "preview")


def subcommand_at(argv: list[str]) -> int | None:
    """Where the subcommand stands in ``argv``: the first word past the options the top level takes before it
    (``--config FILE``, ``--print_config[=FLAGS]``, as LightningCLI's parser takes them), so ``--config FILE
    preview`` runs preview as ``preview --config FILE`` does and ``--print_config preview`` prints what ``preview
    --print_config`` prints; None where another option comes first (Lightning's parser then reads the line)."""
    i = 0
    while i < len(argv):
        if argv[i] in ("-c", "--config"):
            i += 2
        elif argv[i].startswith("--config=") or argv[i] == "--print_config" or argv[i].startswith("--print_config="):
            i += 1
        else:
            return None if argv[i].startswith("-") else i
    return None


def main(args: list[str] | None = None, run: bool = True) -> HBPCLI:
    """Parse the command line (or ``args``), build trainer, model and data; fit unless ``run=False``.
    A mistake in the config or the data (``UserInputError``) ends it with a short error and exit status 2.
    ``preview`` shows the data's first samples as they train (``lit_hbp.cli.preview``)."""
    # Configs write ${data.x} whether or not a subcommand (fit.) prefixes the parsed tree.
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    quiet_what_a_user_cannot_act_on()
    argv = sys.argv[1:] if args is None else list(args)
    try:
        check_yaml_texts(argv)
    except ConfigError as e:
        report_user_error(e)
    at = subcommand_at(argv)
    if at is not None and argv[at] == "preview":
        # --print_config before the subcommand prints the config all options give (Lightning's `--print_config fit`):
        # last on preview's line (a --print_config before --config printed the file alone there).
        printing = [a for a in argv[:at] if a == "--print_config" or a.startswith("--print_config=")]
        return preview_main([a for a in argv[:at] if a not in printing] + argv[at + 1 :] + printing)
    if at is not None and argv[at] not in SUBCOMMANDS:  # Lightning's parser would list fit and validate alone
        choices = ", ".join(map(repr, SUBCOMMANDS))
        sys.stderr.write(f"error: argument subcommand: invalid choice: {argv[at]!r} (choose from {choices})\n")
        sys.stderr.write(f"tip: `{program()} --help` lists the subcommands\n")
        sys.exit(2)
    try:
        with allow_listed():  # Lightning's resume loads with weights_only=True (check_resume): lit-hbp's allow-list
            cli = HBPCLI(
                HBPLitModule,
                HBPDataModule,
                parser_kwargs={"parser_mode": "omegaconf+", "prog": program()},
                # runs/ (git-ignored) holds what a run writes, with a logger or without: the resolved config,
                # checkpoints, logs; a run from the checkout's root leaves `git status` clean.
                trainer_defaults={
                    "use_distributed_sampler": False,
                    "reload_dataloaders_every_n_epochs": 1,
                    "default_root_dir": RUNS,
                },  # fmt: skip
                save_config_callback=ResumeSaveConfig,
                save_config_kwargs={"overwrite": True},
                args=args,
                run=run,
            )
    except ValueError as e:  # UserInputError is a ValueError
        if debugging() or user_error_in(e) is None:
            raise
        report_user_error(user_error_in(e))
    except pickle.UnpicklingError as e:  # a checkpoint Lightning found itself (--ckpt_path last, hpc, ...)
        if debugging():
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
        if getattr(e, LostRankReport.MARK, None) and not debugging():
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
