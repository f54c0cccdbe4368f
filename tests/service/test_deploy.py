"""Deployment files: docker-compose.yml, the Dockerfile, the `ray up` cluster files, the scripts.

No Docker engine and no cloud here: the compose file is checked at the YAML level, the cluster
files with Ray's own schema check (the one `ray up` runs), the shell scripts by running them on
the paths that start nothing.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
CLUSTER_FILES = [ROOT / "deploy" / "ray-cluster.yaml", ROOT / "deploy" / "ray-cluster-aws.yaml"]
RINGLAB_SERVICES = ("api", "scheduler", "ray-head", "ray-gpu-worker")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def test_compose_has_every_service_from_one_image(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert set(services) == {"postgres", *RINGLAB_SERVICES}
    images = {services[name]["image"] for name in RINGLAB_SERVICES}
    assert images == {"${RINGLAB_IMAGE:-ringlab:latest}"}
    for name in RINGLAB_SERVICES:
        build = services[name]["build"]
        assert build["context"] == "."
        assert set(build["args"]) == {"BASE_IMAGE", "TORCH_INDEX_URL"}


def test_compose_postgres_keeps_data_and_reports_health(compose: dict[str, Any]) -> None:
    pg = _services(compose)["postgres"]
    volume, mount = pg["volumes"][0].split(":")
    assert mount == "/var/lib/postgresql/data"
    assert volume in compose["volumes"], "postgres data must live in a named volume"
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert "ports" not in pg, "postgres is reached over the compose network only"


def test_compose_commands_and_start_order(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert services["api"]["command"] == ["ringlab", "serve", "--no-scheduler"]
    assert services["scheduler"]["command"] == ["ringlab", "scheduler"]
    head = services["ray-head"]["command"]
    assert head[:3] == ["ray", "start", "--head"] and "--block" in head
    assert "--port=6380" in head, "6379 is taken by Redis on such hosts"
    worker = services["ray-gpu-worker"]["command"]
    assert worker[:2] == ["ray", "start"] and "--address=ray-head:6380" in worker
    assert "--block" in worker

    depends = {name: svc.get("depends_on", {}) for name, svc in services.items()}
    assert depends["api"]["postgres"] == {"condition": "service_healthy"}
    assert depends["api"]["ray-head"] == {"condition": "service_healthy"}
    # The api migrates the schema before it answers; the scheduler waits for that.
    assert depends["scheduler"]["api"] == {"condition": "service_healthy"}
    assert depends["ray-gpu-worker"]["ray-head"] == {"condition": "service_healthy"}
    for name, deps in depends.items():
        for dep, cond in deps.items():
            assert "healthcheck" in services[dep], f"{name} waits on {dep}: no healthcheck"
            assert cond["condition"] == "service_healthy"
    api_check = " ".join(services["api"]["healthcheck"]["test"])
    assert "/api/v1/healthz" in api_check
    assert "ray" in services["ray-head"]["healthcheck"]["test"]


def test_compose_reserves_gpus_for_the_worker(compose: dict[str, Any]) -> None:
    services = _services(compose)
    devices = services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [
        {"driver": "nvidia", "count": "${RINGLAB_GPU_COUNT:-all}", "capabilities": ["gpu"]}
    ]
    for name in ("api", "scheduler", "ray-head", "postgres"):
        assert "deploy" not in services[name], f"{name} must not hold GPUs"
    assert "--num-gpus=0" in services["ray-head"]["command"]


def test_compose_ports_bind_localhost_by_default(compose: dict[str, Any]) -> None:
    published = {name: svc["ports"] for name, svc in _services(compose).items() if svc.get("ports")}
    assert set(published) == {"api", "ray-head"}
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("${RINGLAB_BIND:-127.0.0.1}:"), f"{name} publishes {port}"
            default = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", port)
            assert default.split(":")[0] == "127.0.0.1", default
    assert published["api"] == ["${RINGLAB_BIND:-127.0.0.1}:${RINGLAB_API_PORT:-8000}:8000"]


def test_compose_wires_database_ray_and_secrets(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name in RINGLAB_SERVICES:
        svc = services[name]
        env = svc["environment"]
        assert env["RINGLAB_DATABASE_URL"] == "postgresql://ringlab@postgres:5432/ringlab"
        assert env["RINGLAB_RAY_ADDRESS"] == "ray-head:6380"
        assert env["RAY_AUTH_MODE"] == "token"
        assert svc["env_file"] == "deploy/ringlab.env"
        # Secrets come from the env file only, never from the compose file itself.
        assert not {"RINGLAB_API_TOKEN", "RAY_AUTH_TOKEN", "PGPASSWORD"} & set(env)
    # A Ray driver needs a local raylet: the api and scheduler containers join as empty nodes.
    for name in ("api", "scheduler"):
        assert services[name]["environment"]["RINGLAB_JOIN_RAY"] == "1"
    for name in ("ray-head", "ray-gpu-worker"):
        assert "RINGLAB_JOIN_RAY" not in services[name]["environment"]
    pg = services["postgres"]
    assert pg["env_file"] == "deploy/ringlab.env"
    user = pg["environment"]["POSTGRES_USER"]
    db = pg["environment"]["POSTGRES_DB"]
    url = services["api"]["environment"]["RINGLAB_DATABASE_URL"]
    assert url.endswith(f"{user}@postgres:5432/{db}")


def test_env_example_lists_every_secret_the_services_read() -> None:
    example = (ROOT / "deploy" / "ringlab.env.example").read_text()
    keys = dict(line.split("=", 1) for line in example.splitlines() if re.match(r"^[A-Z_]+=", line))
    for key in ("RINGLAB_API_TOKEN", "POSTGRES_PASSWORD", "PGPASSWORD", "RAY_AUTH_TOKEN"):
        assert keys[key].startswith("change-me"), key
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "deploy/ringlab.env" in ignored, "secrets must not enter the image"


def test_dockerfile_installs_with_the_one_install_step() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+$", text, re.M)
    assert "FROM ${BASE_IMAGE}" in text
    assert "COPY constraints.txt" in text
    installs = re.findall(r"bash scripts/install\.sh (\S+)", text)
    assert installs == ["/opt/ringlab/bin/python", "/opt/ringlab/bin/python"]
    # No second source of truth for pins: every pip call goes through scripts/install.sh.
    assert "pip install" not in text
    assert "ARG TORCH_INDEX_URL=" in text and "--extra-index-url" in text
    assert "REQUIRE_CUDA_TORCH" in text and "torch.version.cuda" in text
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "-c constraints.txt" in install


def test_docker_context_holds_every_package() -> None:
    """Every directory pyproject installs from reaches the image (.dockerignore spares it)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    dirs = {package_dir.get(p, p.replace(".", "/")) for p in setuptools["packages"]}
    dirs |= {"pyproject.toml", "README.md", "constraints.txt", "scripts/install.sh"}
    dirs.add("deploy/docker-entrypoint.sh")
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in sorted(dirs):
        assert (ROOT / path).exists(), path
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hits = [p for p in patterns for pre in prefixes if fnmatch.fnmatch(pre, p)]
        assert not hits, f"{path} is excluded from the build context by {hits}"


def _prepared(path: Path) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_passes_rays_validation(path: Path) -> None:
    from ray.autoscaler._private.util import validate_config

    config = _prepared(path)
    validate_config(config)  # what `ray up` runs before it touches a machine

    head = " ".join(config["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head --port=6380" in head
    assert "deploy/start-head-services.sh" in head
    workers = " ".join(config["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6380" in workers and "RAY_AUTH_MODE=token" in workers
    setup = " ".join(config["setup_commands"])
    assert "scripts/install.sh" in setup
    assert "torch.cuda.is_available()" in " ".join(config["worker_setup_commands"])
    mounts = config["file_mounts"]
    assert mounts["~/ringlab"] == "." and mounts["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_cluster_validation_rejects_a_broken_file() -> None:
    """The check above has teeth: Ray's schema refuses an unknown key."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    config = copy.deepcopy(_prepared(CLUSTER_FILES[0]))
    config["head_start_ray_command"] = config.pop("head_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_local_cluster_file_lists_head_and_workers() -> None:
    raw = yaml.safe_load(CLUSTER_FILES[0].read_text())
    assert raw["provider"]["type"] == "local"
    assert raw["provider"]["head_ip"] and raw["provider"]["worker_ips"]
    aws = yaml.safe_load(CLUSTER_FILES[1].read_text())
    assert aws["provider"]["type"] == "aws"
    gpu_types = [t for t in aws["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu_types and all(t["max_workers"] >= 1 for t in gpu_types)


def _run_script(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": env["HOME"]}
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / script), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_entrypoint_refuses_example_secrets(tmp_path: Path) -> None:
    bad = _run_script(
        "docker-entrypoint.sh", {"HOME": str(tmp_path), "RINGLAB_API_TOKEN": "change-me-x"}, "true"
    )
    assert bad.returncode == 1 and "RINGLAB_API_TOKEN" in bad.stderr
    good = {"HOME": str(tmp_path), "RINGLAB_API_TOKEN": "s3cret"}
    ok = _run_script("docker-entrypoint.sh", good, "echo", "ran")
    assert ok.returncode == 0 and ok.stdout.strip() == "ran"
    no_addr = _run_script(
        "docker-entrypoint.sh", {"HOME": str(tmp_path), "RINGLAB_JOIN_RAY": "1"}, "true"
    )
    assert no_addr.returncode != 0 and "RINGLAB_RAY_ADDRESS" in no_addr.stderr


def test_head_services_script_refuses_to_start_unconfigured(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "RINGLAB_LOG_DIR": str(tmp_path / "logs")}
    missing = _run_script("start-head-services.sh", env)
    assert missing.returncode == 1 and "ringlab.env is missing" in missing.stderr

    env_file = tmp_path / "ringlab.env"
    env_file.write_text("RINGLAB_API_TOKEN=s3cret\n")
    no_db = _run_script("start-head-services.sh", env)
    assert no_db.returncode != 0 and "RINGLAB_DATABASE_URL" in no_db.stderr

    env_file.write_text(
        "RINGLAB_DATABASE_URL=postgresql://ringlab@db/ringlab\nRINGLAB_API_TOKEN=change-me-api\n"
    )
    example = _run_script("start-head-services.sh", env)
    assert example.returncode == 1 and "change-me" in example.stderr

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("file-token")
    env_file.write_text(
        "RINGLAB_DATABASE_URL=postgresql://ringlab@db/ringlab\nRAY_AUTH_TOKEN=other-token\n"
    )
    mismatch = _run_script("start-head-services.sh", env)
    assert mismatch.returncode == 1 and "differs" in mismatch.stderr
    assert not list((tmp_path / "logs").glob("*.pid")), "nothing may start on a refused config"
