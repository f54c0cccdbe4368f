"""Ray's own reason a gang's actors do not start: the raylets' error logs, read since a mark.

An actor whose worker process cannot start (a runtime env Ray rejects, an interpreter that dies
before it connects) stays PENDING_CREATION and Ray raises nothing for minutes; the cause is only
in the node's raylet.err ("ValueError: illegal environment variable name"). `RayletErrors`
marks where each node's raylet.err ends when a gang starts and returns what was added since.
A node on this host is read from the session's log directory; another node through Ray's state
API (it needs the cluster's dashboard; without one that node's reason is not available).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray._private import state
from ray.util.placement_group import placement_group_table

log = logging.getLogger(__name__)

LOG_NAME = "raylet.err"
REMOTE_TAIL_LINES = 50
MAX_REASON_CHARS = 1500


def _local_node() -> tuple[str, str] | None:
    """(node id, logs dir) of the Ray node on this host that this driver is attached to."""
    node = getattr(ray._private.worker.global_worker, "node", None)
    logs = getattr(node, "_logs_dir", None) if node is not None else None
    if not logs:
        return None
    return ray.get_runtime_context().get_node_id(), str(logs)


def _remote_tail(node_id: str) -> list[str]:
    from ray.util.state import get_log  # the state API loads the dashboard's client: only here

    try:
        text = "".join(get_log(node_id=node_id, filename=LOG_NAME, tail=REMOTE_TAIL_LINES))
    except Exception as exc:  # no dashboard, or the node is gone: no reason from that node
        log.debug("cannot read %s of node %s: %s", LOG_NAME, node_id, exc)
        return []
    return text.splitlines()


class RayletErrors:
    """What the raylets of `node_ids` wrote to raylet.err after this object was made."""

    def __init__(self, node_ids: list[str]) -> None:
        self.node_ids = sorted(set(node_ids))
        self._local = _local_node()
        self._offsets: dict[str, int] = {}
        self._seen: dict[str, set[str]] = {}
        for node_id in self.node_ids:
            path = self._path(node_id)
            if path is not None:
                self._offsets[node_id] = os.path.getsize(path) if os.path.exists(path) else 0
            else:
                self._seen[node_id] = set(_remote_tail(node_id))

    def _path(self, node_id: str) -> str | None:
        if self._local is None or self._local[0] != node_id:
            return None
        return os.path.join(self._local[1], LOG_NAME)

    def new_lines(self, node_id: str) -> list[str]:
        """The non-blank lines `node_id`'s raylet.err gained since the mark."""
        path = self._path(node_id)
        if path is None:
            seen = self._seen.get(node_id, set())
            lines = [line for line in _remote_tail(node_id) if line not in seen]
        else:
            if not os.path.exists(path):
                return []
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offsets.get(node_id, 0))
                lines = f.read().splitlines()
        return [line.strip() for line in lines if line.strip()]

    def reason(self) -> str | None:
        """One line naming each node that reported errors and its last distinct lines."""
        parts = []
        for node_id in self.node_ids:
            lines = list(dict.fromkeys(self.new_lines(node_id)))  # the raylet repeats itself
            if lines:
                parts.append(f"raylet.err of node {node_id[:12]}: {' | '.join(lines[-3:])}")
        text = "; ".join(parts)
        return text[:MAX_REASON_CHARS] if text else None


def group_nodes(pg: Any) -> list[str]:
    """The node ids a ready placement group's bundles were placed on."""
    table = placement_group_table(pg)
    return sorted({str(n) for n in table.get("bundles_to_node_id", {}).values()})


def actor_states(actors: list[Any]) -> list[str]:
    """Each actor's state in the GCS (PENDING_CREATION, ALIVE, DEAD, ...)."""
    out = []
    for actor in actors:
        info = state.actors(actor._actor_id.hex()) or {}
        out.append(str(info.get("State", "unknown")))
    return out
