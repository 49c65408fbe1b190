"""Lightning callbacks of lit-hbp, importable as ``lit_hbp.callbacks``."""

from lit_hbp.callbacks.curriculum import HBPCurriculum
from lit_hbp.callbacks.export import HBPExport
from lit_hbp.callbacks.packing_metrics import PackingMetrics
from lit_hbp.callbacks.throughput import HBPThroughputMonitor

__all__ = ["HBPCurriculum", "HBPExport", "HBPThroughputMonitor", "PackingMetrics"]
