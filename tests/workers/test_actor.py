"""The rank actor's rendezvous: rank 0 retries the store on a new port when one is taken."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from workers import actor
from workers.actor import RankActor, free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process holds (listening) on every interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.ray
def test_store_retries_on_eaddrinuse(
    ray_session, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    offered = [taken_port]
    monkeypatch.setattr(actor, "free_port", lambda: offered.pop(0) if offered else free_port())
    rank0 = RankActor()  # in this process: the same code a Ray actor runs
    port = rank0.open_store(world_size=2, timeout_s=10)
    assert not offered and port != taken_port
    host = ray_session.util.get_node_ip_address()
    peer = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=10))
    peer.set("hello", "ring")
    assert rank0._store.get("hello") == b"ring"
