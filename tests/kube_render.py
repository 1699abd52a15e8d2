"""Renders the kustomizations under ``deploy/kubernetes`` as kustomize does, for the subset
they use, so the tests need no ``kubectl``.

The subset, where kustomize's result is fully determined: ``resources`` (YAML files inside
the kustomization's folder, or folders holding another kustomization) and ``patches`` that
are JSON 6902 operations (``add``, ``replace``, ``remove``) on the objects a target picks by
group, version, kind and name. Any other field in a kustomization.yaml is refused, so a
manifest cannot come to depend on a feature this renderer does not copy faithfully;
``test_kubernetes`` also compares the result with ``kubectl kustomize`` where kubectl exists.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, NamedTuple

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches"}


class ObjectId(NamedTuple):
    api_version: str
    kind: str
    namespace: str | None
    name: str


def object_id(obj: dict[str, Any]) -> ObjectId:
    meta = obj["metadata"]
    return ObjectId(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``folder``; raises ValueError on what kustomize
    would refuse too (duplicate objects, files outside the folder, a patch matching nothing)."""
    folder = folder.resolve()
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    if set(spec) - SUPPORTED:
        raise ValueError(f"{folder}: unsupported kustomization fields {sorted(set(spec) - SUPPORTED)}")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        objects += render(path) if path.is_dir() else load_objects(_inside(folder, path))
    ids = [object_id(o) for o in objects]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{folder}: objects defined twice: {sorted({i for i in ids if ids.count(i) > 1})}")
    for patch in spec.get("patches", []):
        ops = yaml.safe_load(_inside(folder, (folder / patch["path"]).resolve()).read_text())
        targets = [o for o in objects if _targets(o, patch["target"])]
        if not targets:
            raise ValueError(f"{folder}: patch {patch['path']} matches no object")
        for obj in targets:
            for op in ops:
                apply_op(obj, op)
    return objects


def load_objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def apply_op(obj: dict[str, Any], op: dict[str, Any]) -> None:
    """One JSON 6902 operation (RFC 6901 pointer), in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] == "remove":
        del node[key]
    elif op["op"] == "replace":
        if isinstance(node, dict) and key not in node:
            raise KeyError(f"replace of a missing {op['path']}")
        node[key] = copy.deepcopy(op["value"])
    elif op["op"] == "add":
        if isinstance(node, list):
            node.insert(len(node) if key == "-" else key, copy.deepcopy(op["value"]))
        else:
            node[key] = copy.deepcopy(op["value"])
    else:
        raise ValueError(f"unsupported JSON 6902 op {op['op']!r}")


def _targets(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    if set(target) - set(wanted):
        raise ValueError(f"unsupported patch target fields {sorted(set(target) - set(wanted))}")
    return all(wanted[k] == v for k, v in target.items())


def _inside(folder: Path, path: Path) -> Path:
    """kustomize's default load restriction: a file must lie inside the kustomization."""
    if not path.is_relative_to(folder):
        raise ValueError(f"{path} lies outside {folder}")
    return path
