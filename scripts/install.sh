#!/usr/bin/env bash
# Install ringlab into a Python environment with the pinned constraints: the one install step
# shared by the Dockerfile and `ray up` (deploy/), and meant for the Makefile too.
# usage: scripts/install.sh PYTHON [PIP TARGET...]    (target defaults to ".", e.g. -e '.[dev]')
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/install.sh PYTHON [PIP TARGET...]}
shift
[ $# -gt 0 ] || set -- .
exec "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt "$@"
