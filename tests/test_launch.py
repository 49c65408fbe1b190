"""The process group of processes lit-hbp starts itself (the measured level search's ``launch``; the tests'
pools): its port is held by the starting process from the moment it is picked, so nothing on the machine can
take it before the workers join."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from lit_hbp.autoselect.launch import host_store, join_group


def test_the_groups_port_is_held_from_its_pick_and_the_workers_join_through_it():
    store = host_store()
    for _ in range(3):  # another process binding the port meanwhile (what a port found free and closed allows)
        with socket.socket() as squatter, pytest.raises(OSError):
            squatter.bind(("127.0.0.1", store.port))
    join_group("gloo", 0, 1, store.port)
    try:
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        x = torch.tensor([3.0])
        dist.all_reduce(x)
        assert x.item() == 3.0
    finally:
        dist.destroy_process_group()
