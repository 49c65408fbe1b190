"""Cluster simulator: what an epoch of a plan costs on GPUs these machines do not have."""

from lit_hbp.simulate.simulator import Simulation, compare, compare_auto, fill_checkpointing, simulate

__all__ = ["Simulation", "compare", "compare_auto", "fill_checkpointing", "simulate"]
