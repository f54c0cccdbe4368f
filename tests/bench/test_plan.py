"""`python -m bench.plan` as a user runs it (small sizes), its counter's honesty, and dilated's cuda
plan held to issue 37's targets where the counts do not depend on the length."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attention
from attention.segments import group_bounds
from bench import plan as bench_plan

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "kernel", "seq_len", "plan", "fwd_calls", "bwd_calls", "fwd_ops", "bwd_ops", "h2d_copies",
    "syncs", "transient_bytes", "floor_bytes",
}  # fmt: skip
LONGNET = bench_plan.LONGNET
GROUPS = sum(  # non-empty head groups over LongNet's branches at h=16: 1 + 2 + 4 + 6 + 8
    len(list(group_bounds(16, r))) for r in LONGNET["dilation_rates"]
)


def test_json_rows_per_kernel_length_and_plan() -> None:
    params = {
        "dilated": {"segment_lengths": [64, 128], "dilation_rates": [1, 2]},
        "block_sparse": {"block_size": 64, "pattern": "local_window", "sparsity_ratio": 0.5},
    }
    run = subprocess.run(
        [sys.executable, "-m", "bench.plan", "--seq", "512", "--heads", "2", "--dim", "16",
         "--params", json.dumps(params), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    assert lines[0]["setup"]["torch"] == torch.__version__
    assert lines[0]["setup"]["meta_stands_for"] == "cuda"
    rows = {(r["kernel"], r["plan"]): r for r in lines[1:]}
    assert set(rows) >= {("dense", "-"), ("dilated", "cpu"), ("dilated", "cuda")}
    for r in rows.values():
        assert set(r) >= KEYS and r["seq_len"] == 512
        assert r["floor_bytes"] == 4 * 512 * 2 * 16 * 2 + 512 * 2 * 4
    dense = rows["dense", "-"]
    assert (dense["fwd_calls"], dense["bwd_calls"]) == (1, 1)  # SDPA's flash op and its backward
    # segments of 64 over 512 tokens folded: one call per branch and group (1 + 2 groups)
    assert (rows["dilated", "cuda"]["fwd_calls"], rows["dilated", "cuda"]["bwd_calls"]) == (3, 3)
    assert rows["dilated", "cpu"]["backend"] == "cuda_flash/plan-cpu"


def test_the_table_names_what_the_meta_run_stands_for() -> None:
    out: list[str] = []
    bench_plan.main(
        ["--seq", "256", "--heads", "2", "--dim", "8", "--kernels", "dense"], out.append
    )
    out = "\n".join(out).splitlines()
    assert out[1] == (
        "meta stands for cuda (cuda_flash): exact counts of a call after one warm-up call, "
        "nothing run"
    )
    assert out[2].split()[:4] == ["kernel", "case", "seq", "plan"]
    assert out[3].split()[:5] == ["dense", "256", "-", "1", "1"]


def test_the_counter_sees_syncs_host_to_device_copies_and_live_bytes() -> None:
    count = bench_plan.Count()
    with bench_plan.Counter(count):
        torch.ones(3).sum().item()  # a sync
        torch.ones(4).to("meta")  # a host-to-device copy
        a = torch.empty(256, device="meta")  # 1 KiB, alive
        b = torch.empty(512, device="meta")  # 2 KiB, freed
        del b
        c = torch.empty(128, device="meta")
    assert (count.syncs, count.h2d, count.calls) == (1, 1, 0)
    assert count.peak == 1024 + 2048  # a and b together; the ones were freed at once
    assert count.live_bytes() == 1024 + 512
    del a, c


@pytest.mark.parametrize("seq", [4096, 8192, 16384])
def test_dilated_cuda_plan_meets_the_targets_and_stays_flat(seq) -> None:
    """LongNet's 5 branches at h=16, d=128, bf16: <= 2 fused calls per branch and group forward,
    <= 4 backward; no copy or sync; ops within 300 / 600 and the same at every length."""
    row = bench_plan.count_plan("dilated", LONGNET, "cuda", seq_len=seq)
    assert row["fwd_calls"] <= 2 * GROUPS and row["bwd_calls"] <= 4 * GROUPS
    assert row["h2d_copies"] == 0 and row["syncs"] == 0
    assert row["fwd_ops"] <= 300 and row["bwd_ops"] <= 600
    first = bench_plan.count_plan("dilated", LONGNET, "cuda", seq_len=4096)
    assert (row["fwd_ops"], row["bwd_ops"]) == (first["fwd_ops"], first["bwd_ops"])


def test_dilated_cuda_plan_transient_at_128k_is_within_a_quarter_of_the_floor() -> None:
    """Forward and backward: the backward sums its bf16 gradients in bf16 (fp32 accumulators
    held 0.53x the backward's floor)."""
    row = bench_plan.count_plan("dilated", LONGNET, "cuda", seq_len=131072)
    assert row["fwd_calls"] == GROUPS and row["bwd_calls"] == GROUPS
    assert row["transient_bytes"] <= 0.25 * row["floor_bytes"]
    assert row["bwd_transient_bytes"] <= 0.25 * row["bwd_floor_bytes"]
    assert row["floor_bytes"] == 131072 * 16 * (4 * 128 * 2 + 4)


def test_cuda_plan_forced_on_cpu_dispatches_the_same_ops_at_every_length() -> None:
    """On real CPU tensors (the CPU flash op), the forced cuda plan's op count does not grow with
    the length: 4K and 8K dispatch the same ops, forward and backward."""
    module = attention.build("dilated", plan="cuda", **LONGNET)
    counts = []
    for seq in (4096, 8192):
        q, k, v = (torch.randn(1, seq, 16, 8, requires_grad=True) for _ in range(3))
        fwd, bwd = bench_plan.Count(), bench_plan.Count()
        with bench_plan.Counter(fwd):
            out = module(q, k, v)
        with bench_plan.Counter(bwd):
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        counts.append((fwd.ops, bwd.ops, fwd.calls, bwd.calls, fwd.syncs + bwd.syncs))
    assert counts[0] == counts[1] and counts[0][2:] == (GROUPS, GROUPS, 0)
    assert counts[0][0] <= 300 and counts[0][1] <= 600


def test_the_table_has_a_row_per_block_sparse_pattern_printed_as_counted(monkeypatch) -> None:
    """Without --params block_sparse runs each pattern (density 0.25), a table row each, and
    each row is emitted as soon as it is counted, not after the last (a cpu plan at 128K takes
    minutes: a table held to the end looked like the setup line alone)."""
    counted: list[int] = []
    real = bench_plan.count_plan

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        counted.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_plan, "count_plan", counting)
    out: list[tuple[int, str]] = []  # (rows counted when emitted, line)
    argv = ["--seq", "4096", "--heads", "2", "--dim", "8", "--kernels", "block_sparse"]
    bench_plan.main([*argv, "--plans", "cuda"], lambda text: out.append((len(counted), text)))
    assert [n for n, _ in out] == [0, 0, 0, 1, 2, 3, 4]  # setup, note, header, then each row
    rows = [text.split() for _, text in out[3:]]
    assert [r[:5] for r in rows] == [
        ["block_sparse", pattern, "0.25", "4096", "cuda"]
        for pattern in ("local_window", "dilated", "global_local", "random")
    ]
    assert all(int(r[5]) > 0 and int(r[6]) > 0 for r in rows)  # fused calls each way


def test_dilated_cuda_plan_with_gqa_holds_no_kv_copies() -> None:
    """`--kv-heads` < `--heads`: the bf16 flash op takes grouped K/V as they are, so the
    forward's transient bytes are those without GQA (repeated K/V held 0.8x the floor at 4
    kv heads of 16) and the backward's no more; the floors count k, v and their gradients at
    their own heads."""
    rows = {}
    for kv in (16, 4):
        out: list[str] = []
        argv = ["--seq", "4096", "--kernels", "dilated", "--plans", "cuda", "--json"]
        bench_plan.main([*argv, "--kv-heads", str(kv)], out.append)
        assert json.loads(out[0])["setup"]["kv_heads"] == kv
        rows[kv] = json.loads(out[1])
    plain, grouped = rows[16], rows[4]
    assert grouped["transient_bytes"] == plain["transient_bytes"] > 0
    assert grouped["bwd_transient_bytes"] <= plain["bwd_transient_bytes"]
    q, kv_bytes, lse = 4096 * 16 * 128 * 2, 2 * 4096 * 4 * 128 * 2, 4096 * 16 * 4
    assert grouped["floor_bytes"] == 2 * q + kv_bytes + lse
    assert grouped["bwd_floor_bytes"] == 4 * q + 2 * kv_bytes + lse
    assert grouped["h2d_copies"] == grouped["syncs"] == 0
