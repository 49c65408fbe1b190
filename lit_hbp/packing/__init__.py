"""The HBP packing planner: numpy only, no torch.

from lit_hbp.packing import Level, plan_hbp, plan_single_level, pack, PACKERS
"""

from lit_hbp.packing.levels import Level, validate_levels
from lit_hbp.packing.packers import DEFAULT_PACKER, PACKERS, pack
from lit_hbp.packing.plan import MicroBatch, Plan, Step, plan_hbp, plan_single_level, plan_sorted_batching
from lit_hbp.packing.vision_load import VisionLoad

__all__ = [
    "DEFAULT_PACKER",
    "PACKERS",
    "Level",
    "MicroBatch",
    "Plan",
    "Step",
    "VisionLoad",
    "pack",
    "plan_hbp",
    "plan_single_level",
    "plan_sorted_batching",
    "validate_levels",
]
