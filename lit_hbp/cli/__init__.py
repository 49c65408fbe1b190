"""The command line: ``lit-hbp`` (``command``: light, answers ``--help`` at once), its LightningCLI
(``app``: ``fit``, ``validate``, ``preview``), the config's checks before anything is built
(``checks``) and ``preview``. ``main`` (``lit_hbp.cli.main``) runs it from Python."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``main`` and what ``lit_hbp.cli`` held before it was a folder (0.1: the module ``app`` is now),
    imported on use: ``lit-hbp --help`` must not pay for Lightning's import."""
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    try:
        return getattr(importlib.import_module("lit_hbp.cli.app"), name)
    except AttributeError:
        raise AttributeError(f"module 'lit_hbp.cli' has no attribute {name!r}") from None
