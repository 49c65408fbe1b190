"""Lightning callbacks of lit-hbp, importable as ``lit_hbp.callbacks``."""

from lit_hbp.callbacks.checkpoint import FinalCheckpoint
from lit_hbp.callbacks.curriculum import HBPCurriculum
from lit_hbp.callbacks.defaults import with_default_callbacks
from lit_hbp.callbacks.export import HBPExport
from lit_hbp.callbacks.interrupt import InterruptCheckpoint, leave_signals_to_main
from lit_hbp.callbacks.lost_rank import LostRankReport
from lit_hbp.callbacks.packing_metrics import PackingMetrics
from lit_hbp.callbacks.progress import HBPProgressBar, LevelSummary
from lit_hbp.callbacks.rundir import DiscardEmptyRunDir
from lit_hbp.callbacks.throughput import HBPThroughputMonitor

__all__ = [
    "DiscardEmptyRunDir",
    "FinalCheckpoint",
    "HBPCurriculum",
    "HBPExport",
    "HBPProgressBar",
    "HBPThroughputMonitor",
    "InterruptCheckpoint",
    "LevelSummary",
    "LostRankReport",
    "PackingMetrics",
    "leave_signals_to_main",
    "with_default_callbacks",
]
