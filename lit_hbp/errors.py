"""The errors a user causes with a config or a data file.

The CLI reports any of them as one short paragraph with exit status 2 (``LIT_HBP_DEBUG=1`` for the
traceback); anything else is a bug and keeps its traceback. Both are ``ValueError`` so library
callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserInputError(ValueError):
    """A problem in what the user gave (config, data, checkpoint path); the message says what and where."""


class ConfigError(UserInputError):
    """A bad config value; the message names the config key."""


class DataError(UserInputError):
    """Bad training data; the message names the file and line (or row) of the problem."""


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``word`` (difflib), or None when none is near: the "did you mean"."""
    found = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate, to append to an error; "" when none is near."""
    near = closest(word, (c for c in candidates if c != word))
    return f" (did you mean {near!r}?)" if near else ""
