"""A compiled run's recompile bound: dynamo's per-code limit raised for the levels (each pack length and SP degree
compiles a layer once more), and said in lit-hbp's words when a code object reaches it and runs uncompiled."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.utilities import rank_zero_warn

RECOMPILE_LIMIT = 16  # compiled graphs per decoder-layer code: levels x SP degrees x train/eval, with room


def set_recompile_limit(limit: int) -> int:
    """Raise dynamo's per-code recompile limit to at least ``limit`` (a pack length per level, and the last pack
    of an epoch, each compile a layer once more); returns the limit it had, to put back when the run ends."""
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(before, limit)
    return before


class RecompileLimitWatch(logging.Filter):
    """Says, in lit-hbp's words, when dynamo stops compiling a code object of a compiled run: at its
    recompile limit (levels x SP degrees x train/eval exceeded it, or a measured search's probes used it
    up) that code runs uncompiled for the rest of the run, slower, where torch says so in a line a
    progress bar scrolls away. A filter on dynamo's logger: its record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) >= 3:
            limit, value, where = record.args[:3]
            rank_zero_warn(
                f"compile: dynamo hit its {limit} ({value}) at {where}, which runs uncompiled (slower) from now on; "
                f"raise torch._dynamo.config.{limit}, or train fewer distinct levels (TORCH_LOGS=recompiles says "
                "what each recompilation was for)"
            )
        return True


DYNAMO_LOG = "torch._dynamo.convert_frame"
