"""LostRankReport: when a collective fails because a rank died, say which one.

A rank killed mid-step (the kernel's OOM killer, a lost node) leaves the others in a collective that
cannot complete. Gloo fails it at once ("Connection closed by peer"), NCCL when the process group's
timeout expires (``HBPStrategy(timeout=...)``, 10 minutes by default); neither says which rank is
gone. Under torchrun the agent names the failed worker and restarts the group (``--max-restarts``);
under Lightning's own launcher, rank 0 watches its child processes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

import lightning as L
import torch.distributed as dist


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # not Linux: os.kill said it exists


class LostRankReport(L.Callback):
    """At setup every rank learns each rank's host and process id; when fit fails with several
    processes, each surviving rank checks the ranks of its own host and prints which of them are gone
    (``lost``), and how many ranks run on other hosts (their launcher or their logs tell about those).
    The CLI adds this callback; in a plain Lightning project add it to ``Trainer(callbacks=...)``."""

    MARK = "hbp_lost_ranks"  # set on the exception when reported (the CLI then exits without a traceback)
    # A peer's sockets close while the kernel tears it down, before it is a zombie: a collective can fail
    # with these words while the killed rank still shows as running, so its end is awaited (a bounded poll).
    PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    GRACE_S = 10.0

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []  # rank -> (host, pid)
        self.lost: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            peers: list = [None] * dist.get_world_size()
            dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
            self.peers = [tuple(p) for p in peers]

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not self.peers or isinstance(exception, KeyboardInterrupt):
            return
        rank, host = trainer.global_rank, socket.gethostname()
        local = [(r, pid) for r, (h, pid) in enumerate(self.peers) if h == host and r != rank]
        deadline = time.monotonic() + (self.GRACE_S if any(w in str(exception) for w in self.PEER_GONE) else 0.0)
        while True:
            self.lost = [r for r, pid in local if not process_alive(pid)]
            if self.lost or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        elsewhere = sum(h != host for h, _ in self.peers)
        if not self.lost:
            return
        gone = ", ".join(f"rank {r} (pid {self.peers[r][1]})" for r in self.lost)
        note = f"; {elsewhere} rank(s) on other hosts were not checked" if elsewhere else ""
        sys.stderr.write(
            f"[rank {rank}] training failed: {gone} on {host} is gone (killed or crashed: its own log or the "
            f"kernel's says why){note}; this rank stops. Resume with --ckpt_path auto (the newest complete "
            "checkpoint) once the job is restarted\n"
        )
        sys.stderr.flush()
        with contextlib.suppress(AttributeError):  # an exception type with __slots__ keeps its traceback
            setattr(exception, self.MARK, list(self.lost))
