"""`ringlab submit`: every document of a spec file stored as a sweep, all or none (or checked
only, with --dry-run), each problem named by its path, then optionally followed."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from service import capacity
from service.cli.console import CliError, client, err, friendly_errors, out
from service.cli.specs import load_specs
from service.cli.watch import watch_sweeps
from service.client import ClientError, problem_lines
from service.units import plural


@friendly_errors
def submit(
    file: Annotated[
        str,
        typer.Argument(
            help="Sweep spec (YAML), or a bundled example's name (e.g. cpu-quick; a wrong "
            "name lists them)."
        ),
    ],
    watch_: Annotated[
        bool,
        typer.Option(
            "--watch", help="Follow every sweep of the file until all end; exit 1 if a run failed."
        ),
    ] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting again with the same key returns the same sweep.")
    ] = None,
    print_id: Annotated[
        bool,
        typer.Option(
            "--print-id", help="Print only each sweep's id, one a line: id=$(ringlab submit ...)."
        ),
    ] = False,
    as_: Annotated[
        str | None,
        typer.Option(
            "--as",
            envvar="RINGLAB_SUBMITTER",
            help="Submit as this name (default: your login name): the queue round-robins "
            "across submitters, then across each one's sweeps.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check every document and print its cell count and problems; store nothing "
            "(exit 1 if a document has a problem).",
        ),
    ] = False,
) -> None:
    """Submit a sweep per YAML document, all of them or none; print each id and dashboard URL."""
    if print_id and watch_:
        raise CliError("--print-id and --watch: pick one (ringlab watch $id follows it)")
    specs = load_specs(file)
    with client() as c:
        if dry_run:
            _dry_run(c, file, specs)
            return
        sweeps = _submit_all(c, file, specs, idempotency_key, as_)
        for sweep in sweeps:
            if print_id:
                out.print(str(sweep["id"]))
                continue
            out.print(f"sweep {sweep['id']} ({sweep['name']}): {plural(sweep['total'], 'run')}")
            out.print(f"dashboard: {c.dashboard_url(sweep['id'])}")
        ids = [sweep["id"] for sweep in sweeps]
        warn_at_submit(c, ids)
        if watch_:
            watch_sweeps(c, ids)


def warn_at_submit(c: Any, sweep_ids: list[int]) -> None:
    """Print capacity.submit_warnings on stderr (nothing when every run fits)."""
    for line in capacity.submit_warnings(c, sweep_ids):
        err.print(line, markup=False, highlight=False, soft_wrap=False)


def _problem_lines(errors: list[dict[str, Any]]) -> str:
    """A line per problem, '  documents[1].grid.seq_len[0]: msg' (up to SHOWN_ERRORS)."""
    return "\n".join(problem_lines(errors)[1])


def _submit_all(
    c: Any, file: str, specs: list[dict[str, Any]], key: str | None, who: str | None
) -> list[dict[str, Any]]:
    """One document as a single sweep; several in one request, stored all or none. A refusal
    is one CliError naming the file and listing its problems by their place (nothing stored)."""
    try:
        if len(specs) == 1:
            return [c.submit(specs[0], idempotency_key=key, submitter=who)]
        return list(c.submit_documents(specs, idempotency_key=key, submitter=who))
    except ClientError as e:
        if e.status != 422 or not e.errors or not all(_in_body(x) for x in e.errors):
            raise  # not the file's problem (a header, the service): the service's own line
        count, lines = problem_lines(e.errors)
        where = f" in its {len(specs)} documents" if len(specs) > 1 else ""
        if len(lines) == 1 and count == "1 problem":  # one problem: one line
            raise CliError(f"{file}: nothing submitted: {lines[0].strip()}") from None
        raise CliError(
            f"{file}: nothing submitted: {count}{where}; fix them and submit again",
            detail="\n".join(lines),
        ) from None


def _in_body(error: dict[str, Any]) -> bool:
    """A 422 error about the submitted spec (its loc starts at the body), not a header."""
    loc = error.get("loc") or []
    return not loc or loc[0] == "body"


def _dry_run(c: Any, file: str, specs: list[dict[str, Any]]) -> None:
    """Each document's cell count and problems, as the service would store it; exit 1 if
    any document has a problem."""
    check = c.check(specs)
    for doc in check["documents"]:
        name = f" ({doc['name']})" if doc["name"] else ""
        cells = "? cells" if doc["cells"] is None else plural(doc["cells"], "cell")
        verdict = plural(len(doc["problems"]), "problem") if doc["problems"] else "ok"
        out.print(f"documents[{doc['index']}]{name}: {cells}, {verdict}", markup=False)
        if doc["problems"]:
            out.print(_problem_lines(doc["problems"]), markup=False)
    out.print(f"{file}: dry run, nothing stored", markup=False)
    for line in capacity.dry_run_warnings(c, check["documents"]):
        err.print(line, markup=False, highlight=False, soft_wrap=False)
    if not check["valid"]:
        raise typer.Exit(1)
