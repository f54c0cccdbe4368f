"""What a run compiled (torch.compile, outside its timed iterations) is stored per rank and shown
on the run page and in report.md's environment notes, as the rank measured it (issue 49)."""

from __future__ import annotations

from typing import Any

import pytest
import torch._dynamo
from _api_helpers import api_client, run_in_process

from attention import compiled

API = "/api/v1"
SPEC = {
    "name": "compiled and not",
    "base": {"kernel": "block_sparse", "device": "cpu", "dtype": "float32", "num_heads": 2,
             "head_dim": 16, "seq_len": 128, "iterations": 1, "warmup": 0,
             "correctness_check": False,
             "params": {"block_size": 16, "pattern": "local_window", "window": 1}},
    "grid": {"params.plan": ["cuda", "cpu"]},
}  # fmt: skip


def test_compile_figures_reach_the_api_the_run_page_and_the_report(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")
    torch._dynamo.reset()
    with api_client(f"sqlite:///{tmp_path / 'compile.db'}") as client:
        sweep_id = run_in_process(client, SPEC)
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        runs = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        shown: dict[str, str] = {}
        for row in runs:
            (rank,) = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
            page = client.get(f"/runs/{row['run_id']}").text
            count, seconds = rank["compilations"], rank["compile_s"]
            if rank["backend"].endswith("plan-cpu"):  # the cpu plan compiles nothing
                assert (count, seconds) == (0, 0.0)
                assert '<td class="compiling">none</td>' in page
                assert f"run {row['run_id']} (" not in report
                continue
            assert count == 1 and seconds > 0  # the warm-up at 128 tokens, forward
            text = f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
            assert f'<td class="compiling">1 graph in {text}</td>' in page
            shown[row["label"]] = f"run {row['run_id']} ({row['label']}, 128, forward): "
            shown[row["label"]] += f"1 graph in {seconds:.1f} s"
    torch._dynamo.reset()
    (line,) = [x for x in report.splitlines() if x.startswith("**Compilation**")]
    assert report.index("## Environment") < report.index(line)
    assert list(shown.values()) == [line.split("never in a timed iteration): ")[1]]
