"""The local Ray a ringlab process starts, and the helper processes it must not leave behind.

A Ctrl-C in the terminal (`make run`, `ringlab serve`) sends SIGINT to the whole process group,
Ray's raylet included, which then dies without stopping its agents (ray::DashboardAgent,
ray::RuntimeEnvAgent): they were left running under PID 1, ignoring SIGTERM. So when ringlab
starts a local Ray it records every process of it (its children and the raylet's children,
with their start times, so a reused PID is never touched) and, at exit, after ray.shutdown(),
kills those still alive. A cluster joined by address is never touched.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import ray

AGENT_WAIT_S = 5.0
"""How long start() waits for the raylet's agents to appear (they start just after it)."""
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")

_started = False
"""Whether this process started the local Ray (a joined cluster, or a test's Ray, is not ours)."""
_recorded: dict[int, tuple[int, int]] = {}
"""pid -> (parent pid, start time in clock ticks since boot) of the local Ray's processes."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def cmdline(pid: int) -> str:
    """The command line of process `pid`, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] == parent:
                found.append(int(entry.name))
    return found


def _descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def local_processes() -> dict[int, str]:
    """pid -> command line of the processes recorded for the local Ray (alive or not)."""
    return {pid: cmdline(pid) for pid in _recorded}


def start() -> None:
    """ray.init a local Ray and record its processes; `stop_leftovers` stops them (registered
    for interpreter exit; the service also calls it at the end of its lifespan, since a
    SIGTERM ends the process before atexit runs)."""
    global _started
    # address="local": always a Ray of our own, never the cluster a `ray start` recorded.
    ray.init(address="local", log_to_driver=False, include_dashboard=False)
    _started = True
    if not Path("/proc/self/stat").exists():
        return  # not Linux: nothing to record (and none of this was seen there)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        pids = [p for p in _descendants(os.getpid()) if "ray" in cmdline(p)]
        agents = [p for p in pids if cmdline(p).startswith(AGENTS)]
        if len(agents) >= len(AGENTS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            _recorded[pid] = stat
    atexit.register(stop_leftovers)


def stop_leftovers() -> list[int]:
    """At exit: kill the raylet's recorded children (its agents and idle workers), then
    ray.shutdown(), then any recorded process still alive. Returns the pids killed.

    The children go first because a Ctrl-C also reached the raylet, which dies without
    stopping them, and ray.shutdown() may end this process when the raylet is gone.
    Does nothing unless this process started the local Ray (`start`)."""
    global _started
    if not _started:
        return []
    _started = False
    killed = _kill(lambda parent: parent != os.getpid())
    if ray.is_initialized():
        ray.shutdown()
    return killed + _kill(lambda parent: True)


def _kill(which: Callable[[int], bool]) -> list[int]:
    """SIGKILL the recorded processes still alive as themselves (start time unchanged) whose
    parent at start (`which(parent)`) selects them."""
    chosen = {pid: stat for pid, stat in _recorded.items() if which(stat[0])}
    for pid in chosen:
        del _recorded[pid]
    return kill_processes(chosen)


def descendants(root: int) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live descendant of process `root` now: what a
    supervisor kills once `root` is gone (a local Ray's raylet and its agents outlive it)."""
    found = {}
    for pid in _descendants(root):
        stat = _stat(pid)
        if stat is not None:
            found[pid] = stat
    return found


def recorded() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of the local Ray's processes this process started: a
    supervisor that must SIGKILL this process kills them after it (`kill_processes`)."""
    return dict(_recorded)


def kill_processes(processes: dict[int, tuple[int, int]]) -> list[int]:
    """SIGKILL each process (pid -> (parent pid, start time)) still alive as itself (its start
    time unchanged, so a reused pid is never touched); the pids killed."""
    killed = []
    for pid, (_, started) in processes.items():
        stat = _stat(pid)
        if stat is None or stat[1] != started:
            continue  # gone (or the pid is another process now)
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass  # it ended between the check and the kill: what we wanted
    return killed
