"""The measured ring link (workers.link): before its timed loop a sequence-parallel run pings one
K/V block to each rank's next ring neighbour and back. On real gloo ranks: the probe gives every
rank of W=2, 3 and 4 its figures (no deadlock) in well under a second; a 4-rank run stores
them, and so does a model trained on the ring; a data-parallel run has none. A W=2 ring run,
stored through the scheduler, reads within 2x of a plain torch.distributed send/recv test of
the same bytes run in the same processes; the F/B crossover the user reads in results.json and
report.md is recomputed here from the raw stored numbers; and the loopback label shows
wherever the figure does."""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _api_helpers import api_client
from _dist_helpers import run_ranks
from fastapi.testclient import TestClient

from service.artifacts import ArtifactStore
from service.results.report_format import fmt_num
from service.scheduler import Scheduler
from workers import harness, link, protocol
from workers.config import RunConfig
from workers.results import CaseOutcome, RunOutcome, outcome_of

API = "/api/v1"
LOOPBACK = "loopback (one host)"
RING = {
    "kernel": "ring",
    "num_heads": 4,
    "head_dim": 32,
    "mode": "forward",
    "device": "cpu",
    "warmup": 1,
    "iterations": 3,
}
"""A W=2 ring cell whose K/V block is 2 MiB per rank at 2,048 tokens (gloo's rate on loopback
is steadier from about 1 MiB)."""


def plain_send_recv_bytes_per_s(rank: int, nbytes: int, repeats: int = 20) -> float:
    """A plain bandwidth test of `nbytes` between ranks 0 and 1 with torch.distributed alone,
    Intel MPI Benchmarks' PingPong: rank 0 sends the block, rank 1 sends it back; nbytes / half
    the round trip, the best of `repeats` after two warm-ups (as STREAM keeps its best trial:
    on this busy machine a slower one holds time a rank waited for a CPU). Rank 1 returns 0.0
    (it timed nothing).

    Not a send answered by a 4-byte ack: under load here a tiny message waits about 2 ms for
    its receiver to be scheduled (the probe's latency shows it), which a 2 MiB message hides
    behind its own transfer, so send + ack read 0.4-0.5x the link."""
    block = torch.zeros(nbytes, dtype=torch.uint8)
    seconds = []
    dist.barrier()
    for _ in range(2 + repeats):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(block, 1)
            dist.recv(block, 1)
            seconds.append(time.perf_counter() - t0)
        else:
            dist.recv(block, 0)
            dist.send(block, 0)
    return nbytes / (min(seconds[2:]) / 2) if rank == 0 else 0.0


def ring_case_then_plain(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of a run (protocol.run_case) between two plain send/recv tests, in the same
    process group, of the bytes its link probe pings: the machine's drift across the run (a
    shared 2-core machine's load comes and goes) shows as the spread of the two."""
    cfg = RunConfig.model_validate(config)
    nbytes = harness.kv_block_bytes(cfg, cfg.local_batch * cfg.local_seq_len)
    before = plain_send_recv_bytes_per_s(rank, nbytes)
    case = protocol.run_case(cfg, rank)
    assert case.status == "ok" and case.result is not None, case.error
    assert case.result.link_probe_bytes == nbytes
    after = plain_send_recv_bytes_per_s(rank, nbytes)
    return {"case": case.model_dump(), "plain": [before, after]}


@dataclass
class DoneHandle:
    """A run that has already ended (the scheduler's RunHandle contract)."""

    outcome: RunOutcome
    kills: list[str] = field(default_factory=list)

    def poll(self, timeout_s: float) -> RunOutcome | None:
        return self.outcome

    def kill(self, reason: str) -> None:
        self.kills.append(reason)

    def placement(self) -> list[Any]:
        return []

    def probes(self) -> list[Any]:
        return []


@dataclass
class GlooPool:
    """The scheduler's pool contract over real gloo processes instead of Ray: a run's ranks
    run ring_case_then_plain; rank 0's plain send/recv rate is kept per run length."""

    plain: dict[int, float] = field(default_factory=dict)
    handles: list[DoneHandle] = field(default_factory=list)

    def start(
        self, config: RunConfig, kind: str, *, on_waiting: Callable[[], None] | None = None
    ) -> DoneHandle:
        assert kind == "benchmark", kind
        got = run_ranks(ring_case_then_plain, config.world_size, config.model_dump(mode="json"))
        cases = [CaseOutcome.model_validate(r["case"]) for r in got]
        self.plain[config.seq_len] = got[0]["plain"]
        self.handles.append(DoneHandle(outcome_of(cases, config.world_size)))
        return self.handles[-1]


@dataclass
class StoredSweep:
    client: TestClient
    sweep_id: int
    pool: GlooPool
    rows: list[dict[str, Any]]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoredSweep]:
    """A W=2 ring sweep at 4,096 tokens run on gloo and stored through the scheduler."""
    tmp = tmp_path_factory.mktemp("link")
    spec = {"name": "link", "base": {**RING, "world_size": 2}, "grid": {"seq_len": [4096]}}
    with api_client(f"sqlite:///{tmp / 'link.db'}", artifact_root=str(tmp / "a")) as client:
        created = client.post(f"{API}/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        pool = GlooPool()
        store = ArtifactStore(str(tmp / "a"), 1 << 20, 1 << 20)
        sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
        scheduler = Scheduler(sm, pool=pool, lease_s=60, heartbeat_s=5, artifacts=store)
        while scheduler.run_once():
            pass
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        assert [r["status"] for r in rows] == ["succeeded"], [r["error"] for r in rows]
        yield StoredSweep(client, sweep_id, pool, rows)


def test_the_stored_link_is_within_2x_of_plain_send_recv(stored: StoredSweep) -> None:
    """The issue's acceptance test: the stored figure against a plain send/recv test of the
    same bytes run in the same processes, right before and right after the run (within 2x of
    the two's range: once, a load burst at the run's start read the probe 9x below the plain
    test that came after)."""
    (row,) = stored.rows
    ranks = stored.client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
    k_and_v = 2 * 2048 * 4 * 32 * 4  # 2,048 tokens' k and v (4 heads x 32 x fp32) per rank
    assert [r["link_probe_bytes"] for r in ranks] == [k_and_v, k_and_v]
    stored_link = row["link_probe_bytes_per_s"]
    assert stored_link == min(r["link_probe_bytes_per_s"] for r in ranks)
    plain = stored.pool.plain[4096]  # right before and right after the run
    probes = [round(r["link_probe_bytes_per_s"] / 2**20) for r in ranks]
    windows = [round(r["transfer_window_bytes_per_s"] / 2**20) for r in ranks]
    shown = [round(p / 2**20) for p in plain]
    print(f"W=2 gloo loopback, {k_and_v:,} B: probe {stored_link / 2**20:,.0f} MiB/s (ranks "
          f"{probes}), plain send/recv {shown} MiB/s before/after; latency "
          f"{row['link_latency_s'] * 1e6:.0f} us; best transfer window in the loop {windows} "
          "MiB/s")  # fmt: skip
    assert min(plain) / 2 <= stored_link <= max(plain) * 2
    # the transfers' windows inside the ring loop are kept per rank, under their own name
    assert all(r["transfer_window_bytes_per_s"] > 0 for r in ranks)


def test_the_crossover_shown_is_recomputed_from_the_stored_numbers(stored: StoredSweep) -> None:
    """F/B from the raw fields: F the rate the steps computed at (FLOPs per iteration x
    iterations / step compute seconds, all ranks), B the slowest rank's probed link, scaled
    from the bytes and FLOPs of one iteration."""
    (row,) = stored.rows
    ranks = stored.client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
    iterations = len(ranks[0]["times_s"])
    flops = sum(r["flops"] for r in ranks)
    compute_rate = flops * iterations / sum(r["step_compute_s"] for r in ranks)
    link_rate = min(r["link_probe_bytes_per_s"] for r in ranks)
    per_iteration = sum(r["step_received_bytes"] for r in ranks) / iterations
    expected = 2048 * compute_rate * per_iteration / (link_rate * flops)
    assert row["crossover_tokens"] == pytest.approx(expected, rel=1e-9)
    assert row["crossover_basis"] == f"step compute rate, probed link: {LOOPBACK}"
    report = stored.client.get(f"{API}/sweeps/{stored.sweep_id}/report.md").text
    (line,) = [ln for ln in report.splitlines() if ln.startswith(f"| {row['label']} | 4,096 | 2")
               and LOOPBACK in ln]  # fmt: skip
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-2:] == [fmt_num(expected), row["crossover_basis"]]


def test_the_loopback_label_goes_with_the_figure(stored: StoredSweep) -> None:
    (row,) = stored.rows
    assert row["link_kind"] == LOOPBACK
    client, sweep_id = stored.client, stored.sweep_id
    headline = client.get(f"{API}/runs/{row['run_id']}").json()["headline"]
    assert headline["link_kind"] == LOOPBACK
    assert headline["link_probe_bytes_per_s"] == row["link_probe_bytes_per_s"]
    csv_text = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
    header, values = csv_text.splitlines()[:2]
    assert "link_probe_bytes_per_s" in header.split(",") and LOOPBACK in values
    report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
    assert "| Link bandwidth | Link latency | Link |" in report
    run_page = html.unescape(client.get(f"/runs/{row['run_id']}").text)
    assert f'<p id="link-summary">{LOOPBACK}:' in run_page
    sweep_page = html.unescape(client.get(f"/sweeps/{sweep_id}").text)
    assert f"tokens (step compute rate, probed link: {LOOPBACK})" in sweep_page  # the chart
    assert f'"link_kind": "{LOOPBACK}"' in sweep_page  # the table's row


def probed(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    case = protocol.run_case(RunConfig.model_validate(config), rank)
    assert case.status == "ok" and case.result is not None, case.error
    return case.result.model_dump(include={"link_probe_bytes", "link_probe_bytes_per_s",
                                           "link_latency_s", "seq_len"})  # fmt: skip


def test_every_rank_of_a_4_rank_ring_run_measures_its_link() -> None:
    world = 4
    config = {**RING, "num_heads": 2, "head_dim": 16, "seq_len": 768, "world_size": world}
    got = run_ranks(probed, world, config)
    block = 2 * (768 // world) * 2 * 16 * 4
    for r in got:
        assert r["link_probe_bytes"] == block
        assert r["link_probe_bytes_per_s"] > 0 and 0 < r["link_latency_s"] < 1


def model_probed(rank: int, world: int) -> dict[str, Any | None]:
    """One rank of a 2-layer model trained sequence-parallel on the ring."""
    model = {"d_model": 32, "n_layers": 2, "n_heads": 4, "num_kv_heads": 2, "vocab_size": 97}
    config = RunConfig.model_validate(
        {"workload": "model", "kernel": "ring", "seq_len": 64, "world_size": world,
         "device": "cpu", "warmup": 1, "iterations": 1, "model": model}
    )  # fmt: skip
    case = protocol.run_case(config, rank)
    assert case.status == "ok" and case.result is not None, case.error
    return case.result.model_dump(include={"link_probe_bytes", "link_probe_bytes_per_s"})


def test_a_model_trained_on_the_ring_probes_its_link_too() -> None:
    for r in run_ranks(model_probed, 2):
        # 32 tokens' k and v per rank: 2 kv heads x head size 8 x fp32
        assert r["link_probe_bytes"] == 2 * 32 * 2 * 8 * 4
        assert r["link_probe_bytes_per_s"] > 0


def no_link(rank: int, world: int) -> dict[str, Any]:
    config = RunConfig.model_validate(
        {
            **RING,
            "kernel": "dense",
            "parallel": "data",
            "batch_size": 2,
            "seq_len": 256,
            "world_size": world,
        }
    )
    case = protocol.run_case(config, rank)
    assert case.status == "ok" and case.result is not None, case.error
    return case.result.model_dump(include={"link_probe_bytes", "link_probe_bytes_per_s"})


def test_data_parallel_ranks_have_no_ring_to_probe() -> None:
    assert run_ranks(no_link, 2) == [{"link_probe_bytes": None, "link_probe_bytes_per_s": None}] * 2


def probe_only(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """This rank's link figures, and the seconds the probe took it."""
    started = time.perf_counter()
    figures = link.probe_ring_link(sizes[rank], torch.device("cpu"))
    return {**dataclasses.asdict(figures), "probe_s": time.perf_counter() - started}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_measures_the_link_to_its_next_rank(world: int) -> None:
    """Blocks of different sizes per rank (uneven shards): a pair pings its starter's."""
    sizes = [(256 << 10) + 4096 * r for r in range(world)]
    got = run_ranks(probe_only, world, sizes)
    for r, figures in enumerate(got):
        assert figures["peer"] == (r + 1) % world and figures["probe_bytes"] == sizes[r]
        assert figures["bytes_per_s"] > 0 and 0 < figures["latency_s"] < 1
        assert link.MIN_ROUND_TRIPS <= figures["round_trips"] <= link.MAX_ROUND_TRIPS
    # cheap: W pairs of about TIMED_BUDGET_S each (0.1-0.4 s here on 2 busy cores)
    print(f"W={world}: the probe took {max(f['probe_s'] for f in got):.2f} s")
    assert max(f["probe_s"] for f in got) < 2.0


def probe_out_of_memory(rank: int, world: int) -> dict[str, Any]:
    """A rank whose link probe cannot allocate its block (as on a full GPU)."""

    def no_memory(block_bytes: int, device: torch.device) -> link.LinkFigures:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {block_bytes} B")

    harness.probe_ring_link = no_memory  # type: ignore[assignment]
    config = {**RING, "num_heads": 2, "head_dim": 16, "seq_len": 512, "world_size": world}
    return protocol.run_case(RunConfig.model_validate(config), rank).model_dump()


def test_a_probe_out_of_memory_is_an_oom_case_that_says_where() -> None:
    for case in run_ranks(probe_out_of_memory, 2):
        assert case["status"] == "oom" and case["requested_bytes"] == 2 * 256 * 2 * 16 * 4
        assert case["error"].startswith("the link probe (one K/V block, before the inputs) ran")


def test_the_timed_round_trips_fit_the_budget_within_bounds() -> None:
    assert link.round_trips_for(link.TIMED_BUDGET_S / 7) == 7
    assert link.round_trips_for(10.0) == link.MIN_ROUND_TRIPS
    assert link.round_trips_for(1e-9) == link.MAX_ROUND_TRIPS


def test_the_link_kind_follows_the_hosts_and_devices_the_ranks_ran_on() -> None:
    from service.db.models import Environment
    from service.results.rows_build import link_kind

    def env(hosts: list[str], gpus: list[dict[str, Any]]) -> Environment:
        return Environment(hosts=hosts, gpus=gpus, torch="2.x", python="3.x", hash="h")

    h100 = {"name": "NVIDIA H100 80GB HBM3"}
    assert link_kind(env(["vm"], [])) == LOOPBACK
    assert link_kind(env(["gpu-box"], [h100, h100])) == "one host (GPU to GPU)"
    assert link_kind(env(["node-a", "node-b"], [h100, h100])) == "network (2 hosts)"
    assert link_kind(env(["node-a", "node-b"], [])) == "network (2 hosts)"
    assert link_kind(None) is None
