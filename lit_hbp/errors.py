"""The errors a user causes with a config or a data file.

The CLI reports any of them as one short paragraph with exit status 2 (``LIT_HBP_DEBUG=1`` for the
traceback); anything else is a bug and keeps its traceback. Both are ``ValueError`` so library
callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A problem in what the user gave (config, data, checkpoint path); the message says what and where."""


class ConfigError(UserInputError):
    """A bad config value; the message names the config key."""


class DataError(UserInputError):
    """Bad training data; the message names the file and line (or row) of the problem."""
