"""Cluster simulator: what an epoch of a plan costs on GPUs these machines do not have."""

from lit_hbp.simulate.simulator import Simulation, compare, fill_checkpointing, simulate

__all__ = ["Simulation", "compare", "fill_checkpointing", "simulate"]
