"""Sequence parallelism: the SP topology shared by planner and strategy, process groups, Ulysses."""
