"""A run that finishes while the database is unreachable is still recorded, once, on its first
attempt: the final write retries with backoff for longer than the lease, and nothing requeues
the run meanwhile. The scheduler reaches the real Postgres through a TCP proxy on loopback
that the test cuts (every connection dropped, new ones refused) for 5 s around the run's end,
while a recovery pass on a direct connection runs every 0.2 s as another scheduler would."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import suppress

import pytest
from _scheduler_helpers import (
    Script,
    ThreadPool,
    add_sweep,
    rank_rows_per_run,
    run_row,
    tiny_config,
    wait_for,
)
from sqlalchemy.engine import make_url

from service.db.engine import make_engine, make_sessionmaker, scratch_schema
from service.db.migrate import upgrade
from service.db.models import RunStatus
from service.scheduler import Scheduler, recover_runs

BLIP_S = 5.0


class Proxy:
    """A TCP proxy on 127.0.0.1 to `target`; `cut()` drops every connection and refuses new
    ones until `mend()`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: list[socket.socket] = []
        self.down = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            if self.down.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.down.set()
        with self.lock:
            conns, self.open = self.open, []
        for s in conns:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def mend(self) -> None:
        self.down.clear()

    def close(self) -> None:
        self.cut()
        self.server.close()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    raw = os.environ.get("RINGLAB_TEST_POSTGRES_URL")
    if not raw:
        pytest.skip("RINGLAB_TEST_POSTGRES_URL is unset: this test needs the real Postgres")
    from service.core.config import normalize_database_url

    with scratch_schema(normalize_database_url(raw), "t_") as url:
        upgrade(url)
        yield url


def test_a_run_finishing_in_a_database_blip_is_recorded_once(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    direct = make_engine(postgres_url)
    sm = make_sessionmaker(direct)
    url = make_url(postgres_url)
    proxy = Proxy((url.host or "127.0.0.1", url.port or 5432))
    via_proxy = make_engine(url.set(host="127.0.0.1", port=proxy.port).render_as_string(False))
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=3.0))
    sched = Scheduler(
        make_sessionmaker(via_proxy), pool=pool, lease_s=8.0, heartbeat_s=1.0, poll_s=0.05
    )
    worker = threading.Thread(target=sched.run_once)
    requeued: list[int] = []
    done = threading.Event()

    def recover_meanwhile() -> None:  # another scheduler's recovery, on a working connection
        while not done.wait(0.2):
            requeued.extend(recover_runs(sm, "elsewhere:1:abcdef", heartbeat_s=1.0))

    recoverer = threading.Thread(target=recover_meanwhile)
    try:
        worker.start()
        recoverer.start()
        wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
        time.sleep(1.5)
        proxy.cut()  # the run ends 1.5 s into the blip
        time.sleep(BLIP_S)
        proxy.mend()
        worker.join(timeout=40)
    finally:
        done.set()
        proxy.close()
        recoverer.join()
        via_proxy.dispose()
    run = run_row(sm, run_id)
    assert (run.status, run.attempts, run.error) == (RunStatus.succeeded, 1, None)
    assert rank_rows_per_run(sm) == Counter({run_id: 1})
    assert requeued == [] and pool.kills == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("writing its end failed" in m for m in messages), messages
    direct.dispose()
