"""What POST /sweeps does before storing: each document of a submission parsed on its own, and
the dry run (?dry_run=true) that checks and counts every document, storing nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from service.api.errors import did_you_mean, safe_error
from service.api.schemas import CellsPlaced, DocumentCheck, SweepCheck, SweepDocuments
from service.core.config import RunLimits
from service.spec import Cell, SpecError, SweepSpec, cell_count, iter_cells, unstorable_values

Loc = tuple[str | int, ...]


def _under(where: Loc, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors with `where` before their locs (a document's ('documents', i))."""
    return [{**e, "loc": [*where, *e["loc"]]} for e in errors]


def _parse_one(raw: Any, where: Loc) -> tuple[SweepSpec | None, list[dict[str, Any]]]:
    """A document as a SweepSpec with no value a database could not hold, or its errors."""
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as e:
        return None, _under(where, [safe_error(dict(err)) for err in e.errors(include_url=False)])
    return spec, _under(where, unstorable_values(spec.model_dump(exclude_unset=True)))


def parse(body: SweepDocuments) -> tuple[list[SweepSpec], list[dict[str, Any]]]:
    """Every document parsed: (the specs, []) or ([...], every document's errors)."""
    specs, problems = [], []
    for i, raw in enumerate(body.documents):
        spec, errors = _parse_one(raw, ("documents", i))
        problems += errors
        if spec is not None:
            specs.append(spec)
    return specs, problems


def lazy_cells(spec: SweepSpec, limits: RunLimits) -> Iterator[Cell]:
    """iter_cells, its structural check (which raises at once) deferred to the first cell: a
    document's problems come while storing, beside the other documents' (store.create_sweeps)."""
    yield from iter_cells(spec, limits)


def _check_one(raw: Any, spec: SweepSpec | None, where: Loc, limits: RunLimits) -> DocumentCheck:
    """One document checked as a submission would: parsed, then every cell expanded."""
    problems: list[dict[str, Any]] = []
    if spec is None:
        spec, problems = _parse_one(raw, where)
    elif bad := unstorable_values(spec.model_dump(exclude_unset=True)):
        problems = _under(where, bad)
    name = raw.get("name") if isinstance(raw, dict) else None
    placed: Counter[tuple[str, int, str]] = Counter()
    if spec is None or problems:
        cells = cell_count(spec) if spec is not None else None
    else:
        try:
            for cell in iter_cells(spec, limits):
                cfg = cell.config_json
                placed[(cfg["device"], cfg["world_size"], cfg["placement"])] += 1
            cells = placed.total()
        except SpecError as e:
            cells, problems, placed = cell_count(spec), _under(where, e.errors), Counter()
    index = int(where[1]) if where else 0
    return DocumentCheck(
        index=index,
        name=name if isinstance(name, str) else None,
        cells=cells,
        problems=[safe_error(did_you_mean(p)) for p in problems],
        placed=[
            CellsPlaced(device=d, world_size=w, placement=p, cells=n)
            for (d, w, p), n in placed.items()
        ],
    )


def check(root: SweepSpec | SweepDocuments, limits: RunLimits) -> SweepCheck:
    """A dry run: each document's cell count and problems; nothing stored."""
    if isinstance(root, SweepSpec):
        docs = [_check_one(root.model_dump(), root, (), limits)]
    else:
        docs = [
            _check_one(raw, None, ("documents", i), limits) for i, raw in enumerate(root.documents)
        ]
    return SweepCheck(valid=not any(d.problems for d in docs), documents=docs)
