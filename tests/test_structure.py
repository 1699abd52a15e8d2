"""The import graph points one way: cli → {services, loadtest} → common → kernels.

Checked from the source (ast), so a new import against the grain fails here, not in a
reviewer's head. Also: nobody imports another module's ``_private`` names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {  # package -> packages it must never import
    "kernels": {"common", "services", "loadtest", "cli"},
    "common": {"services", "loadtest", "cli"},
    "services": {"loadtest", "cli"},
    "loadtest": {"services", "cli"},
}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_against_the_grain(package: str):
    bad = [f"{path.relative_to(ROOT)}: {module}" for path in sources(package)
           for module, _ in imports(path) if module.split(".")[0] in LAYERS[package]]
    assert bad == []


def test_nobody_imports_private_names_of_another_module():
    bad = []
    for path in sources("cli", "common", "services", "kernels", "loadtest", "tests"):
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for module, names in imports(path):
            if module.split(".")[0] not in LAYERS | {"cli": set(), "tests": set()} or module == own:
                continue
            bad += [f"{path.relative_to(ROOT)}: {module}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def module_aliases(path: Path) -> set[str]:
    """Local names bound to project modules (``from services import launcher`` → launcher)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LAYERS:
            names |= {a.asname or a.name for a in node.names if (ROOT / node.module.replace(".", "/")
                                                                   / f"{a.name}.py").is_file()}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in LAYERS}
    return names


def test_nobody_reaches_into_another_module_for_private_names():
    bad = []
    for path in sources("cli", "common", "services", "kernels", "loadtest", "tests"):
        aliases = module_aliases(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert bad == []


def test_the_connector_interface_does_not_import_its_transports():
    names = {module for module, _ in imports(ROOT / "common/connector/base.py")}
    assert not any(m.startswith(("common.connector.zmq", "common.connector.ucx")) for m in names)


def test_the_router_command_does_not_load_torch():
    """A supervised router restart is only as quick as the router starts: torch alone takes
    seconds to import on a loaded machine, and the router never needs it."""
    code = ("import sys; from cli.main import build_parser; build_parser(); "
            "import services.router.service; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# Imported by the product but not its own runtime dependency, each for a reason: fastapi
# brings starlette; Triton and UCX are for machines that have them (imported only there).
NOT_RUNTIME_DEPENDENCIES = {"starlette", "triton", "ucxx-cu12"}


def test_every_package_the_product_imports_is_a_runtime_dependency():
    """A package only the dev extra installs passes every test and fails a user's plain
    ./setup.sh (jsonschema did: every request with tools was a 500). Imports inside
    functions count too."""
    import importlib.metadata
    import re

    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    runtime = {re.split(r"[<>=!~;\[ ]", d)[0].lower().replace("_", "-") for d in declared}
    dists = importlib.metadata.packages_distributions()
    first_party = {"cli", "common", "services", "kernels", "loadtest", "tests"}
    missing: dict[str, set[str]] = {}
    for top in ("common", "services", "cli", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    module = name.split(".")[0]
                    if module in first_party or module in sys.stdlib_module_names:
                        continue
                    for dist in dists.get(module, [module]):
                        dist = dist.lower().replace("_", "-")
                        if dist not in runtime and dist not in NOT_RUNTIME_DEPENDENCIES:
                            missing.setdefault(dist, set()).add(str(path.relative_to(ROOT)))
    assert missing == {}


def test_no_installed_distribution_shadows_or_is_shadowed_by_our_packages():
    """Our top-level packages are found first on the path, so another distribution with a
    top-level module of the same name is broken for everyone who imports it: transformers
    5.25 made Hugging Face's ``kernels`` a dependency and imported it at startup, where it
    found ours (every model config import failed). pyproject.toml keeps transformers below
    5.25; this fails the day another dependency brings such a name in."""
    import importlib.metadata

    dists = importlib.metadata.packages_distributions()
    ours = ("cli", "common", "kernels", "loadtest", "services")
    clashes = {name: sorted(set(dists.get(name, [])) - {"tandem"}) for name in ours}
    assert {name: others for name, others in clashes.items() if others} == {}
