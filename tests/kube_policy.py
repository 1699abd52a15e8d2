"""Which ingress flows a set of NetworkPolicies admits, by the Kubernetes rules: a pod that
no policy selects admits everything; a selected pod admits a connection when some rule of
some selecting policy matches both its source (``from`` peers: pod and namespace
selectors, ipBlocks) and its port (number, or a named container port). Enough of the
semantics for ``test_kubernetes``; egress is not modelled (our policies leave it open).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Peer(NamedTuple):
    """A pod as policies see it: its namespace's labels and its own."""

    namespace: str
    namespace_labels: dict[str, str]
    labels: dict[str, str]
    in_cluster: bool = True  # False: a client outside the cluster (only ipBlocks match it)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, and matchExpressions with In / NotIn / Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if op not in ("In", "NotIn", "Exists"):
            raise ValueError(f"unsupported operator {op}")
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) \
                or (op == "Exists" and value is None):
            return False
    return True


def admitted(policies: list[dict[str, Any]], source: Peer, target: Peer, port: int,
             named_ports: dict[str, int]) -> bool:
    """Whether ``source`` may open a TCP connection to ``target``'s ``port``."""
    selecting = [p for p in policies if p["metadata"].get("namespace") == target.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return True
    return any(_rule_admits(rule, p["metadata"]["namespace"], source, port, named_ports)
               for p in selecting for rule in p["spec"].get("ingress", []))


def _rule_admits(rule: dict[str, Any], namespace: str, source: Peer, port: int,
                 named_ports: dict[str, int]) -> bool:
    ports = rule.get("ports")
    if ports and not any(_port_matches(p, port, named_ports) for p in ports):
        return False
    peers = rule.get("from")
    return not peers or any(_peer_matches(p, namespace, source) for p in peers)


def _port_matches(spec: dict[str, Any], port: int, named_ports: dict[str, int]) -> bool:
    if spec.get("protocol", "TCP") != "TCP":
        return False
    wanted = spec.get("port")
    if wanted is None:
        return True
    number = named_ports.get(wanted) if isinstance(wanted, str) else wanted
    return number == port or (number is not None and number <= port <= spec.get("endPort", number))


def _peer_matches(peer: dict[str, Any], namespace: str, source: Peer) -> bool:
    if "ipBlock" in peer:
        return True  # any address we model may fall in a block: treat as open, stricter for us
    if not source.in_cluster:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)
