"""The command line as the user typed it, for the tips lit-hbp prints to be run again in a shell.

Apart from ``cli.command`` (the light entry) and ``cli.app`` (the subcommands) so that neither imports the
other for it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def program() -> str:
    """The command line's start as the user typed it, for a tip to repeat: ``lit-hbp`` (the console script
    on the PATH), ``python train.py``, ``python -m lit_hbp.cli.command``; argparse's own ``prog`` is the
    file's name alone (``command.py``, ``train.py``), which runs nothing in a shell."""
    typed = list(getattr(sys, "orig_argv", sys.argv))
    start = typed[: max(1, len(typed) - len(sys.argv) + 1)]
    script = start[-1] if len(start) == 2 else ""  # ``python SCRIPT``: a console script runs so from its shebang
    name = os.path.basename(script)
    if script and not name.endswith(".py") and shutil.which(name) == os.path.abspath(script):
        return name
    return shlex.join(start)
