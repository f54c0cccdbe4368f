"""The wheelhouse's two tools (scripts/device_wheelhouse.sh): repack smaller, check the whole.

    python scripts/device_wheels.py repack WHEEL        # ray's or plotly's: drop DROPPED[name]
    python scripts/device_wheels.py check .whl          # needs closed, one version each, size

`check` reads every wheel's Requires-Dist with the GPU machine's markers (CPython 3.12 on x86-64
Linux, no extra asked for) and requires each to be met, specifier included, by a wheel in the
wheelhouse (its version from its file name) or else by a package of scripts/device_packages.txt
(what that machine already has, at the version listed there). A need with a specifier is never
met by a package whose version there is `unknown`: the wheelhouse must carry it. A need without
one (any version) is met by the name. Then it sums the tree that travels (git's tracked and
untracked-not-ignored files) and the wheelhouse against the limit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES = ROOT / "scripts" / "device_packages.txt"
LIMIT_MIB = 62.0
"""What the tree and the wheelhouse may weigh together: the device tool carries 64 MiB, and the
2 MiB left is slack for what a session adds before it runs the check."""
DROPPED = {
    "ray": r"ray/(jars|dashboard/client/build|rllib|data|serve|tune|train|llm|air)/",
    "plotly": r"plotly/package_data/widgetbundle\.js|plotly/labextension/"
    r"|plotly-[^/]+\.data/data/share/jupyter/",
}
"""What a repacked wheel leaves out (a pattern its entries' paths start with). ray: Java's jar
(unused from Python, 31 MB), the dashboard's web client (ringlab starts Ray without its
dashboard) and the libraries on top of Ray Core that ringlab never imports (RLlib, Data, Serve,
Tune, Train, LLM, AIR: 4.5 MiB; ray.init, actors in a placement group and the state API run
without them). plotly: its Jupyter widget and JupyterLab extension (4.2 MiB); the service
serves package_data's plotly.min.js, which stays."""
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "implementation_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
"""The GPU machine's environment markers (KINDS.md: python3 is CPython 3.12.3 on x86-64)."""


def repack(wheel: Path) -> None:
    """Rewrite `wheel` in place without DROPPED[its name]; each entry keeps its ZipInfo (so
    the raylet's and gcs_server's exec bits survive) and RECORD loses the dropped files' lines."""
    dropped = re.compile(DROPPED[canonicalize_name(parse_wheel_filename(wheel.name)[0])])
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped.match(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped.match(ln)).encode()
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data)
    tmp.replace(wheel)


def requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine with no extra asked for."""
    with zipfile.ZipFile(wheel) as zf:
        # the wheel's own dist-info, at the top (ray vendors others' deeper down)
        (meta,) = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        message = Parser().parsestr(zf.read(meta).decode())
    reqs = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def device_packages(path: Path = DEVICE_PACKAGES) -> dict[str, Version | None]:
    """The GPU machine's installed packages (`NAME VERSION` lines; `NAME unknown`: None), by
    canonical name; a line of another form is an error naming it."""
    found: dict[str, Version | None] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        words = line.split()
        if len(words) != 2:
            raise ValueError(f"{path.name} line {number}: {line!r} is not 'NAME VERSION'")
        found[canonicalize_name(words[0])] = None if words[1] == "unknown" else Version(words[1])
    return found


def unmet(req: Requirement, version: Version | None, where: str) -> str | None:
    """Why `version` of req's package (None: unknown) found in `where` does not meet `req`."""
    if not req.specifier:
        return None  # any version
    if version is None:
        return f"the machine's {req.name} is of unknown version: carry a wheel of it"
    if not req.specifier.contains(version, prereleases=True):
        return f"{where} has {req.name} {version}"
    return None


def closure_problems(
    wheels: list[Path], device: dict[str, Version | None] | None = None
) -> list[str]:
    """Needs met neither by a wheel of the wheelhouse nor by the machine (`device`: what
    device_packages reads), each naming the wheel, the need and the version found; a name twice."""
    device = device_packages() if device is None else device
    parsed = [parse_wheel_filename(w.name) for w in wheels]
    names = [canonicalize_name(p[0]) for p in parsed]
    problems = [f"two wheels of {n}" for n in sorted(set(names)) if names.count(n) > 1]
    carried = {canonicalize_name(p[0]): p[1] for p in parsed}
    for wheel in wheels:
        for req in requirements(wheel):
            name = canonicalize_name(req.name)
            if name in carried:
                why = unmet(req, carried[name], "the wheelhouse")
            elif name in device:
                why = unmet(req, device[name], "the machine")
            else:
                why = "not in the wheelhouse nor the machine"
            if why:
                problems.append(f"{wheel.name} needs {req}: {why}")
    return problems


def travelling_bytes() -> int:
    """The working tree that travels: tracked and untracked-not-ignored files (git's list)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    files = (ROOT / p for p in listed.split("\0") if p)
    return sum(f.stat().st_size for f in files if f.is_file())


def check(wheelhouse: Path) -> int:
    """Print the closure's problems and the size; 0 when the closure holds and it fits."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    problems = closure_problems(wheels)
    tree, whl = travelling_bytes(), sum(w.stat().st_size for w in wheels)
    total = (tree + whl) / 2**20
    print(f"{len(wheels)} wheels {whl / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB "
          f"= {total:.1f} MiB (limit {LIMIT_MIB:g} MiB)")  # fmt: skip
    if total > LIMIT_MIB:
        problems.append(f"{total:.1f} MiB travel: over {LIMIT_MIB:g} MiB")
    for p in problems:
        print(f"wheelhouse check failed: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "repack":
        repack(Path(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
