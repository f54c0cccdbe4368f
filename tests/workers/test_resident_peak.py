"""The resident-set peak, a second CPU figure beside the allocator's peak, travels from a rank's
result to every place rank figures go: the run's API detail, results.json and .csv, the run
page (migration 0009's column)."""

from __future__ import annotations

import csv
import io

from _api_helpers import api_client, small_spec, store_result
from sqlalchemy import select

from service.db.models import RankResultRow

API = "/api/v1"


def test_the_resident_peak_is_shown_beside_the_allocator_peak(database_url: str) -> None:
    with api_client(database_url) as client:
        sweep_id = client.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
        run_id = runs["data"][0]["id"]
        with client.app.state.sessionmaker() as s:
            store_result(s, run_id, medians=(0.004, 0.005), peak=3 << 20)
            rows = s.scalars(select(RankResultRow).where(RankResultRow.run_id == run_id)).all()
            for row, resident in zip(rows, (5 << 20, 7 << 20), strict=True):
                row.resident_peak_bytes = resident
            s.commit()

        detail = client.get(f"{API}/runs/{run_id}").json()
        ranks = sorted(detail["rank_results"], key=lambda r: r["rank"])
        assert [r["resident_peak_bytes"] for r in ranks] == [5 << 20, 7 << 20]
        assert detail["headline"]["resident_peak_bytes"] == 7 << 20  # the largest rank's

        (row,) = [r for r in client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
                  if r["run_id"] == run_id]  # fmt: skip
        assert row["resident_peak_bytes"] == 7 << 20
        assert row["peak_memory_bytes"] != row["resident_peak_bytes"]
        text = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
        (line,) = [r for r in csv.DictReader(io.StringIO(text)) if r["run_id"] == str(run_id)]
        assert int(line["resident_peak_bytes"]) == 7 << 20

        page = client.get(f"/runs/{run_id}").text
        assert "resident peak (RSS)" in page
        assert "5.00 MiB" in page and "7.00 MiB" in page
