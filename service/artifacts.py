"""The artifact store: where the scheduler writes a run's files (profiler traces, memory
snapshots) and where the API reads them back.

The root is a local directory (the default: `artifacts` beside the default SQLite database) or
any fsspec URL (s3://bucket/prefix, gs://..., memory://), set by RINGLAB_ARTIFACT_ROOT; a
cluster's schedulers and API must share it. A run's files live under {root}/runs/{run_id}/,
and the artifact table (service.db.models.ArtifactRow) records each one's name, size and location,
so listing reads the database only. Caps: RINGLAB_ARTIFACT_MAX_BYTES per artifact and
RINGLAB_RUN_ARTIFACTS_MAX_BYTES per run; one over a cap is not written and its row says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec

from workers.results import Artifact

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Reads stream this many bytes at a time."""


class ArtifactStore:
    """Writes and reads the files of runs under one root (a path or fsspec URL)."""

    def __init__(self, root: str, max_bytes: int, run_max_bytes: int) -> None:
        self.root = root.rstrip("/")
        self.max_bytes = max_bytes
        self.run_max_bytes = run_max_bytes
        self.fs, self._base = fsspec.core.url_to_fs(self.root)

    @classmethod
    def from_settings(cls, settings: Any) -> ArtifactStore:
        return cls(
            settings.artifact_root, settings.artifact_max_bytes, settings.run_artifacts_max_bytes
        )

    def _path(self, run_id: int, name: str) -> str:
        return f"{self._base}/runs/{run_id}/{name}"

    def write(
        self,
        run_id: int,
        artifacts: Sequence[Artifact],
        between: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Write what fits the caps, in order; one artifact table row for each (location None
        and `refused` set for what was not written: over a cap, or the write failed, whose
        error the row keeps, so a run's measurements never depend on its files). Artifact
        names are unique per run (rank in the name); a later write of the same name (a retried
        run) replaces the file. `between` runs before each write (the scheduler renews its
        lease there: an upload may take a while)."""
        rows, used = [], 0
        for art in artifacts:
            row: dict[str, Any] = art.model_dump(include={"rank", "name", "kind", "size_bytes"})
            row.update(location=None, refused=art.refused)
            if art.data is not None and row["refused"] is None:
                size = len(art.data)
                if size > self.max_bytes:
                    row["refused"] = (
                        f"{size} bytes is over the {self.max_bytes}-byte cap of one artifact "
                        "(RINGLAB_ARTIFACT_MAX_BYTES)"
                    )
                elif used + size > self.run_max_bytes:
                    row["refused"] = (
                        f"{size} more bytes would take the run's artifacts to {used + size}, "
                        f"over the {self.run_max_bytes}-byte cap per run "
                        "(RINGLAB_RUN_ARTIFACTS_MAX_BYTES)"
                    )
                else:
                    if between is not None:
                        between()
                    path = self._path(run_id, art.name)
                    try:
                        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                        with self.fs.open(path, "wb") as fh:
                            fh.write(art.data)
                    except OSError as exc:  # disk full, permissions, a store's own errors
                        log.warning("run %d: artifact %s not written", run_id, art.name,
                                    exc_info=True)  # fmt: skip
                        row["refused"] = f"could not be written under {self.root}: {exc!r}"
                    else:
                        used += size
                        row["location"] = self.fs.unstrip_protocol(path)
            rows.append(row)
        return rows


def exists(location: str) -> bool:
    """Whether the file at `location` (a path or fsspec URL, as stored) is there."""
    fs, path = fsspec.core.url_to_fs(location)
    return bool(fs.exists(path))


def read_chunks(location: str) -> Iterator[bytes]:
    """The file at `location`, CHUNK_BYTES at a time."""
    with fsspec.open(location, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            yield chunk
