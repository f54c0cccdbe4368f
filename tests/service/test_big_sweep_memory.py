"""A big sweep's reads in bounded memory, measured with tracemalloc at two sizes of one sweep:
results.csv streamed a page at a time holds no more for three times the runs, and a whole-sweep
read (report.md, compare) holds its rows, not the ORM objects they are read from."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, update
from test_report_tables import client_for

from service.db.engine import make_engine, make_sessionmaker
from service.db.models import Environment, RankResultRow, Run, RunStatus, Sweep, utcnow
from service.results import queries

pytestmark = pytest.mark.timeout(300)
SMALL, LARGE = 200, 600
"""Two sweep sizes; a row held costs ~7 KB a run, one page of a stream nothing a run (under
1 KB: noise from the database driver and caches)."""


READS = 3
"""Traced reads of each sweep; per_run_peak takes the least peak of them."""


def finished_sweep(database_url: str, runs: int) -> int:
    """A dense sweep of `runs` cells, every run succeeded with one rank's result."""
    spec = {
        "name": f"big {runs}",
        "base": {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu"},
        "grid": {"seq_len": [128 * (i + 1) for i in range(runs // 2)], "batch_size": [1, 2]},
    }
    with client_for(database_url) as client:
        created = client.post("/api/v1/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep_id: int = created.json()["id"]
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as session:
        env = Environment(hash=f"{runs:064d}", hosts=["node"], gpus=[], torch="2", python="3.11")
        session.add(env)
        session.flush()
        now = utcnow()
        done = {"status": RunStatus.succeeded, "environment_id": env.id, "finished_at": now}
        session.execute(update(Run).where(Run.sweep_id == sweep_id).values(started_at=now, **done))
        ids = session.execute(select(Run.id, Run.seq_len).where(Run.sweep_id == sweep_id)).all()
        results = [
            {"run_id": run_id, "rank": 0, "seq_len": seq_len, "times_s": [9e-4, 1e-3, 1.1e-3],
             "median_s": 1e-3, "p10_s": 9e-4, "p90_s": 1.1e-3, "tokens_per_s": seq_len / 1e-3,
             "flops": 1e9, "flops_per_s": 1e12, "peak_memory_bytes": seq_len * 1024,
             "backend": "torch"}
            for run_id, seq_len in ids
        ]  # fmt: skip
        session.execute(insert(RankResultRow), results)
        session.commit()
    engine.dispose()
    return sweep_id


def traced_peak(read: Callable[[], Any]) -> int:
    """The most bytes Python held while `read` ran, above what it held before."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        kept = read()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del kept
    return peak


def per_run_peak(
    database_url: str, read: Callable[[Engine, int, int], Any], *, warm_large: bool
) -> tuple[float, list[int], Any]:
    """The bytes a run adds to the peak of read(engine, sweep_id, runs), from a sweep of SMALL
    runs to one of LARGE, and the two peaks (each the least of READS reads). Reads of the
    small sweep first (and of the large one when `warm_large`: its result is returned, else
    None) warm imports, caches and the sweeps' contexts; the contexts are dropped after."""
    small, large = finished_sweep(database_url, SMALL), finished_sweep(database_url, LARGE)
    engine = make_engine(database_url)
    try:
        read(engine, small, SMALL)
        warmed = read(engine, large, LARGE) if warm_large else None
        # the least of READS reads: tracemalloc counts every thread's allocations (a test
        # process's Ray driver, a server thread) and the collector's timing, which only add
        peaks = [
            min(traced_peak(partial(read, engine, small, SMALL)) for _ in range(READS)),
            min(traced_peak(partial(read, engine, large, LARGE)) for _ in range(READS)),
        ]
    finally:
        engine.dispose()
        queries._contexts.clear()
    return (peaks[1] - peaks[0]) / (LARGE - SMALL), peaks, warmed


def test_results_csv_holds_a_page_whatever_the_sweep(database_url: str, monkeypatch: Any) -> None:
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "EXPORT_PAGE", 50)

    def read(engine: Engine, sweep_id: int, runs: int) -> int:
        """As the response sends it: chunk by chunk, none kept; a header, then a line a run."""
        chunks = sweep_results.results_csv_chunks(make_sessionmaker(engine), sweep_id)
        lines = size = 0
        for chunk in chunks:
            lines, size = lines + chunk.count("\n"), size + len(chunk)
        assert lines == runs + 1
        return size

    # the sweeps' contexts, found once and kept
    per_run, peaks, _ = per_run_peak(database_url, read, warm_large=True)
    assert per_run < 1_000, f"results.csv holds {per_run:.0f} B more per run ({peaks})"


def test_a_whole_sweep_read_holds_rows_not_orm_objects(database_url: str, monkeypatch: Any) -> None:
    """sweep_rows (report.md, compare) keeps every row; the ORM objects it reads them from
    (runs, rank results) live a chunk at a time, so a run costs its row alone."""
    monkeypatch.setattr(queries, "ROWS_CHUNK", 50)

    def read(engine: Engine, sweep_id: int, runs: int) -> Any:
        with make_sessionmaker(engine)() as session:
            sweep = session.get(Sweep, sweep_id)
            assert sweep is not None
            rows = queries.sweep_rows(session, sweep)
            assert len(rows) == runs and all(r.median_s == 1e-3 for r in rows)
            return rows

    per_run, peaks, _ = per_run_peak(database_url, read, warm_large=False)
    assert per_run < 10_000, f"a whole-sweep read holds {per_run:.0f} B per run ({peaks})"


def test_a_comparison_holds_its_sides_not_its_rows(database_url: str, monkeypatch: Any) -> None:
    """GET /compare's answer, read and sent as the route does: each run held as its packed
    side (compare.Sides: 130 bytes in two buffers; here both sides of a sweep compared with
    itself), rows built READ_PAGE at a time, the pairs made one at a time as the JSON streams,
    so a run costs its two records and the transient index that matches them, ~0.6 KB (as
    two Side objects it cost ~1.3 KB, as two rows before them ~15 KB)."""
    from service.api.routes import sweeps
    from service.api.routes.sweeps import compare_json_chunks
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "READ_PAGE", 50)
    monkeypatch.setattr(sweeps, "COMPARE_CHUNK_PAIRS", 50)

    def read(engine: Engine, sweep_id: int, runs: int) -> int:
        """As the response sends it: chunk by chunk, none kept."""
        with make_sessionmaker(engine)() as session:
            found = sweep_results.sweep_comparison(session, sweep_id, sweep_id)
        assert found.head["only_a"] == found.head["only_b"] == 0
        assert len(found.a) == len(found.b) == runs
        return sum(len(chunk) for chunk in compare_json_chunks(found))

    per_run, peaks, _ = per_run_peak(database_url, read, warm_large=True)
    assert per_run < 800, f"a comparison holds {per_run:.0f} B per run ({peaks})"


def _blocks() -> int:
    """Memory blocks Python holds now (tracemalloc running)."""
    return sum(stat.count for stat in tracemalloc.take_snapshot().statistics("filename"))


def traced_blocks(read: Callable[[], Any]) -> int:
    """The memory blocks what `read` returns holds once it has returned, above those held
    before: the objects a read keeps until its answer is sent."""
    gc.collect()
    tracemalloc.start()
    try:
        before = _blocks()
        kept = read()
        gc.collect()
        held = _blocks() - before
    finally:
        tracemalloc.stop()
    del kept
    return held


def test_a_comparison_keeps_no_object_a_run(database_url: str, monkeypatch: Any) -> None:
    """Between its read and its answer a comparison holds its sides as a few buffers, not as
    objects a run (as two Side objects it held ~23): a run's objects filled the allocator's
    arenas, which the few objects that outlive the read then pinned (a 100,000-run sweep
    compared with itself stayed at +78 MiB of its +113 MiB peak after its answer)."""
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "READ_PAGE", 50)
    small, large = finished_sweep(database_url, SMALL), finished_sweep(database_url, LARGE)
    engine = make_engine(database_url)

    def compared(sweep_id: int) -> Callable[[], Any]:
        def read() -> Any:
            with make_sessionmaker(engine)() as session:
                return sweep_results.sweep_comparison(session, sweep_id, sweep_id)

        return read

    try:
        compared(small)()  # imports, caches and the sweeps' contexts warmed
        compared(large)()
        held = [traced_blocks(compared(small)), traced_blocks(compared(large))]
    finally:
        engine.dispose()
        queries._contexts.clear()
    per_run = (held[1] - held[0]) / (LARGE - SMALL)  # the database driver's caches: ~0.06
    assert per_run < 0.5, f"a comparison holds {per_run:.2f} objects per run ({held})"


def test_compare_read_a_page_at_a_time_is_the_comparison_of_its_rows_read_at_once(
    database_url: str, monkeypatch: Any
) -> None:
    """GET /compare as the API sends it (each sweep read a page at a time into its packed
    sides, the pairs streamed) is the comparison of the sweeps' rows read at once
    (queries.sweep_rows, compare.compare_out) as one CompareOut, byte for byte: a slower
    cell, flagged and noisy runs, a sweep against another and against itself."""
    from test_noise_report import LOW_PEAK, store_dp_sweep

    from service.api.routes.sweeps import _json
    from service.api.schemas import CompareOut
    from service.results import service as sweep_results
    from service.results.compare import compare_out, same_spec

    monkeypatch.setattr(sweep_results, "READ_PAGE", 7)
    with client_for(database_url) as client:
        a = store_dp_sweep(client, seed=3)
        b = store_dp_sweep(client, seed=4, slower=LOW_PEAK)
        served = {(x, y): client.get(f"/api/v1/sweeps/{x}/compare/{y}") for x, y in
                  [(a, b), (b, a), (a, a)]}  # fmt: skip
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            read = {}
            for i in (a, b):
                sweep = session.get(Sweep, i)
                assert sweep is not None
                read[i] = (sweep.spec, queries.sweep_rows(session, sweep))
            at_once = {
                (x, y): compare_out(x, y, read[x][1], read[y][1], same_spec(read[x][0], read[y][0]))
                for x, y in served
            }
    finally:
        engine.dispose()
        queries._contexts.clear()
    assert at_once[a, b]["regressions"] >= 1 and len(at_once[a, b]["pairs"]) > 2 * 7
    for key, answer in served.items():
        assert answer.status_code == 200, answer.text
        assert answer.text == _json(CompareOut.model_validate(at_once[key]).model_dump(mode="json"))


def test_report_md_holds_a_few_hundred_bytes_a_run(database_url: str, monkeypatch: Any) -> None:
    """report.md reads the sweep twice a page at a time (report.write_report): its first pass
    keeps what the report states of all runs (their order, each as the pivot reads it, the
    time unit's medians), its second writes the tables a line at a time; it keeps no run's
    row, so a run costs its pivot row, its order and its lines of the answer, ~0.5 KB (it
    held every row: ~3.8 KB a run, ~11 KB before that)."""
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "READ_PAGE", 50)

    def read(engine: Engine, sweep_id: int, runs: int) -> str:
        with make_sessionmaker(engine)() as session:
            text = sweep_results.sweep_report(session, sweep_id)
        assert f"· {runs} runs: {runs} succeeded" in text
        return text

    per_run, peaks, text = per_run_peak(database_url, read, warm_large=True)
    lines = [line for line in text.splitlines() if line.startswith("| dense · batch_size=2 | ")]
    assert len(lines) == LARGE // 2  # every run in the results table, read in its second pass
    assert per_run < 1_000, f"report.md holds {per_run:.0f} B per run ({peaks})"


@pytest.mark.parametrize("pivot", [None, {"rows": "seq_len", "columns": ["parallel"],
                                           "value": "speedup"}])  # fmt: skip
def test_report_md_read_twice_is_the_report_of_its_rows_read_at_once(
    database_url: str, monkeypatch: Any, pivot: dict[str, Any] | None
) -> None:
    """report.md as the API writes it (two reads a page at a time, the pivot over PivotRows) is
    the report of the sweep's rows read at once (queries.sweep_rows: their baselines, ratios
    and labels found over the whole sweep), character for character: baselines in other pages,
    flagged results and their footnotes, the default pivot and one of speedups."""
    from test_noise_report import store_dp_sweep

    from service.results import baselines
    from service.results import service as sweep_results
    from service.results.report import report_markdown

    monkeypatch.setattr(sweep_results, "READ_PAGE", 7)
    with client_for(database_url) as client:
        sweep_id = store_dp_sweep(
            client, seed=3, analysis=None if pivot is None else {"pivot": pivot}
        )
        served = client.get(f"/api/v1/sweeps/{sweep_id}/report.md")
    assert served.status_code == 200, served.text
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            sweep = session.get(Sweep, sweep_id)
            assert sweep is not None
            rows = queries.sweep_rows(session, sweep)
            at_once = report_markdown(
                sweep,
                rows,
                queries.sweep_environments(session, sweep_id),
                sweep_results._run_counts(session, sweep_id),
                baselines.pivot_spec(queries.analysis_of(sweep), rows),
            )
    finally:
        engine.dispose()
        queries._contexts.clear()
    assert "## Against the baseline" in at_once and "[^speedup_above_world_size]:" in at_once
    assert ("## Speedup by seq len" in at_once) == (pivot is not None)
    assert served.text == at_once


def test_a_large_sweep_s_context_is_found_once_it_is_stored(
    database_url: str, monkeypatch: Any
) -> None:
    """POST /sweeps finds a large sweep's context (what varies, its baselines) once it has
    answered, so the sweep's first page reads a page of runs, not every run's config; a small
    sweep's is found at its first read, as before."""
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "WARM_CONTEXT_RUNS", 10)
    queries._contexts.clear()
    try:
        small, large = finished_sweep(database_url, 10), finished_sweep(database_url, 12)
        found = {sweep_id for _, sweep_id, _ in queries._contexts}
        assert found == {large}, found
        (stored,) = queries._contexts.values()
        engine = make_engine(database_url)
        with make_sessionmaker(engine)() as session:
            sweep = session.get(Sweep, large)
            assert sweep is not None
            context = queries.sweep_context(session, sweep)
            assert context is stored and "batch_size" in context.vary_fields  # found at the POST
        engine.dispose()
    finally:
        queries._contexts.clear()
    assert small not in found
