"""The HTTP client the CLI uses to talk to a ringlab service (httpx).

RINGLAB_URL (default http://127.0.0.1:8000) says where the service is; RINGLAB_API_TOKEN, when
set, is sent as a bearer token; a submission names its submitter (RINGLAB_SUBMITTER, else the
login user) in X-Ringlab-Submitter, which the queue is fair across. Every failure becomes a
ClientError with one readable line.

With `patience_s` (`ringlab watch --patience`), reads ride out an outage: a GET that finds the
service unreachable, busy or without its database (429, 502, 503, 504) is tried again after
its Retry-After, and an event stream reconnects, or waits while the server reports `error`
events, until the outage has lasted `patience_s`; then one line says what it gave up on.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
API = "/api/v1"
SUBMITTER_HEADER = "X-Ringlab-Submitter"
SUBMITTER_RE = re.compile(r"[A-Za-z0-9._@+-]{1,64}")  # service.db.models.SUBMITTER_PATTERN
RETRYABLE = frozenset({429, 502, 503, 504})
"""Answers that say "not now": a GET is tried again after Retry-After, within the patience."""
DEFAULT_WAIT_S = 2.0
"""The wait before another try when no Retry-After says how long (the service unreachable)."""
MAX_WAIT_S = 60.0


def default_submitter() -> str | None:
    """RINGLAB_SUBMITTER if set (sent as given: a bad one is the service's 422), else the login
    user when it is a valid submitter name; None otherwise (the service records 'anonymous';
    the sweep it returns names its submitter)."""
    named = os.environ.get("RINGLAB_SUBMITTER")
    if named is not None:
        return named
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name (a container's uid without a passwd entry)
        return None
    return user if SUBMITTER_RE.fullmatch(user) else None


class ClientError(Exception):
    """A request that failed: the service is unreachable or answered with an error.

    `status` is the HTTP status of an error answer (None when the service was unreachable).
    """

    def __init__(
        self, message: str, status: int | None = None, errors: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors or []
        """A 422's errors (loc, msg, type), every one; empty for other failures."""
        # the lines after the first: each problem of a 422 that had several
        self.detail = "\n".join(message.splitlines()[1:])


SHOWN_ERRORS = 10
"""Validation errors a CLI error lists, one a line; the rest are counted."""


def problem_path(loc: list[Any]) -> str:
    """A 422 error's loc as a path: ['body', 'documents', 1, 'grid', 'seq_len', 0] ->
    'documents[1].grid.seq_len[0]' (the one way a place in a spec is written)."""
    path = ""
    for part in loc[1:] if loc[:1] == ["body"] else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _one_error(error: Any) -> str:
    """'base.seq_len: <why>' of one validation error (its message alone without a place)."""
    if not isinstance(error, dict):
        return str(error)
    where = problem_path(list(error.get("loc", [])))
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))


def _errors(response: httpx.Response) -> list[dict[str, Any]]:
    """The validation errors of a 422 answer (its `detail` list), else []."""
    try:
        body = response.json()
    except ValueError:
        return []
    detail = body.get("detail") if isinstance(body, dict) else None
    return [e for e in detail if isinstance(e, dict)] if isinstance(detail, list) else []


def _detail(response: httpx.Response) -> str:
    """The service's error detail: FastAPI's string as one line, or the validation errors:
    one as a line, several as a count, then each on its own indented line (up to
    SHOWN_ERRORS, the rest counted): none hidden behind "and 1 more"."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0] if response.text.strip() else ""
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list) and detail:
        if len(detail) == 1:
            return _one_error(detail[0])
        count, lines = problem_lines(detail)
        return "\n".join([f"{count}:", *lines])
    return str(detail)


def problem_lines(errors: list[Any]) -> tuple[str, list[str]]:
    """('12 problems', a line each for up to SHOWN_ERRORS of a 422's errors, then one counting
    the rest); '25+ problems' when the service stopped counting (a too_many_errors entry)."""
    counted = [e for e in errors if isinstance(e, dict) and e.get("type") == "too_many_errors"]
    errors = [e for e in errors if e not in counted]
    lines = [f"  {_one_error(e)}" for e in errors[:SHOWN_ERRORS]]
    hidden = len(errors) - len(lines)
    if hidden or counted:
        lines.append(f"  ... {'and more' if counted else f'and {hidden} more'} not shown")
    noun = "problem" if len(errors) == 1 and not counted else "problems"
    return f"{len(errors)}{'+' if counted else ''} {noun}", lines


def retry_after_s(response: httpx.Response) -> float:
    """The answer's Retry-After in seconds (DEFAULT_WAIT_S when absent or not a number)."""
    try:
        wait = float(response.headers.get("retry-after", DEFAULT_WAIT_S))
    except ValueError:  # an HTTP date: no server of ours sends one
        return DEFAULT_WAIT_S
    return min(max(wait, 0.1), MAX_WAIT_S) if wait == wait else DEFAULT_WAIT_S


class Client:
    """A thin client for /api/v1: each method returns the decoded answer or raises ClientError.

    `patience_s` > 0: reads retry through an outage for that long (see the module's doc), and
    `on_wait` is told each wait in one line."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout_s: float = 30.0,
        patience_s: float = 0.0,
    ) -> None:
        self.base_url = (base_url or os.environ.get("RINGLAB_URL") or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get("RINGLAB_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self.patience_s = patience_s
        self.on_wait: Callable[[str], None] | None = None

    def _wait_or_give_up(
        self, failure: ClientError, wait_s: float, since: float | None, sleep: bool = True
    ) -> float:
        """Within the patience since the outage began (`since`, None: now), wait `wait_s` (at
        most what is left of it) and return `since`; past it, raise `failure` (with the time
        given up after, when there was patience)."""
        now = time.monotonic()
        since = now if since is None else since
        left = self.patience_s - (now - since)
        if left <= 0:
            if self.patience_s > 0:
                raise ClientError(
                    f"gave up after {self.patience_s:.0f} s: {failure}", failure.status
                )
            raise failure
        wait_s = min(wait_s, left)
        if self.on_wait is not None:
            self.on_wait(f"{failure}; trying again for up to {left:.0f} s more")
        if sleep:
            time.sleep(wait_s)
        return since

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def dashboard_url(self, sweep_id: int) -> str:
        """The sweep's page in the dashboard."""
        return f"{self.base_url}/sweeps/{sweep_id}"

    def _unreachable(self, exc: httpx.TransportError) -> ClientError:
        return ClientError(
            f"cannot reach the ringlab service at {self.base_url} ({type(exc).__name__}: {exc}); "
            "start it with `ringlab serve` or set RINGLAB_URL"
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request under /api/v1; an error status or a transport failure -> ClientError.
        A GET is tried again within the patience (RETRYABLE answers, unreachable service)."""
        since: float | None = None
        while True:
            try:
                response = self.http.request(method, API + path, **kwargs)
            except httpx.TransportError as exc:
                if method != "GET" or self.patience_s <= 0:
                    raise self._unreachable(exc) from exc
                since = self._wait_or_give_up(self._unreachable(exc), DEFAULT_WAIT_S, since)
                continue
            if response.status_code < 400:
                return response
            failure = ClientError(
                f"{method} {API}{path} -> {response.status_code}: {_detail(response)}",
                status=response.status_code,
                errors=_errors(response) if response.status_code == 422 else None,
            )
            if method != "GET" or response.status_code not in RETRYABLE:
                raise failure
            since = self._wait_or_give_up(failure, retry_after_s(response), since)

    def _submit_headers(self, idempotency_key: str | None, submitter: str | None) -> dict[str, str]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        who = submitter if submitter is not None else default_submitter()
        if who is not None:
            headers[SUBMITTER_HEADER] = who
        return headers

    def submit(
        self,
        spec: dict[str, Any],
        idempotency_key: str | None = None,
        submitter: str | None = None,
    ) -> dict[str, Any]:
        """POST the sweep spec as `submitter` (None: default_submitter()); the stored sweep
        (with its run counts and submitter)."""
        headers = self._submit_headers(idempotency_key, submitter)
        return self.request("POST", "/sweeps", json=spec, headers=headers).json()

    def submit_documents(
        self,
        specs: list[dict[str, Any]],
        idempotency_key: str | None = None,
        submitter: str | None = None,
    ) -> list[dict[str, Any]]:
        """POST several sweep specs at once: all stored, or none (ClientError 422 with every
        document's errors, their locs under documents.<i>); the stored sweeps in order.
        Document i's key is `<idempotency_key>-<i>`."""
        headers = self._submit_headers(idempotency_key, submitter)
        body = {"documents": specs}
        return self.request("POST", "/sweeps", json=body, headers=headers).json()["sweeps"]

    def check(self, specs: list[dict[str, Any]]) -> dict[str, Any]:
        """A dry run: each document's cell count and problems; nothing is stored."""
        params = {"dry_run": "true"}
        return self.request("POST", "/sweeps", json={"documents": specs}, params=params).json()

    def sweeps(self, skip: int = 0, limit: int = 50) -> dict[str, Any]:
        return self.request("GET", "/sweeps", params={"skip": skip, "limit": limit}).json()

    def sweep(self, sweep_id: int) -> dict[str, Any]:
        return self.request("GET", f"/sweeps/{sweep_id}").json()

    def cancel(self, sweep_id: int) -> dict[str, Any]:
        return self.request("POST", f"/sweeps/{sweep_id}/cancel").json()

    def retry(
        self, sweep_id: int, include_oom: bool = False, include_cancelled: bool = False
    ) -> dict[str, Any]:
        """Requeue failed and timed-out runs (and oom / cancelled ones when asked)."""
        params = {"include_oom": "true"} if include_oom else {}
        if include_cancelled:
            params["include_cancelled"] = "true"
        return self.request("POST", f"/sweeps/{sweep_id}/retry", params=params).json()

    def delete(self, sweep_id: int) -> None:
        """Delete the sweep with its runs and results (409 while runs are running)."""
        self.request("DELETE", f"/sweeps/{sweep_id}")

    def results(self, sweep_id: int) -> list[dict[str, Any]]:
        return self.request("GET", f"/sweeps/{sweep_id}/results.json").json()

    def results_csv(self, sweep_id: int) -> str:
        return self.request("GET", f"/sweeps/{sweep_id}/results.csv").text

    def report(self, sweep_id: int) -> str:
        return self.request("GET", f"/sweeps/{sweep_id}/report.md").text

    def cluster(self) -> dict[str, Any]:
        return self.request("GET", "/cluster").json()

    def healthy(self) -> bool:
        """Whether /healthz answers 200 (False while the service is still starting)."""
        try:
            return self.http.get(API + "/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def events(self, sweep_id: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """The sweep's server-sent events as (event, data) until the stream ends. Within the
        patience, a refused or lost stream is opened again and the server's `error` events
        (its database unavailable) are waited through; without, either is a ClientError."""
        path = f"{API}/sweeps/{sweep_id}/events"
        since: float | None = None  # when the current outage began
        while True:
            try:
                with self.http.stream("GET", path, timeout=httpx.Timeout(30, read=None)) as r:
                    if r.status_code >= 400:
                        r.read()
                        failure = ClientError(
                            f"GET {path} -> {r.status_code}: {_detail(r)}", status=r.status_code
                        )
                        if r.status_code not in RETRYABLE:
                            raise failure
                        since = self._wait_or_give_up(failure, retry_after_s(r), since)
                        continue
                    for event, data in _server_events(r):
                        if event == "error":  # the server keeps the stream and polls again
                            failure = ClientError(f"GET {path}: {data.get('detail')}", 503)
                            since = self._wait_or_give_up(failure, 0, since, sleep=False)
                            continue
                        since = None
                        yield event, data
                    return
            except httpx.TransportError as exc:
                since = self._wait_or_give_up(self._unreachable(exc), DEFAULT_WAIT_S, since)


def _server_events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) of each server-sent event of `response` (comments and retry: skipped)."""
    event, data = "message", list[str]()
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
