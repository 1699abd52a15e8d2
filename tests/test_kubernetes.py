"""Offline checks of deploy/kubernetes: every rendered object against its schema (Kubernetes
KUBERNETES_VERSION through kubernetes-validate; CRDs through their published schemas
vendored in tests/kubernetes_schemas), and the deployment's invariants: probes and
resources on every container, only the gateway reachable from outside, selectors that
select, ports that agree with the flags the real argparse parsers read, grace periods that
outlast the drain, autoscalers on metrics the workers export.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from tests.extras import require_module
from tests.kube_policy import Peer, admitted, selects
from tests.kube_render import object_id, render

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "kubernetes_schemas"
KUBERNETES_VERSION = "1.31"
KUSTOMIZATIONS = ("base", "monitoring", "overlays/hpa", "overlays/keda", "overlays/inference-gateway")
CRD_SCHEMAS = {  # (apiVersion, kind) -> vendored schema (sources: kubernetes_schemas/SOURCES.md)
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh-v1alpha1-scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com-v1-servicemonitor.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io-v1-httproute.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io-v1-inferencepool.json",
}
ROLES = ("gateway", "router", "prefill", "decode")
WORKERS = ("prefill", "decode")
COMPONENT = "app.kubernetes.io/component"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(DEPLOY / name) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def base(rendered) -> list[dict[str, Any]]:
    return rendered["base"]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def deployment(objects: list[dict], role: str) -> dict:
    (found,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == f"tandem-{role}"]
    return found


def container(objects: list[dict], role: str) -> dict:
    (only,) = deployment(objects, role)["spec"]["template"]["spec"]["containers"]
    return only


# ---- schemas ----------------------------------------------------------------------------

def strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as the API server's strict field validation
    does (CRDs prune them silently otherwise): objects with properties and no
    additionalProperties or x-kubernetes-preserve-unknown-fields get additionalProperties false."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_crd(obj: dict) -> None:
    jsonschema = require_module("jsonschema")
    schema = strict(json.loads((SCHEMAS / CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]).read_text()))
    jsonschema.Draft202012Validator(schema).validate(obj)


@pytest.fixture(scope="module")
def validated() -> set[str]:
    """Objects already validated (the base's recur in every overlay)."""
    return set()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates_against_its_schema(rendered, validated, name):
    kv = require_module("kubernetes_validate")
    for obj in rendered[name]:
        key = json.dumps(obj, sort_keys=True)
        if key in validated:
            continue
        validated.add(key)
        if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
            validate_crd(obj)
        else:  # a kind with no schema at all raises SchemaNotFoundError: nothing goes unchecked
            kv.validate(obj, KUBERNETES_VERSION, strict=True)


def test_strict_schemas_refuse_a_misspelt_field(base):
    kv = require_module("kubernetes_validate")
    bad = json.loads(json.dumps(deployment(base, "decode")))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, KUBERNETES_VERSION, strict=True)
    (monitor, _) = of_kind(render(DEPLOY / "monitoring"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(require_module("jsonschema").ValidationError):
        validate_crd(monitor)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kubectl_kustomize_renders_the_same_objects(rendered, name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: the renderer alone is checked")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / name)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    theirs = sorted((o for o in yaml.safe_load_all(out) if o), key=object_id)
    assert theirs == sorted(rendered[name], key=object_id)


# ---- containers -------------------------------------------------------------------------

def test_every_container_has_probes_and_resources(rendered):
    for name, objects in rendered.items():
        for d in of_kind(objects, "Deployment"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                where = f"{name}: {d['metadata']['name']}/{c['name']}"
                assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(c), where
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"].get(kind, {})), where


def test_workers_use_as_many_threads_as_their_cpu_limit(base):
    config = {c["metadata"]["name"]: c["data"] for c in of_kind(base, "ConfigMap")}
    for role in WORKERS:
        env = container_env(container(base, role), config)
        assert env["TANDEM_THREADS"] == container(base, role)["resources"]["limits"]["cpu"]
        assert env["TANDEM_KV_SHM"] == "off"  # pods share no /dev/shm


def container_env(c: dict, config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment; downward-API values as ``<fieldPath>``, Secrets left out
    (they are optional: the service runs without them)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = f"<{var['valueFrom']['fieldRef']['fieldPath']}>"
        else:
            assert var["valueFrom"]["secretKeyRef"].get("optional") is True, var
    return env


@pytest.fixture(scope="module")
def parsed(base) -> dict[str, argparse.Namespace]:
    """Each role's args as the service's real argparse parser reads them, with the
    container's environment in place (flags default to TANDEM_* variables)."""
    from services import commands

    config = {c["metadata"]["name"]: c["data"] for c in of_kind(base, "ConfigMap")}
    out = {}
    for role in ROLES:
        c = container(base, role)
        with environment(container_env(c, config)):
            parser = argparse.ArgumentParser()
            commands.add_service_parsers(parser.add_subparsers(dest="command", required=True))
            out[role] = parser.parse_args(c["args"])
        assert out[role].command == role and c["image"] == "tandem:latest"
    return out


def environment(env: dict[str, str]) -> mock._patch_dict:
    cleared = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return mock.patch.dict(os.environ, {**cleared, **env}, clear=True)


def port_numbers(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_container_ports_are_the_ports_of_the_flags(base, parsed):
    flags = {"router": {"router": "port", "metrics": "metrics_port"},
             "gateway": {"http": "port", "stream": "stream_port"},
             "prefill": {"metrics": "metrics_port"},
             "decode": {"kv": "kv_port", "metrics": "metrics_port"}}
    for role, names in flags.items():
        assert port_numbers(container(base, role)) == {n: getattr(parsed[role], f) for n, f in names.items()}
        assert parsed[role].host == "0.0.0.0"  # reachable on the pod IP


def test_probes_reach_each_roles_health_port(base):
    health = {"router": "metrics", "prefill": "metrics", "decode": "metrics", "gateway": "http"}
    for role, port in health.items():
        c = container(base, role)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            action = c[probe].get("httpGet") or c[probe]["tcpSocket"]
            assert action["port"] in (port, port_numbers(c)[port]), (role, probe)
            assert action.get("path", "/health") in ("/health", "/ready"), (role, probe)


def test_workers_and_gateways_advertise_their_pod_ip_and_dial_the_router_service(base, parsed):
    (service,) = [s for s in of_kind(base, "Service") if s["metadata"]["name"] == "tandem-router"]
    port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["router"]
    for role in ("gateway", *WORKERS):
        assert parsed[role].router == f"tcp://{service['metadata']['name']}:{port}"
        assert parsed[role].advertise_host == "<status.podIP>"


def test_service_target_ports_name_container_ports(rendered):
    for objects in rendered.values():
        pods = {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(objects, "Deployment")}
        for s in of_kind(objects, "Service"):
            (template,) = [t for t in pods.values() if selects({"matchLabels": s["spec"]["selector"]},
                                                               t["metadata"]["labels"])]
            (c,) = template["spec"]["containers"]
            for p in s["spec"]["ports"]:
                assert port_numbers(c)[p["targetPort"]] == p["port"], (s["metadata"]["name"], p)


def test_termination_grace_outlasts_prestop_and_drain(base, parsed):
    config = {c["metadata"]["name"]: c["data"] for c in of_kind(base, "ConfigMap")}
    for role in WORKERS:
        c = container(base, role)
        drain = getattr(parsed[role], "drain_timeout", None)  # the flag, once the CLI has it
        if drain is None:
            drain = float(container_env(c, config)["TANDEM_DRAIN_TIMEOUT"])
        grace = deployment(base, role)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > prestop_seconds(c) + drain, role
    gateway = deployment(base, "gateway")["spec"]["template"]["spec"]
    assert gateway["terminationGracePeriodSeconds"] > prestop_seconds(gateway["containers"][0])


def prestop_seconds(c: dict) -> float:
    hook = c["lifecycle"]["preStop"]
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


def test_ingress_waits_longer_than_the_gateway_on_a_quiet_stream(base, parsed):
    (ingress,) = of_kind(base, "Ingress")
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert float(notes[f"nginx.ingress.kubernetes.io/{timeout}"]) > parsed["gateway"].request_timeout


# ---- exposure ---------------------------------------------------------------------------

def peers(objects: list[dict]) -> dict[str, Peer]:
    """A pod of each role, Prometheus in the monitoring namespace, a pod in another
    namespace, and a client outside the cluster."""
    out = {role: Peer("tandem", {"kubernetes.io/metadata.name": "tandem"},
                      deployment(objects, role)["spec"]["template"]["metadata"]["labels"])
           for role in ROLES}
    out["monitoring"] = Peer("monitoring", {"kubernetes.io/metadata.name": "monitoring"},
                             {"app.kubernetes.io/name": "prometheus"})
    out["elsewhere"] = Peer("apps", {"kubernetes.io/metadata.name": "apps"}, {"app": "client"})
    out["outside"] = Peer("", {}, {}, in_cluster=False)
    return out


def test_network_policies_admit_exactly_the_flows_tandem_uses(base):
    policies = of_kind(base, "NetworkPolicy")
    everyone = {"gateway", "router", "prefill", "decode", "monitoring", "elsewhere", "outside"}
    expected = {("gateway", 8000): everyone,  # the one way in
                ("gateway", 7300): {"prefill", "decode"},
                ("router", 7100): {"gateway", "prefill", "decode"},
                ("router", 9100): {"monitoring"}, ("prefill", 9100): {"monitoring"},
                ("decode", 7200): {"prefill"}, ("decode", 9100): {"monitoring"}}
    who = peers(base)
    for role in ROLES:
        ports = port_numbers(container(base, role))
        for port in ports.values():
            allowed = {name for name, source in who.items()
                       if name != role and admitted(policies, source, who[role], port, ports)}
            assert allowed == expected[(role, port)] - {role}, (role, port)


def test_only_the_gateway_is_exposed(rendered):
    for name, objects in rendered.items():
        assert {s["spec"].get("type", "ClusterIP") for s in of_kind(objects, "Service")} <= {"ClusterIP"}
        for ingress in of_kind(objects, "Ingress"):
            backends = {path["backend"]["service"]["name"] for rule in ingress["spec"]["rules"]
                        for path in rule["http"]["paths"]}
            assert backends == {"tandem-gateway"}, name
        for pool in of_kind(objects, "InferencePool"):
            assert pool["spec"]["selector"]["matchLabels"][COMPONENT] == "gateway"


# ---- selectors --------------------------------------------------------------------------

def test_every_selector_selects_one_deployment(rendered):
    for name, objects in rendered.items():
        labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                  for d in of_kind(objects, "Deployment")}
        for d in of_kind(objects, "Deployment"):
            assert selects(d["spec"]["selector"], labels[d["metadata"]["name"]])
        selectors = [("Service", s["metadata"]["name"], {"matchLabels": s["spec"]["selector"]})
                     for s in of_kind(objects, "Service")]
        selectors += [(k, o["metadata"]["name"], o["spec"]["selector"])
                      for k in ("PodDisruptionBudget", "InferencePool") for o in of_kind(objects, k)]
        selectors += [("NetworkPolicy", p["metadata"]["name"], p["spec"]["podSelector"])
                      for p in of_kind(objects, "NetworkPolicy") if p["spec"].get("ingress")]
        for kind, obj, selector in selectors:
            hits = [d for d, lab in labels.items() if selects(selector, lab)]
            assert len(hits) == 1, (name, kind, obj, hits)


def test_monitors_and_routes_point_at_objects_that_exist(rendered):
    for name, objects in rendered.items():
        services = of_kind(objects, "Service") or of_kind(rendered["base"], "Service")
        for monitor in of_kind(objects, "ServiceMonitor"):
            ports = {p["name"] for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
                     for p in s["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports, (name, monitor["metadata"]["name"])
        pools = {p["metadata"]["name"] for p in of_kind(objects, "InferencePool")}
        for route in of_kind(objects, "HTTPRoute"):
            assert {b["name"] for r in route["spec"]["rules"] for b in r["backendRefs"]} <= pools


def test_the_router_is_one_replica_replaced_never_rolled(rendered):
    for name, objects in rendered.items():
        if not of_kind(objects, "Deployment"):
            continue
        router = deployment(objects, "router")["spec"]
        assert router["replicas"] == 1 and router["strategy"] == {"type": "Recreate"}, name
        budgets = [b for b in of_kind(objects, "PodDisruptionBudget")
                   if selects(b["spec"]["selector"], router["template"]["metadata"]["labels"])]
        assert budgets == [] and "tandem-router" not in scale_targets(objects), name


# ---- autoscaling ------------------------------------------------------------------------

def scale_targets(objects: list[dict]) -> dict[str, dict]:
    """Deployment name -> the HPA or ScaledObject that scales it."""
    out = {}
    for scaler in of_kind(objects, "HorizontalPodAutoscaler") + of_kind(objects, "ScaledObject"):
        ref = scaler["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment" and ref["name"] not in out
        out[ref["name"]] = scaler
    return out


def worker_metric_names() -> set[str]:
    """The Prometheus names a worker exports (prefill and decode build the same set)."""
    from prometheus_client import CollectorRegistry

    from common.metrics import EngineMetrics

    registry = CollectorRegistry()
    EngineMetrics(registry, "m")
    return {metric.name for metric in registry.collect()}


def adapter_rules(objects: list[dict]) -> dict[str, str]:
    """Custom-metrics API name -> the Prometheus series it comes from."""
    (config,) = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"] == "tandem-prometheus-adapter"]
    out = {}
    for rule in yaml.safe_load(config["data"]["config.yaml"])["rules"]:
        series = re.match(r"'?([a-z_:]+)\{", rule["seriesQuery"]).group(1)
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        out[re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)] = series
    return out


SCALED_ON = {"tandem-prefill": "tandem:num_requests_waiting", "tandem-decode": "tandem:kv_cache_usage_perc"}


def test_hpas_scale_each_worker_role_on_its_own_exported_metric(rendered):
    objects = rendered["overlays/hpa"]
    rules, exported = adapter_rules(objects), worker_metric_names()
    assert set(rules.values()) <= exported
    targets = scale_targets(objects)
    assert set(targets) == set(SCALED_ON)
    for name, hpa in targets.items():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and rules[metric["pods"]["metric"]["name"]] == SCALED_ON[name]
        assert hpa["spec"]["minReplicas"] >= 1


def test_scaled_objects_query_the_metrics_the_workers_export(rendered):
    objects, exported = rendered["overlays/keda"], worker_metric_names()
    targets = scale_targets(objects)
    assert set(targets) == set(SCALED_ON)
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    for name, scaled in targets.items():
        (trigger,) = scaled["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert set(re.findall(r"tandem:[a-z_]+", query)) == {SCALED_ON[name]} <= exported
        service = re.search(r'service="([^"]+)"', query).group(1)
        assert selects({"matchLabels": services[service]["spec"]["selector"]},
                       deployment(objects, name.removeprefix("tandem-"))["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", ["overlays/hpa", "overlays/keda"])
def test_autoscaled_deployments_leave_the_replica_count_to_the_autoscaler(rendered, name):
    for target in scale_targets(rendered[name]):
        assert "replicas" not in deployment(rendered[name], target.removeprefix("tandem-"))["spec"]
