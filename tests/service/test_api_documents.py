"""A submission of several documents lands whole or not at all: POST /sweeps with
{"documents": [...]} stores every sweep in one transaction, or none with every document's
problems; ?dry_run=true counts and checks every document and stores nothing."""

from __future__ import annotations

from typing import Any

from _api_helpers import api_client, small_spec

API = "/api/v1"


def _stored(client: Any) -> tuple[int, int]:
    sweeps = client.get(f"{API}/sweeps").json()["count"]
    runs = client.get(f"{API}/runs").json()["count"]
    return sweeps, runs


def test_all_documents_stored_together(database_url: str) -> None:
    docs = [small_spec("a"), small_spec("b", grid={"seq_len": [128, 256, 512]})]
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json={"documents": docs})
        assert r.status_code == 201, r.text
        sweeps = r.json()["sweeps"]
        assert [(s["name"], s["total"]) for s in sweeps] == [("a", 4), ("b", 3)]
        assert _stored(client) == (2, 7)
        for s in sweeps:
            assert client.get(f"{API}/sweeps/{s['id']}").json()["total"] == s["total"]

        # the same key again: the same sweeps (200), nothing stored twice
        key = {"Idempotency-Key": "file-1"}
        first = client.post(f"{API}/sweeps", json={"documents": docs}, headers=key)
        again = client.post(f"{API}/sweeps", json={"documents": docs}, headers=key)
        assert (first.status_code, again.status_code) == (201, 200)
        ids = [s["id"] for s in first.json()["sweeps"]]
        assert [s["id"] for s in again.json()["sweeps"]] == ids
        assert _stored(client) == (4, 14)


def test_one_bad_document_stores_none_and_every_problem_is_listed(database_url: str) -> None:
    docs = [
        small_spec("good"),
        small_spec("bad length", grid={"seq_len": [128, "long"]}),
        {"name": "bad axis", "base": {"kernel": "dense", "seq_len": 64}, "grid": {"bogus": [1]}},
        small_spec("bad param", base={"kernel": "dense", "params": {"window": 3}}),
        {"grid": {}},  # no name: not even a spec
    ]
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json={"documents": docs})
        assert r.status_code == 422, r.text
        locs = [e["loc"] for e in r.json()["detail"]]
        assert ["body", "documents", 4, "name"] in locs
        assert ["body", "documents", 1, "grid", "seq_len", 1] in locs
        assert ["body", "documents", 2, "grid", "bogus"] in locs
        assert ["body", "documents", 3, "base", "params", "window"] in locs
        assert not any(loc[2] == 0 for loc in locs)
        assert _stored(client) == (0, 0)  # the good first document was not stored either

        docs.pop()  # every document parses: the same problems, found while storing
        r = client.post(f"{API}/sweeps", json={"documents": docs})
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [loc for loc in locs if loc[2] != 4]
        assert _stored(client) == (0, 0)


def test_dry_run_counts_and_checks_every_document_and_stores_nothing(database_url: str) -> None:
    docs = [small_spec("good"), small_spec("bad", grid={"seq_len": [128, "long"]})]
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", params={"dry_run": "true"}, json={"documents": docs})
        assert r.status_code == 200, r.text
        check = r.json()
        assert check["valid"] is False
        good, bad = check["documents"]
        assert (good["name"], good["cells"], good["problems"]) == ("good", 4, [])
        assert bad["name"] == "bad" and bad["cells"] == 2
        assert [p["loc"] for p in bad["problems"]] == [["documents", 1, "grid", "seq_len", 1]]

        one = client.post(f"{API}/sweeps", params={"dry_run": "true"}, json=small_spec()).json()
        assert one == {
            "valid": True,
            "documents": [
                {
                    "index": 0,
                    "name": "small",
                    "cells": 4,
                    "problems": [],
                    "placed": [  # what the CLI checks against the cluster (test_cli_failures)
                        {"device": "auto", "world_size": w, "placement": "pack", "cells": 2}
                        for w in (1, 2)
                    ],
                }
            ],
        }
        assert bad["placed"] == []  # a document with problems is not counted
        assert _stored(client) == (0, 0)
