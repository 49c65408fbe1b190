"""Hierarchical Groups Auto-Selection: find the levels (pack length, sp, checkpointed layers).

``AnalyticSelector`` and ``MeasuredSelector`` are the entry points (a data module's ``levels``, the
``python -m lit_hbp.autoselect`` tool); the algorithms and profilers below them are public for tests
and benchmarks."""

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
from lit_hbp.autoselect.selector import AnalyticSelector, MeasuredSelector, RunSetting, Selector

__all__ = [
    "AnalyticProfiler",
    "AnalyticSelector",
    "Candidate",
    "MeasuredProfiler",
    "MeasuredSelector",
    "Measurement",
    "Profiler",
    "RunSetting",
    "Selection",
    "Selector",
    "auto_select",
    "default_candidates",
    "find_best_sp_ckpt",
    "greedy_profile_ckpt",
    "select_levels",
    "sp_candidates",
]
