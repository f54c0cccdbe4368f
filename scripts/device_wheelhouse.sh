#!/usr/bin/env bash
# The wheelhouse for the GPU machine (docs/device.md): .whl/ at the repository's root, git-ignored,
# carried with the tree by the device tool (`carry: [".whl"]`). Run here, where PyPI answers.
#
# It holds the cp312 manylinux wheels of exactly what the service, the scheduler and the workers
# import and the GPU machine lacks (scripts/device_packages.txt lists what it has), at
# constraints.txt's versions; ray and plotly repacked without what ringlab never loads
# (scripts/device_wheels.py DROPPED); and
# the ringlab wheel (its entry points register the adapters' kernels, its service.migrations
# serves `ringlab db upgrade`). Then it installs them all as the device check does (pip
# --target, cp312) and checks ray's daemons kept their exec bits; scripts/device_wheels.py
# checks that every wheel's needs are met there and that tree + wheelhouse fit in 62 MiB, and
# prints the size.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHL=.whl

# What the GPU machine lacks (the check below fails if this list misses a need).
NAMES=(
  ray fastapi starlette pydantic pydantic_core pydantic-settings python-dotenv typing-inspection
  annotated-types alembic Mako uvicorn sse-starlette python-multipart platformdirs plotly psycopg
  jsonschema jsonschema-specifications referencing rpds-py opentelemetry-api importlib_metadata
  # what it has at a version never read (`unknown` in scripts/device_packages.txt) and a wheel
  # here needs with a version specifier: carried at our pin (fill in the version from the
  # check's facts.txt, and one that meets the need can leave this list)
  typing_extensions anyio annotated-doc zipp attrs MarkupSafe narwhals click msgpack packaging
  protobuf typer rich PyYAML Jinja2 httpx fsspec h11 idna certifi httpcore markdown-it-py
  Pygments mdurl shellingham
)
PURE=(SQLAlchemy)  # its pure-Python wheel: the cp312 one is 4.5 MB
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

pinned() {  # NAME==VERSION from constraints.txt (names compared as pip does: case, - _ .)
  local want line
  want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  while IFS= read -r line; do
    [[ $line == *==* ]] || continue
    if [[ $(echo "${line%%==*}" | tr 'A-Z_.' 'a-z--') == "$want" ]]; then
      echo "$line"
      return
    fi
  done <constraints.txt
  echo "device_wheelhouse: $1 is not pinned in constraints.txt" >&2
  return 1
}

rm -rf "$WHL" && mkdir "$WHL"
specs=() && for n in "${NAMES[@]}"; do specs+=("$(pinned "$n")"); done
pure=() && for n in "${PURE[@]}"; do pure+=("$(pinned "$n")"); done
common=(download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$WHL")
"$PY" -m pip "${common[@]}" "${PLATFORMS[@]/#/--platform=}" "${specs[@]}"
"$PY" -m pip "${common[@]}" --platform any "${pure[@]}"

"$PY" scripts/device_wheels.py repack "$WHL"/ray-*.whl
"$PY" scripts/device_wheels.py repack "$WHL"/plotly-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHL" . >/dev/null
rm -rf build  # what the ringlab wheel's build leaves

# pip installs the lot as the device check does (for cp312), and the repacked ray's daemons
# keep their exec bits
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" --python-version 3.12 \
  --implementation cp --only-binary=:all: "$WHL"/*.whl
for daemon in raylet/raylet gcs/gcs_server; do
  [[ -x $site/ray/core/src/ray/$daemon ]] || { echo "ray's $daemon is not executable" >&2; exit 1; }
done

"$PY" scripts/device_wheels.py check "$WHL"
