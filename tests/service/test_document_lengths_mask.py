"""`params.document_lengths` is stored as the documents mask it means: `causal` + document_lengths,
a run-level documents `mask` and `params.mask` store one config with one cell key and one label
(both spellings at once: test_run_mask's REFUSED); on the ring the stored mask runs the same
contiguous shards with the same blocks; and runs stored before (revision 0026) read the same."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from _api_helpers import api_client, run_in_process
from sqlalchemy import select
from sqlalchemy.orm import Session

import attention
from attention.ring.dense import RingParams, plan_for
from service.db.engine import make_engine
from service.db.migrate import downgrade, upgrade
from service.db.models import RUN_CONFIG_COLUMNS, Run, Sweep, SweepKind
from service.spec import SweepSpec, cell_key_of, expand

API = "/api/v1"
SHAPE = {"num_heads": 2, "head_dim": 16, "warmup": 1, "iterations": 2}
LENGTHS = [768, 256]
KERNELS = [
    {"kernel": "dense"},
    {"kernel": "ring", "world_size": 2, "params": {"layout": "contiguous"}},
    {"kernel": "ring", "world_size": 2, "params": {"balance": "per_document"}},
    {"kernel": "ulysses", "world_size": 2},
]


def docs(causal: bool, lengths: list[int] = LENGTHS) -> dict[str, Any]:
    return {"kind": "documents", "causal": causal, "lengths": lengths}


def spellings(base: dict[str, Any], causal: bool) -> list[dict[str, Any]]:
    """The one mask's three spellings on `base`: causal + params.document_lengths, a run-level
    mask, causal + params.mask."""
    params = base.get("params", {})
    return [
        {**base, "causal": causal, "params": {**params, "document_lengths": LENGTHS}},
        {**base, "mask": docs(causal), "params": params},
        {**base, "causal": causal, "params": {**params, "mask": docs(causal)}},
    ]


def _cells(base: dict[str, Any], grid: dict[str, Any] | None = None) -> list[Any]:
    body = {"name": "d", "base": {**SHAPE, **base}, "grid": grid or {"seq_len": [1024]}}
    return expand(SweepSpec.model_validate(body))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("base", KERNELS, ids=lambda b: f"{b['kernel']}-{b.get('params')}")
def test_the_three_spellings_store_one_config_and_cell_key(
    base: dict[str, Any], causal: bool
) -> None:
    stored = [[(c.cell_key, c.config_json) for c in _cells(s)] for s in spellings(base, causal)]
    assert stored[0] == stored[1] == stored[2]
    [(_, config)] = stored[0]
    assert config["causal"] is causal
    assert config["params"]["mask"] == docs(causal)
    assert config["params"]["document_lengths"] is None


def test_a_causal_axis_stores_each_cells_own_causal_in_its_mask() -> None:
    """A causal axis decides each cell's stored mask: every cell equals the cell built alone."""
    base = {"kernel": "ring", "world_size": 2, "params": {"document_lengths": LENGTHS}}
    grid = {"seq_len": [1024], "causal": [False, True], "batch_size": [1, 2, 3]}
    cells = _cells(base, grid)
    assert len(cells) == 6
    for cell in cells:
        assert cell.config_json["params"]["mask"] == docs(cell.axes["causal"])
        alone = _cells({**base, **cell.axes}, {"seq_len": [1024]})
        assert [(c.cell_key, c.config_json) for c in alone] == [(cell.cell_key, cell.config_json)]


def test_ring_stores_the_layout_it_ran_and_the_mask_runs_the_same_blocks() -> None:
    """document_lengths ran on contiguous shards with its packed-documents plan: the stored
    mask keeps those shards (layout contiguous, no balance) and gives every rank the same
    blocks at every step, and the same pairs where a document is shorter than a band."""
    base = {"kernel": "ring", "world_size": 4, "params": {"layout": "contiguous"}}
    for lengths in ([100, 412, 300, 212], [3, 5, 1016]):
        [cell] = _cells(
            {**base, "causal": True, "params": {**base["params"], "document_lengths": lengths}}
        )
        params = cell.config_json["params"]
        assert (params["layout"], params["balance"]) == ("contiguous", None)
        stored = attention.make_params("ring", params)
        before = RingParams(layout="contiguous", document_lengths=tuple(lengths))
        module = attention.build("ring", **params)
        for rank in range(4):
            new, old = (plan_for(p, "contiguous", True, rank, 4, 256) for p in (stored, before))
            assert [sum(b.pairs() for b in step) for step in new] == [
                sum(b.pairs() for b in step) for step in old
            ]
            if min(lengths) >= 8:  # a shorter document is one masked block, not two squares
                assert new == old
            assert module.local_positions(1024, rank, 4, causal=True).tolist() == list(
                range(rank * 256, (rank + 1) * 256)
            )


def test_a_causal_ring_without_layout_runs_as_the_run_level_mask_does() -> None:
    """Refused before (document_lengths ran on contiguous shards only): now the documents mask,
    on the ring's default shards for causal, as the run-level mask."""
    [a, b, _] = spellings({"kernel": "ring", "world_size": 2}, True)
    [got], [want] = _cells(a), _cells(b)
    assert (got.cell_key, got.config_json) == (want.cell_key, want.config_json)
    assert got.config_json["params"]["layout"] == "zigzag"


def _sweep(base: dict[str, Any], grid: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": "docs", "base": {**SHAPE, **base}, "grid": grid or {"seq_len": [1024]}}


def _runs(client: Any, sweep_id: int) -> list[dict[str, Any]]:
    runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id}).json()["data"]
    return sorted(runs, key=lambda r: r["cell_key"])


def test_both_spellings_store_match_and_show_as_one_through_the_api(database_url: str) -> None:
    lengths = [LENGTHS, [512, 512]]
    older = _sweep({"kernel": "dense", "causal": True}, {"seq_len": [1024]})
    older["zip"] = {"params.document_lengths": lengths}
    newer = _sweep({"kernel": "dense"}, {"seq_len": [1024]})
    newer["zip"] = {"mask": [docs(True, x) for x in lengths]}
    with api_client(database_url) as client:
        ids = [run_in_process(client, spec) for spec in (older, newer)]
        a, b = (_runs(client, i) for i in ids)
        assert [(r["cell_key"], r["config"]) for r in a] == [
            (r["cell_key"], r["config"]) for r in b
        ]
        labels = [
            sorted(row["label"] for row in client.get(f"{API}/sweeps/{i}/results.json").json())
            for i in ids
        ]
        history = client.get(f"{API}/cells/history", params={"run": a[0]["id"]}).json()
    assert (
        labels[0]
        == labels[1]
        == [
            "dense · mask=documents(causal, [512,512])",
            "dense · mask=documents(causal, [768,256])",
        ]
    )
    assert sorted(e["sweep_id"] for e in history["entries"]) == ids


def _to_older_form(url: str) -> None:
    """Each stored run and base_config as revision 0025 stored a document_lengths cell."""
    engine = sa.create_engine(url)
    sweep = sa.table("sweep", sa.column("id"), sa.column("base_config", sa.JSON))
    run = sa.table(
        "run",
        sa.column("id"),
        sa.column("sweep_id"),
        sa.column("cell_key"),
        sa.column("config", sa.JSON),
    )

    def older(config: dict[str, Any]) -> dict[str, Any]:
        mask = config["params"]["mask"]
        return {
            **config,
            "params": {**config["params"], "mask": None, "document_lengths": mask["lengths"]},
        }

    with engine.begin() as conn:
        bases = dict(conn.execute(sa.select(sweep.c.id, sweep.c.base_config)).all())
        for sweep_id, base in bases.items():
            new_base = older(base)
            conn.execute(sweep.update().where(sweep.c.id == sweep_id).values(base_config=new_base))
            for run_id, cell in conn.execute(
                sa.select(run.c.id, run.c.config).where(run.c.sweep_id == sweep_id)
            ).all():
                whole = older({**base, **cell})
                delta = {k: v for k, v in whole.items() if new_base[k] != v}
                values = {"config": delta, "cell_key": cell_key_of(whole)}
                conn.execute(run.update().where(run.c.id == run_id).values(**values))
    engine.dispose()


def test_runs_stored_before_read_as_the_mask_after_the_upgrade(database_url: str) -> None:
    spec = _sweep(
        {"kernel": "ring", "world_size": 2, "causal": True},
        {"seq_len": [1024], "params": [{"layout": "contiguous"}, {"balance": "per_document"}]},
    )
    spec["base"]["params"] = {"document_lengths": LENGTHS}
    with api_client(database_url) as client:
        assert client.post(f"{API}/sweeps", json=spec).status_code == 201
        want = [(r["cell_key"], r["config"]) for r in _runs(client, 1)]
    downgrade(database_url, "0025_comm_bytes")
    _to_older_form(database_url)
    with api_client(database_url) as client:  # upgrades to head
        got = [(r["cell_key"], r["config"]) for r in _runs(client, 1)]
        assert client.post(f"{API}/sweeps", json={**spec, "name": "again"}).status_code == 201
        again = [(r["cell_key"], r["config"]) for r in _runs(client, 2)]
    assert got == want == again
    assert [c["params"]["document_lengths"] for _, c in got] == [None, None]


def test_the_upgrade_keeps_a_cell_its_sweep_holds_and_other_kernels_lengths(
    database_url: str,
) -> None:
    """A sweep that stored one cell both ways keeps both runs as they were (a sweep holds a
    cell once); a kernel whose params take no mask keeps its document_lengths; a sweep stored
    before base_config (revision 0005) has its runs' whole configs rewritten."""
    upgrade(database_url, "0025_comm_bytes")
    [cell] = _cells(spellings({"kernel": "dense"}, True)[1])
    new = cell.config_json
    old = {**new, "params": {"mask": None, "document_lengths": LENGTHS}}
    outside = {
        **old,
        "kernel": "ring_flash_attn",
        "params": {"variant": "llama3", "document_lengths": LENGTHS},
    }
    stored = {1: [new, old, outside], 2: [old]}
    engine = make_engine(database_url)
    with Session(engine) as session, session.begin():
        for sweep_id, configs in stored.items():
            session.add(Sweep(id=sweep_id, name="s", kind=SweepKind.benchmark, spec={}))
            for config in configs:
                session.add(
                    Run(
                        sweep_id=sweep_id,
                        cell_key=cell_key_of(config),
                        config=config,
                        **{k: config[k] for k in RUN_CONFIG_COLUMNS},
                    )
                )
    upgrade(database_url)
    with Session(engine) as session:
        got = {
            s: [
                (r.cell_key, r.config)
                for r in session.scalars(select(Run).where(Run.sweep_id == s).order_by(Run.id))
            ]
            for s in stored
        }
    engine.dispose()
    assert got[1] == [(cell_key_of(c), c) for c in stored[1]]
    assert got[2] == [(cell.cell_key, new)]


def test_the_upgrade_tells_values_apart_as_the_cell_delta_does() -> None:
    """0026 keeps in a run's stored delta every value its sweep's base holds differently as
    JSON: the rule of service.db.models.same_json (1, 1.0 and true are three values), not ==,
    or a run would read back the base's value and miss its own cell key."""
    import importlib.util
    from pathlib import Path

    from service.db.models import same_json

    root = Path(__file__).resolve().parents[2]
    path = root / "migrations" / "versions" / "0026_document_lengths_mask.py"
    spec = importlib.util.spec_from_file_location("revision_0026", path)
    assert spec is not None and spec.loader is not None
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)
    values = [1, 1.0, True, 0, False, None, "1", [1], [1.0], {"a": 1}, {"a": 1.0}, {"a": [1, 2]}]
    for a in values:
        for b in values:
            assert revision._differ(a, b) is not same_json(a, b), (a, b)
    assert not revision._differ({"a": 1, "b": [2]}, {"b": [2], "a": 1})
