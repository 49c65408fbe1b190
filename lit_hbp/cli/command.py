"""``lit-hbp`` and ``python train.py``: the command line's entry, light enough to answer ``--help`` at once.

Lightning, transformers and DeepSpeed take seconds to import on a busy machine; every subcommand needs
them, the list of subcommands does not. ``lit-hbp SUBCOMMAND --help`` is the subcommand's own full help
(LightningCLI's, ``lit_hbp.cli.app``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from collections.abc import Iterator

# Lightning's other loops, which HBPLitModule has not: what to run instead.
NOT_OFFERED = {
    "test": "HBPLitModule has no test loop: `validate --ckpt_path CKPT` gives the loss on the config's validation data",
    "predict": "HBPLitModule has no predict loop: export the checkpoint (python -m lit_hbp.export) and generate",
}
SUBCOMMANDS = {
    "fit": "train on the config's data (and validate), save checkpoints; Ctrl-C saves and prints the resume line",
    "validate": "the validation loss of a checkpoint (--ckpt_path) on the config's validation data",
    "preview": "the config's first training samples as they train: tokens, supervised ones marked (--json)",
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in SUBCOMMANDS.items()]
    return "\n".join(
        [
            "usage: lit-hbp SUBCOMMAND --config CONFIG [--section.key VALUE ...]",
            "",
            "Hierarchical Balance Packing for long-context fine-tuning (docs/finetune.md).",
            "",
            "subcommands:",
            *lines,
            "",
            "lit-hbp SUBCOMMAND --help lists the subcommand's options.",
        ]
    )


def entry_point(argv: list[str] | None = None) -> None:
    """``lit-hbp [SUBCOMMAND] ...``: the short help without a subcommand (exit 0 when asked for, 2 when
    none was given), else the subcommand through ``lit_hbp.cli.app.main``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    if args[0] in NOT_OFFERED:
        print(f"error: no {args[0]!r} subcommand: {NOT_OFFERED[args[0]]}", file=sys.stderr)
        sys.exit(2)
    if argv is None:  # a process of its own (each rank's)
        with heap_left_alone():
            from lit_hbp.cli.app import main
    else:
        from lit_hbp.cli.app import main

    main(None if argv is None else args)


@contextlib.contextmanager
def heap_left_alone() -> Iterator[None]:
    """The imports inside without the cyclic garbage collector, and what they built frozen after: the
    collector then never walks those ~430,000 long-lived objects again, neither in the run nor at exit
    (``gc.freeze`` registered first, so it runs after every other exit handler). Python's collector
    walked them about seven times while Lightning, transformers and torch imported (0.9 s) and again at
    shutdown (1.1 s): about 2 s of every process's start and end (bench/RESULTS.md)."""
    atexit.register(gc.freeze)
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


if __name__ == "__main__":  # python -m lit_hbp.cli.command, as the console script
    entry_point()
