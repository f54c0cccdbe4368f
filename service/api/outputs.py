"""The API's views of stored rows that are not results: a run's headline and its artifacts with
their download URLs (service.api.schemas' Headline and ArtifactOut)."""

from __future__ import annotations

from service.api.schemas import ArtifactOut, Headline
from service.db.models import ArtifactRow
from service.results.rows import RunRow


def headline(row: RunRow) -> Headline:
    """The headline numbers of one run (GET /runs/{id})."""
    return Headline(**{k: getattr(row, k) for k in Headline.model_fields})


def artifact_out(artifact: ArtifactRow) -> ArtifactOut:
    """An artifact row with its download URL (None when refused)."""
    url = None
    if artifact.location is not None:
        url = f"/api/v1/runs/{artifact.run_id}/artifacts/{artifact.name}"
    return ArtifactOut.model_validate({**_columns(artifact), "url": url})


def _columns(artifact: ArtifactRow) -> dict[str, object]:
    return {c: getattr(artifact, c) for c in ArtifactOut.model_fields if c != "url"}
