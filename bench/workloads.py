"""Reference length workloads for the benchmarks.

The arrays come from the project's shared generator (``../shared/workloads/make_workloads.py``,
deterministic). They are written once into ``bench/workloads/`` (git-ignored) and reused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = HERE / "workloads"


def generator() -> Path:
    candidates = [Path(os.environ["HBP_WORKLOAD_GENERATOR"])] if "HBP_WORKLOAD_GENERATOR" in os.environ else []
    candidates += [p / "shared" / "workloads" / "make_workloads.py" for p in HERE.parents]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        "make_workloads.py not found: set HBP_WORKLOAD_GENERATOR to its path "
        "(it lives in the project's shared/workloads folder)"
    )


def load(name: str) -> np.ndarray:
    """Load ``name`` (e.g. "paper_mix"), generating all workloads the first time."""
    path = CACHE / f"{name}.npy"
    if not path.exists():
        subprocess.run([sys.executable, str(generator()), str(CACHE)], check=True, stdout=subprocess.DEVNULL)
    return np.load(path)
