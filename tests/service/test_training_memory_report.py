"""Seed 004's training-memory study from one stored sweep: the CPU twin of the 80 GB example is
submitted through the API, each run's measurement and memory components are stored as the
scheduler stores them (synthetic numbers with a known answer), and report.md, the dashboard
and components.csv must show the seed's tables with those numbers, recomputed here from the
raw values. Also: the study's refusals are 422s naming the field.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from _results_helpers import timing
from sqlalchemy.orm import Session
from test_report_tables import API, client_for, section

from service.cli.specs import load_specs
from service.db.models import Environment, MemoryComponentRow, Probe, RankResultRow, Run, RunStatus
from workers import model_memory
from workers.config import RunConfig

EXAMPLE = "cpu-training-memory-80gb.yaml"
MB = 10**6


def components_for(fixed: tuple[int, int, int], activations: int, peak: int) -> dict[str, int]:
    params, grads, optim = fixed
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_states": optim,
        "activations": activations,
        "forward_transient": peak // 10,
        "backward_peak": peak - params - optim,
        "step_peak": peak,
    }


def store(
    client: Any, run_id: int, *, answer: int, predicted_max: int, measured: dict[str, int]
) -> dict[str, Any]:
    """A finished model search: two probes around `answer`, one rank measured at the answer
    with its phases, and every component measured (predicted from the cell itself)."""
    sm = client.app.state.sessionmaker
    with sm() as session:
        session: Session
        run = session.get(Run, run_id)
        assert run is not None
        config = RunConfig.model_validate(run.config)
        predicted = model_memory.predict(config, answer).components()
        env = Environment(hash=f"e{run_id}", hosts=["vm"], gpus=[], torch="2.13", python="3.11")
        session.add(env)
        session.flush()
        run.status, run.environment_id = RunStatus.succeeded, env.id
        fwd, bwd, opt = 0.1, 0.25, 0.01
        step = fwd + bwd + opt
        session.add(
            RankResultRow(
                run_id=run_id,
                rank=0,
                seq_len=answer,
                **timing([step], answer, 1e9),
                peak_memory_bytes=measured["step_peak"],
                input_memory_bytes=24 * answer,
                memory_budget_bytes=134217728,
                backend="cpu_flash",
                forward_s=fwd,
                backward_s=bwd,
                optimizer_s=opt,
                predicted_max_seq_len=predicted_max,
            )
        )
        for name in model_memory.COMPONENTS:
            session.add(
                MemoryComponentRow(
                    run_id=run_id,
                    rank=0,
                    component=name,
                    predicted_bytes=predicted[name],
                    measured_bytes=measured.get(name),
                )
            )
        for length, outcome in ((answer, "fit"), (answer + 512, "oom")):
            session.add(
                Probe(
                    run_id=run_id,
                    seq_len=length,
                    outcome=outcome,
                    peak_memory_bytes=measured["step_peak"] if outcome == "fit" else None,
                    emulated=outcome == "oom",
                )
            )
        session.commit()
    return predicted


def test_seed_004_training_memory_tables_from_a_stored_sweep(database_url: str) -> None:
    """The seed's table: model | d x heads x layers | optimizer | precision | checkpointing |
    max tokens found | predicted | fixed | KB per token | gain vs the baseline cell; the
    per-component table with its ratios; the step-time table; the same numbers on the
    dashboard and in components.csv."""
    with client_for(database_url) as client:
        created = client.post(f"{API}/sweeps", json=load_specs(EXAMPLE)[0])
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
        runs = runs["data"]
        assert len(runs) == 12
        tiny2 = [r for r in runs if r["config"]["model"]["name"] == "tiny-2L"]
        baseline, blocks = tiny2[0], tiny2[1]  # zip order: (fp32, none), (fp32, blocks)
        assert baseline["config"]["training"]["checkpointing"] == "none"
        assert blocks["config"]["training"]["checkpointing"] == "blocks"
        fixed = (3_700_000, 3_700_000, 7_400_000)
        base_measured = components_for(fixed, 120 * MB, 250 * MB)
        ckpt_measured = components_for(fixed, 40 * MB, 240 * MB)
        store(client, baseline["id"], answer=3584, predicted_max=3800, measured=base_measured)
        predicted = store(
            client, blocks["id"], answer=7168, predicted_max=7400, measured=ckpt_measured
        )

        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        table = section(md, "## Training memory").splitlines()
        header = [c.strip() for c in table[1].strip("|").split("|")]
        assert " | ".join(header[:13]) == (
            "Model | d × heads × layers | Optimizer | Precision | Checkpointing | Tokens measured"
            " | Max tokens found | Max tokens predicted | Fixed | KB per token | Step peak"
            " | Step peak predicted | Max-length gain"
        )
        rows = {
            tuple(c.strip() for c in line.strip("|").split("|"))[4]: [
                c.strip() for c in line.strip("|").split("|")
            ]
            for line in table[3:]
            if line.startswith("| tiny-2L |")
        }
        fixed_total = sum(fixed)
        ckpt = rows["blocks"]
        assert ckpt[:5] == ["tiny-2L", "128d×4h×2L", "adamw", "fp32", "blocks"]
        assert ckpt[6:8] == ["7,168", "7,400"]
        assert ckpt[8] == f"{fixed_total / 2**20:.2f} MiB"
        assert ckpt[9] == f"{(240 * MB - fixed_total) / 7168 / 1e3:,.1f}"
        assert ckpt[12] == f"{7168 / 3584:.2f}x vs run {baseline['id']}"  # the baseline cell
        assert rows["none"][12] == "-"  # the baseline itself

        comps = section(md, "### Memory per component, predicted and measured").splitlines()
        act = next(x for x in comps if "checkpoint blocks" in x and "Activations" in x)
        cells = [c.strip() for c in act.strip("|").split("|")]
        assert cells[5] == "38.15 MiB"  # 40 MB measured
        assert cells[6] == f"{40 * MB / predicted['activations']:.3f}"

        steps = section(md, "### Step time by phase").splitlines()
        line = next(x for x in steps if "checkpoint blocks" in x)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2:6] == ["100.00 ms", "250.00 ms", "10.00 ms", "360.00 ms"]

        csv_rows = list(
            csv.DictReader(io.StringIO(client.get(f"{API}/sweeps/{sweep_id}/components.csv").text))
        )
        mine = {r["component"]: r for r in csv_rows if r["run_id"] == str(blocks["id"])}
        assert set(mine) == set(model_memory.COMPONENTS)
        assert mine["activations"]["measured_bytes"] == str(40 * MB)
        assert mine["activations"]["predicted_bytes"] == str(predicted["activations"])
        assert float(mine["activations"]["ratio"]) == 40 * MB / predicted["activations"]
        assert mine["allocator_overhead"]["measured_bytes"] == ""  # CPU: not measured

        result = next(
            r
            for r in client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
            if r["run_id"] == blocks["id"]
        )
        assert result["fixed_bytes"] == fixed_total
        assert result["bytes_per_token"] == (240 * MB - fixed_total) / 7168
        assert result["max_len_gain"] == 2.0 and result["predicted_max_seq_len"] == 7400

        page = client.get(f"/sweeps/{sweep_id}")
        assert page.status_code == 200
        assert 'id="training-memory"' in page.text
        assert "2.00x max length vs" in page.text
        payload = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()
        figures = payload["figures"]
        components = figures["chart-components"]
        names = [t["name"] for t in components["data"]]
        assert "activations (measured)" in names and "activations (predicted)" in names
        measured_act = next(t for t in components["data"] if t["name"] == "activations (measured)")
        labels = list(measured_act["y"])  # horizontal bars: one row per run
        at = next(i for i, label in enumerate(labels) if "checkpoint blocks" in label)
        assert abs(measured_act["x"][at] - 40 * MB / (1 << 30)) < 1e-9
        peak = figures["chart-model-peak"]
        assert peak["layout"]["xaxis"]["title"]["text"] == "sequence length (tokens)"
        lines = [t for t in peak["data"] if t["name"].endswith("predicted")]
        assert lines and all(t["line"]["dash"] == "dash" for t in lines)
        step = figures["chart-step-time"]
        assert [t["name"] for t in step["data"]] == ["forward", "backward", "optimizer"]

        run_page = client.get(f"/runs/{blocks['id']}").text
        assert 'id="components"' in run_page and "Activations saved for backward" in run_page
        # every figure results.json holds for the run, listed with its doc (export.figures)
        row = next(r for r in client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
                   if r["run_id"] == blocks["id"])  # fmt: skip
        shown = [n for n, v in row.items() if isinstance(v, float | int | str) and v != ""]
        assert shown and all(f"<th>{n}</th>" in run_page for n in shown)
        assert "(Step peak - fixed) / rank tokens." in run_page


def test_training_refusals_are_422s_naming_the_field(database_url: str) -> None:
    """adamw8bit on CPU, a model cell contradicting its model, a model on an attention cell:
    one 422 each naming the field, and nothing stored."""
    doc = load_specs(EXAMPLE)[0]
    cases = [
        (
            {**doc, "base": {**doc["base"]}, "zip": {"training.optimizer": ["adamw8bit"] * 4}},
            ["body", "zip", "training.optimizer", 0],
            "adamw8bit (bitsandbytes) runs on CUDA only",
        ),
        (
            {**doc, "base": {**doc["base"], "num_heads": 3}},
            ["body", "base", "num_heads"],
            "a model cell's num_heads is 4",
        ),
        (
            {
                "name": "x",
                "base": {
                    "kernel": "dense",
                    "seq_len": 64,
                    "model": {"d_model": 64, "n_layers": 1, "n_heads": 4},
                },
            },
            ["body", "base", "model"],
            "only a workload: model cell takes model",
        ),
        (
            {**doc, "grid": {"model": [{"name": "x", "n_layers": 2}]}},
            ["body", "grid", "model", 0, "d_model"],
            "Field required",
        ),
    ]
    with client_for(database_url) as client:
        for body, loc, message in cases:
            answer = client.post(f"{API}/sweeps", json=body)
            assert answer.status_code == 422, answer.text
            details = answer.json()["detail"]
            assert any(d["loc"] == loc and message in d["msg"] for d in details), details
        assert client.get(f"{API}/sweeps").json()["count"] == 0


def test_retry_drops_a_model_runs_components(database_url: str) -> None:
    """A retried model run (an emulated OOM keeps its measurement) starts without its old
    components: the new attempt writes its own (one row per run, rank and component)."""
    with client_for(database_url) as client:
        created = client.post(f"{API}/sweeps", json=load_specs(EXAMPLE)[0])
        sweep_id = created.json()["id"]
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
        run_id = runs["data"][0]["id"]
        store(
            client,
            run_id,
            answer=3584,
            predicted_max=3800,
            measured=components_for((1, 1, 2), 10 * MB, 20 * MB),
        )
        sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
        with sm() as session:
            run = session.get(Run, run_id)
            assert run is not None
            run.status = RunStatus.oom
            session.commit()
        answer = client.post(f"{API}/sweeps/{sweep_id}/retry", params={"include_oom": True})
        assert answer.status_code == 200, answer.text
        with sm() as session:
            left = session.query(MemoryComponentRow).filter_by(run_id=run_id).count()
            run = session.get(Run, run_id)
            assert run is not None
            assert (left, run.status) == (0, RunStatus.queued)
