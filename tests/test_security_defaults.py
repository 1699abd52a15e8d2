"""Security defaults, checked from the definitions themselves: internal services bind to
loopback unless told otherwise, compose publishes only the gateway, nothing unpickles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from cli.main import build_parser
from common.flags import default_of
from services.gateway.settings import GatewaySettings
from services.router.service import RouterSettings
from services.worker import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", ["router", "prefill", "decode", "worker", "gateway", "up"])
def test_every_service_binds_to_loopback_by_default(command, monkeypatch):
    monkeypatch.delenv("TANDEM_HOST", raising=False)
    args = build_parser().parse_args([command])
    assert args.host == "127.0.0.1"


def test_settings_default_to_loopback_addresses():
    assert "127.0.0.1" in default_of(RouterSettings, "bind")
    assert default_of(RouterSettings, "metrics_host") == "127.0.0.1"
    assert default_of(WorkerSettings, "metrics_host") == "127.0.0.1"
    assert default_of(WorkerSettings, "advertise_host") == "127.0.0.1"
    assert "127.0.0.1" in default_of(GatewaySettings, "stream_bind")


def test_compose_publishes_only_the_gateway():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"gateway"}


def test_no_module_deserialises_with_pickle():
    unsafe = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"}
    bad = []
    for path in sorted(p for pkg in ("cli", "common", "services", "kernels", "loadtest")
                       for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in unsafe]
    assert bad == []
