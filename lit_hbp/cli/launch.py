"""The launch against the config, before anything is built: the processes a launcher started (torchrun,
SLURM's srun, MPI, any that sets ``WORLD_SIZE`` and ``LOCAL_RANK``) against ``trainer.devices x
trainer.num_nodes``, SLURM's layout against both, and several nodes asked of a process started alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_hbp.errors import ConfigError


def _device_count(devices: Any, accelerator: Any) -> int | None:
    """Devices per node as Lightning will count them, or None when only the started run knows."""
    kind = accelerator.lower() if isinstance(accelerator, str) else None
    if isinstance(devices, bool) or devices is None:
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices) or None
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return 1 if kind == "cpu" else _all_devices(kind)
        if "," in text:  # device indices
            return len([x for x in text.split(",") if x.strip()]) or None
        try:
            devices = int(text)
        except ValueError:
            return None
    if isinstance(devices, int):
        if devices > 0:
            return devices
        if devices == -1 and kind != "cpu":
            return _all_devices(kind)
    return None


def _all_devices(kind: str | None) -> int | None:
    if kind not in ("gpu", "cuda", "auto"):
        return None
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    n = num_cuda_devices()  # NVML where it can: does not initialize CUDA in this process
    if n > 0:
        return n
    return 1 if kind == "auto" else None


def world_size_of(trainer: Mapping[str, Any]) -> int | None:
    """trainer.devices x trainer.num_nodes from a trainer config section, or None when it cannot be
    known before the run starts (e.g. ``devices: auto`` on an accelerator this process cannot count)."""
    n = _device_count(trainer.get("devices", "auto"), trainer.get("accelerator", "auto"))
    nodes = trainer.get("num_nodes", 1)
    if n is None or isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return None
    return n * nodes


# What a multi-node launch leaves in a process's environment: Lightning's own NODE_RANK and MASTER_ADDR
# (Kubeflow's too), MPI's (Open MPI, PMI), LSF's jsrun.
LAUNCHER_MARKS = {"NODE_RANK", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "LSB_JOBID"}


def check_launcher(trainer: Mapping[str, Any]) -> None:
    """A launcher (torchrun, SLURM's srun, or any that sets ``WORLD_SIZE`` and ``LOCAL_RANK``: DeepSpeed's, an
    mpirun script) that started another count of processes than the config's ``trainer.devices x
    trainer.num_nodes``: Lightning checks the two only for several devices, so one device under two processes
    trained two separate copies of the run, each saying "world 1". Under SLURM the layout too: a count per node
    other than ``trainer.devices`` stopped on Lightning's traceback."""
    import os

    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.fabric.plugins.environments.slurm import _is_srun_used

    world = world_size_of(trainer)
    if world is None:
        return
    env = os.environ
    if TorchElasticEnvironment.detect():
        started, how = int(env["WORLD_SIZE"]), "torchrun started {} (--nnodes x --nproc_per_node)"
    elif _is_srun_used():
        started, how = int(env["SLURM_NTASKS"]), "SLURM started {} (--nodes x --ntasks-per-node)"
        check_slurm_layout(trainer, world)
    elif "LOCAL_RANK" in env and env.get("WORLD_SIZE", "").isdigit():  # Lightning takes such a run as launched
        started, how = int(env["WORLD_SIZE"]), "its launcher started {} (the WORLD_SIZE it set)"
    elif int(trainer.get("num_nodes", 1)) > 1 and not LAUNCHER_MARKS & set(env):
        raise ConfigError(  # Lightning would start this node's processes and wait for the others for half an hour
            f"trainer.num_nodes is {trainer.get('num_nodes')}, but this process was started alone (no torchrun, "
            "srun, or NODE_RANK and MASTER_ADDR a node's processes find each other by): launch one per node "
            "(docs/cluster.md)"
        )
    else:
        return
    if started != world:
        raise ConfigError(
            f"the config trains on {world} process{'es' if world > 1 else ''} (trainer.devices x trainer.num_nodes), "
            f"but {how.format(started)}: launch as many as it trains on, or set trainer.devices (docs/cluster.md)"
        )


def check_slurm_layout(trainer: Mapping[str, Any], world: int) -> None:
    """SLURM's processes per node (``--ntasks-per-node``, else its tasks over its nodes) against
    ``trainer.devices``, and its nodes against ``trainer.num_nodes`` (where SLURM says them)."""
    import os

    nodes = int(trainer.get("num_nodes", 1))
    devices = world // nodes
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    slurm_nodes = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES") or ""
    if per_node.isdigit() and int(per_node) != devices:
        raise ConfigError(
            f"trainer.devices is {devices} a node, but SLURM starts {per_node} (--ntasks-per-node): launch one "
            "task per device, or set trainer.devices (docs/cluster.md)"
        )
    if slurm_nodes.isdigit() and int(slurm_nodes) != nodes:
        raise ConfigError(
            f"trainer.num_nodes is {nodes}, but SLURM gave {slurm_nodes} nodes (--nodes): set trainer.num_nodes to "
            "it (docs/cluster.md)"
        )
