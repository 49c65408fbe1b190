"""Hierarchical Groups Auto-Selection: find the levels (pack length, sp, checkpointed layers)."""

from lit_hbp.autoselect.measured import MeasuredProfiler
from lit_hbp.autoselect.profiler import AnalyticProfiler, Measurement, Profiler
from lit_hbp.autoselect.search import (
    Candidate,
    Selection,
    auto_select,
    default_candidates,
    find_best_sp_ckpt,
    greedy_profile_ckpt,
    select_levels,
    sp_candidates,
)

__all__ = [
    "AnalyticProfiler",
    "Candidate",
    "MeasuredProfiler",
    "Measurement",
    "Profiler",
    "Selection",
    "auto_select",
    "default_candidates",
    "find_best_sp_ckpt",
    "greedy_profile_ckpt",
    "select_levels",
    "sp_candidates",
]
