"""The runs a sweep stores are exactly those of the pinned digest below, on SQLite (Core
executemany) and on Postgres (COPY): the same cell keys, stored configs, columns, sweep
base_config and cell order, byte for byte, so a faster expansion or insert changes nothing
a reader sees.

The spec exercises grid and zip axes, a whole `params` axis, a `params.<name>` axis, ring and
ulysses with several world sizes, and more cells than one insert chunk."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from _api_helpers import api_client
from sqlalchemy import Engine, Text, cast, select

from service.api import store
from service.api.store import INSERT_CHUNK
from service.db.engine import make_sessionmaker
from service.db.models import Run, Sweep
from service.spec import SweepSpec, iter_cells

MIXED: dict[str, Any] = {
    "name": "mixed",
    "base": {"num_heads": 4, "head_dim": 16, "device": "cpu", "env": {"NCCL_DEBUG": "WARN"}},
    "grid": {
        "seq_len": [256 * (i + 1) for i in range(120)],
        "batch_size": [2, 4],
        "causal": [False, True],
        "iterations": ["auto", 3],
        "params.document_lengths": [None],
    },
    "zip": {
        "kernel": ["ring", "ulysses", "ring"],
        "world_size": [2, 2, 1],
        "params": [{"layout": "zigzag"}, {}, {}],
    },
}
"""120 x 2 x 2 x 2 x 3 = 2,880 cells, more than INSERT_CHUNK."""

INNER: dict[str, Any] = {
    "name": "inner",
    "base": {"kernel": "ulysses", "world_size": 2, "num_heads": 4, "head_dim": 16},
    "grid": {"seq_len": [1024, 2048], "params.inner": ["dense", "dilated", "block_sparse"]},
}
"""Ulysses with a `params.<name>` axis whose values change the resolved inner params."""

DIGEST = "1dfbdf5e48e530dbf1affaf11f74be8ffba5b890dfa0fd579a1a1e7f464b1d31"
"""sha256 of _stored() after MIXED then INNER, recorded before the insert path was made
faster (and again when dense's and ring's params gained `mask` and `balance`, stored null)."""


def _stored(engine: Engine) -> str:
    """Every stored run (in id order) and the sweeps' base_configs, their JSON columns as the
    text the database holds (stored verbatim: the bytes, not just the values, must agree)."""
    with make_sessionmaker(engine)() as session:
        bases = session.scalars(select(cast(Sweep.base_config, Text)).order_by(Sweep.id)).all()
        rows = session.execute(
            select(
                Run.cell_key, cast(Run.cell_config, Text), Run.kernel, Run.seq_len, Run.world_size,
                Run.dtype, Run.mode, Run.causal, Run.status, Run.attempts,
            ).order_by(Run.id)
        ).all()  # fmt: skip
    text = json.dumps([bases, [[*row[:8], str(row[8]), row[9]] for row in rows]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def test_stored_runs_are_the_pinned_ones(engine: Engine) -> None:
    for doc, cells in ((MIXED, 2_880), (INNER, 6)):
        spec = SweepSpec.model_validate(doc)
        with make_sessionmaker(engine)() as session:
            _, stored, created = store.create_sweep(session, spec, iter_cells(spec), None)
        assert created and stored == cells
    assert INSERT_CHUNK < 2_880  # several chunks, several COPY writes
    assert _stored(engine) == DIGEST


def test_a_document_invalid_mid_copy_leaves_the_next_ones_checked(database_url: str) -> None:
    """The first document fails after thousands of runs were sent; the second, under an
    Idempotency-Key (looked up in the same transaction), is still checked: one 422 with the
    first document's problem, nothing stored."""
    base = {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu"}
    lengths = [64 * (i + 1) for i in range(INSERT_CHUNK + 10)] + [-64]
    docs = [
        {"name": "long", "base": base, "grid": {"seq_len": lengths}},
        {"name": "short", "base": base, "grid": {"seq_len": [64, 128]}},
    ]
    with api_client(database_url) as client:
        r = client.post(
            "/api/v1/sweeps", json={"documents": docs}, headers={"Idempotency-Key": "mid-copy"}
        )
        assert r.status_code == 422, r.text[:500]
        locs = [e["loc"] for e in r.json()["detail"]]
        assert locs == [["body", "documents", 0, "grid", "seq_len", INSERT_CHUNK + 10]]
        assert client.get("/api/v1/sweeps").json()["count"] == 0
        assert client.get("/api/v1/runs").json()["count"] == 0
