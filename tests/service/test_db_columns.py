"""One declaration of what a rank measures (workers/results.py): the tables' columns and the
API's output models follow it field for field, and a field added on one side only is caught."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import BaseModel, Field
from sqlalchemy import JSON, BigInteger, Boolean, Column, Float, Integer, MetaData, String, Table
from sqlalchemy import Text as SqlText

from service.api import schemas
from service.db import models
from service.db.columns import columns_of
from service.db.engine import make_engine
from service.db.migrate import upgrade
from service.results.stored import StoredRank
from workers import results
from workers.results import stored, stored_fields

SERVICE_COLUMNS = {
    "rank_result": {"id", "run_id"},
    "probe": {"id", "run_id"},
    "memory_component": {"id", "run_id", "rank"},
    "ring_step": {"id", "run_id", "rank"},
    "environment": {"id", "hash", "created_at"},
}
"""What the service keeps beside a declared result's fields (ids, the run, the node...)."""

DECLARED: dict[str, type[BaseModel]] = {
    "rank_result": StoredRank,  # workers.results.RankResult and the node it ran on
    "probe": results.ProbeResult,
    "memory_component": results.MemoryComponent,
    "ring_step": results.StepTime,
    "environment": results.EnvironmentInfo,
}

SQL_KINDS: dict[type, tuple[type, ...]] = {
    bool: (Boolean,),
    int: (Integer, BigInteger),
    float: (Float,),
    str: (String, SqlText),
    list: (JSON,),
    dict: (JSON,),
}


def mismatches(model: type[BaseModel], table: Table, service: set[str]) -> list[str]:
    """How `table` differs from `model`'s stored fields: a field without a column, a column
    without a field, a column whose type cannot hold the field's, or a field that admits None
    over a NOT NULL column. Empty when they agree field for field."""
    fields = stored_fields(model)
    columns = {c.name: c for c in table.columns if c.name not in service}
    out = [f"field {f} has no column" for f in fields if f not in columns]
    out += [f"column {c} has no field" for c in columns if c not in fields]
    for name in set(fields) & set(columns):
        annotation = model.model_fields[name].annotation
        kinds = [k for k in SQL_KINDS if _holds(annotation, k)]
        column = columns[name]
        if kinds and not isinstance(column.type, SQL_KINDS[kinds[0]]):
            out.append(f"{name}: column type {column.type} for {annotation}")
        if _holds(annotation, type(None)) and not column.nullable:
            out.append(f"{name}: admits None, column NOT NULL")
    return sorted(out)


def _holds(annotation: Any, kind: type) -> bool:
    """Whether `annotation` (X, X | None, list[...], ...) is or includes `kind`."""
    args = getattr(annotation, "__args__", None)
    origin = getattr(annotation, "__origin__", None)
    if origin is None and args:  # a union: X | None
        return any(_holds(a, kind) for a in args)
    base = origin or annotation
    if kind is int and base is bool:
        return False
    return isinstance(base, type) and issubclass(base, kind)


@pytest.mark.parametrize("table", sorted(DECLARED))
def test_each_table_holds_its_declaration_field_for_field(table: str) -> None:
    declared = DECLARED[table]
    assert mismatches(declared, models.Base.metadata.tables[table], SERVICE_COLUMNS[table]) == []


class _WiderEnvironment(results.EnvironmentInfo):
    gpu_clock_mhz: int | None = None


def test_a_field_declared_without_its_column_is_caught() -> None:
    """The environment table is written by hand: a field added to the model alone fails."""
    table = models.Base.metadata.tables["environment"]
    assert mismatches(_WiderEnvironment, table, SERVICE_COLUMNS["environment"]) == [
        "field gpu_clock_mhz has no column"
    ]
    wider = table.to_metadata(MetaData())
    wider.append_column(Column("gpu_clock_mhz", Integer, nullable=True))
    assert mismatches(results.EnvironmentInfo, wider, SERVICE_COLUMNS["environment"]) == [
        "column gpu_clock_mhz has no field"
    ]


class _WiderRank(results.RankResult):
    forward_tflops_s: float | None = Field(None, description="a field the tables lack")


def test_a_generated_table_gains_the_field_and_the_migrations_then_differ(
    database_url: str,
) -> None:
    """rank_result's columns are generated from the model: a field added to it is a column,
    and test_migrations' comparison of models and migrations fails until a migration adds it."""
    metadata = MetaData()
    Table("rank_result", metadata, *columns_of(_WiderRank))
    assert "forward_tflops_s" in metadata.tables["rank_result"].columns
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, models.Base.metadata)
            assert diff == []
            wider = MetaData()
            for table in models.Base.metadata.sorted_tables:
                copied = table.to_metadata(wider)
                if table.name == "rank_result":
                    copied.append_column(Column("forward_tflops_s", Float, nullable=True))
            added = compare_metadata(ctx, wider)
    finally:
        engine.dispose()
    assert [(d[0], d[2], d[3].name) for d in added] == [
        ("add_column", "rank_result", "forward_tflops_s")
    ]


@pytest.mark.parametrize(
    ("out", "declared", "extra"),
    [
        (schemas.RankResultOut, StoredRank, []),
        (schemas.ProbeOut, results.ProbeResult, []),
        (schemas.EnvironmentOut, results.EnvironmentInfo, ["id", "hash"]),
        (schemas.RingStepOut, results.StepTime, ["rank"]),
    ],
)
def test_the_api_returns_the_declared_fields(
    out: type[BaseModel], declared: type[BaseModel], extra: list[str]
) -> None:
    """Each output model is generated: the declared fields in order, their descriptions,
    then what the service adds."""
    assert list(out.model_fields) == [*stored_fields(declared), *extra]
    for name in stored_fields(declared):
        assert out.model_fields[name].description == declared.model_fields[name].description


def test_a_rank_reads_back_through_the_api_as_the_engine_measured_it() -> None:
    """The engine's RankResult, stored as a row, comes out of the API with the same values."""
    measured = results.RankResult(
        rank=1, seq_len=4096, times_s=[0.02, 0.021, 0.019], median_s=0.02, p10_s=0.0192,
        p90_s=0.0208, tokens_per_s=2.0e5, flops=3.0e9, flops_per_s=1.5e11,
        peak_memory_bytes=1 << 20, input_memory_bytes=1 << 19, backend="sdpa-math-cpu",
        forward_s=0.008, backward_s=0.012, link_probe_bytes=65536, link_probe_bytes_per_s=1e9,
        link_latency_s=2e-5, emulated_oom=True,
    )  # fmt: skip
    row = models.RankResultRow(run_id=7, node="10.0.0.2", **stored(measured))
    got = schemas.RankResultOut.model_validate(row).model_dump()
    assert got == {**measured.model_dump(include=set(stored_fields(results.RankResult))),
                   "node": "10.0.0.2"}  # fmt: skip
    assert list(got)[-1] == "node"
    assert "emulated_oom" not in got and "steps" not in got and "components" not in got
