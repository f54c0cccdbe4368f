"""Measurements that must run in a fresh interpreter: what earlier tests left in this process's
heap (and glibc's settings) would move a peak or decide which allocations reuse memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def fresh_json(script: str, timeout: int = 240) -> Any:
    """Run `script` with `python -c` from the repository root; its last stdout line, as JSON.
    A failing script fails the test with the end of its stderr."""
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])
