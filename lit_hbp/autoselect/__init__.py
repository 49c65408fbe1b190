"""Hierarchical Groups Auto-Selection: find the levels (pack length, sp, checkpointed layers).

One search (``select_levels``; ``analytic_levels`` on the cost model) serves every tool: its largest
level holds the longest sample, or it refuses naming the levers that would make it fit (``NoLevelFits``,
each a ``Lever`` set-up accepts, in the words of the tool that printed it).

``AnalyticSelector`` and ``MeasuredSelector`` are the entry points (a data module's ``levels``, the
``python -m lit_hbp.autoselect`` tool); the algorithms and profilers below them are public for tests
and benchmarks."""

from lit_hbp.autoselect.levers import Lever, NoLevelFits
from lit_hbp.autoselect.measured import MeasuredProfiler
from lit_hbp.autoselect.memory_fit import greedy_profile_ckpt
from lit_hbp.autoselect.profiler import AnalyticProfiler, Candidate, Measurement, MemoryProfiler, Profiler
from lit_hbp.autoselect.search import (
    Selection,
    analytic_levels,
    auto_select,
    covering_length,
    default_candidates,
    find_best_sp_ckpt,
    select_levels,
    sp_candidates,
)
from lit_hbp.autoselect.selector import AnalyticSelector, MeasuredSelector, RunSetting, Selector

__all__ = [
    "AnalyticProfiler",
    "AnalyticSelector",
    "Candidate",
    "Lever",
    "MeasuredProfiler",
    "MeasuredSelector",
    "Measurement",
    "MemoryProfiler",
    "NoLevelFits",
    "Profiler",
    "RunSetting",
    "Selection",
    "Selector",
    "analytic_levels",
    "auto_select",
    "covering_length",
    "default_candidates",
    "find_best_sp_ckpt",
    "greedy_profile_ckpt",
    "select_levels",
    "sp_candidates",
]
