"""The CLI's argument parser: a mistake on the command line or in a config file is a few lines naming the bad key
and the nearest valid one (or the key another trainer's name stands for), not jsonargparse's 70-line report
(``JSONARGPARSE_DEBUG=true`` brings it back); a list given whole replaces the config's; a user's mistake found while
the classes are built (``lit_hbp.errors.UserInputError``) is one paragraph and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import yaml
from jsonargparse._actions import previous_config  # set while a config file is applied over earlier values
from jsonargparse._typehints import ActionTypeHint  # jsonargparse exports no public name for it
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_only

from lit_hbp.cli.compact import class_arguments
from lit_hbp.errors import ConfigError, UserInputError, did_you_mean

DEBUG_ENV = "LIT_HBP_DEBUG"  # the full traceback instead of the short error
PARSER_DEBUG_ENV = "JSONARGPARSE_DEBUG"  # jsonargparse's own switch: raise with its full report instead of exiting
CLASS_OPTION = re.compile(r"Problem with given class_path '([^']+)':\s*(?:- )?(?:Option|Key) '([^']+)' is not")
CLASS_REQUIRED = re.compile(
    r"Problem with given class_path '([^']+)':\s*(?:- )?the following arguments are required: (.+)"
)
PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
# lit-hbp's own refusal (it names its config key) among the errors of a Union's subtypes in jsonargparse's report
UNION_ERROR = re.compile(  # a config key's own words, or HBPStrategy's refusal of its settings (run_settings.CONFIG)
    r"Does not validate against any of the Union subtypes[\s\S]*?"
    r"^\s*- ((?:(?:trainer|data|model)\.|HBPStrategy )\S.*)$",
    re.M,
)
MISSING_PATH = re.compile(r"Expected a path but (.+?) either not accessible or invalid")
# An option another one sets (``link_arguments``), given on its own; what to set instead, per option.
LINKED = re.compile(r"argument (\S+) --> (\S+):")
LINKED_FIX = {
    "model.vocab_size": "the tokenizer's size; a vocabulary with more rows is model.model.vocab_size in a config "
    "mapping"
}
UNKNOWN_OPTION = re.compile(r"does not accept option '([^']+)'|Option '([^']+)' is not accepted|"
                            r"unrecognized arguments: -*([^\s=]+)")  # fmt: skip


def debugging() -> bool:
    """Whether a traceback (``LIT_HBP_DEBUG=1``) or jsonargparse's full report (``JSONARGPARSE_DEBUG=true``) was
    asked for instead of the short error."""
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
        said = UNION_ERROR.search(str(error))
        if said:  # a class of a Union-typed key (trainer.strategy): jsonargparse keeps each subtype's error as text
            return ConfigError(said.group(1))
        error = error.__cause__ or error.__context__
    return None


def report_user_error(error: Exception) -> NoReturn:
    """A user's mistake (``lit_hbp.errors.UserInputError``: config, data, paths) as one short paragraph
    on stderr and exit status 2, printed once (rank 0); the traceback is for bugs, or ``LIT_HBP_DEBUG=1``."""
    if rank_zero_only.rank == 0:
        sys.stderr.write(f"error: {own_message(error)}\ntip: {DEBUG_ENV}=1 prints the traceback\n")
    sys.exit(2)


def own_message(error: Exception) -> str:
    """The error's own message: a DataLoader worker's error reaches the main process with the worker's traceback
    as its message (torch's ``ExceptionWrapper``), whose last line is ``module.Class: message``."""
    text = str(error)
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    head = f"{type(error).__module__}.{type(error).__qualname__}: "
    last = next((line for line in reversed(text.splitlines()) if line.startswith(head)), None)
    return text if last is None else last[len(head) :]


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


OWN_OPTIMIZER = (
    ": HBPLitModule configures its own AdamW with a linear warm-up and a cosine schedule; set model.lr, "
    "model.betas, model.weight_decay, model.warmup_steps and model.min_lr_ratio"
)
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
    "attn_implementation": "attn_backend",  # lit-hbp sets the model's attention; its backend is the choice
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
    option with the nearest valid one (or the key it stands for, ``ALIASES``), an option another one sets
    (``LINKED``), a path that is not there, a config file's YAML error with the file; any other message as it is."""
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
    found = LINKED.search(message)
    if found:
        source, target = found.groups()
        return f"{target} is set from {source}, not on its own" + (
            f": {LINKED_FIX[target]}" if target in LINKED_FIX else ""
        )
    found = UNKNOWN_OPTION.search(message)
    if found:
        option = next(g for g in found.groups() if g)
        if option.split(".")[0] in ("optimizer", "lr_scheduler"):  # LightningCLI's, not offered (HBPCLI)
            return message.splitlines()[0] + OWN_OPTIMIZER
        return message.splitlines()[0] + alias_of(option, _option_keys(parser))
    found = MISSING_PATH.search(message)
    if found:  # a path option, or a list option given one path (data.sources), naming a file that is not there
        key = PARSER_KEY.search(message)
        return f"{key.group(1) + ': ' if key else ''}{found.group(1)} cannot be read (no such file or folder here)"
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
        if debugging() or not self.exit_on_error or callable(getattr(self, "_error_handler", None)):
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
            if self.dest.startswith("data."):  # a list of classes (trainer.callbacks) keeps Lightning's idiom:
                refuse_item_option(option, self.option_strings)  # --trainer.callbacks.patience sets the last added
            whole_list = isinstance(value, list) or (isinstance(value, str) and value.lstrip().startswith("["))
            if option in self.option_strings and whole_list:
                cfg[self.dest] = None
        return super().__call__(*args, **kwargs)

    def _check_type(self, value, append=False, cfg=None, mode=None):
        if cfg and not append and isinstance(value, list) and previous_config.get() is not None:
            cfg = cfg.clone()  # a config file given after another: its list does not see the earlier one
            cfg[self.dest] = None
        return super()._check_type(value, append=append, cfg=cfg, mode=mode)


def refuse_item_option(option: str, list_options: Iterable[str]) -> None:
    """``--data.levels.pack_len 512``: jsonargparse sets the field of the list's last item alone (a user meaning
    every level changes one; ``--data.sources.path`` swaps the last source, keeping its ``repeat``), and
    ``--data.levels.0.pack_len`` names no field. Refused, naming the whole-list form. (A list of classes,
    ``--trainer.callbacks+=EarlyStopping --trainer.callbacks.patience 3``, is Lightning's idiom for the one just
    added: left to it.)"""
    whole = next((o for o in list_options if option.startswith(o + ".")), None)
    if whole is not None:
        raise ConfigError(
            f"{option}: a field of one item of the list {whole} is not an option (it would set the last item's "
            f"alone); give the whole list, e.g. {whole} '[{{...}}, {{...}}]' (--print_config shows it), or edit it in "
            "the config file"
        )


def replace_lists_from_command_line(parser: argparse.ArgumentParser) -> None:
    """Make every list-typed option of ``parser`` replace, not merge, when given a whole list."""
    for action in parser._actions:
        if type(action) is ActionTypeHint and ActionTypeHint.supports_append(action):
            action.__class__ = _ListReplacingAction
