"""GatewaySettings refuses bad values when made, and `tandem gateway` says so in one line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.app import GatewaySettings

ROUTER = "tcp://127.0.0.1:7100"


def test_the_defaults_are_valid():
    s = GatewaySettings(router=ROUTER)
    assert s.request_timeout > 0 and s.admission_timeout > 0 and s.api_key is None


@pytest.mark.parametrize("field,value", [
    ("router", ""),
    ("router", "127.0.0.1:7100"),  # no scheme: ZMQ would refuse it only at connect
    ("stream_bind", "localhost"),
    ("advertise_host", ""),
    ("api_key", ""),
    ("api_key", "two words"),
    ("api_key", "s\u00e9cret"),
    ("api_key", "line\nbreak"),
    ("served_model_name", ""),
    ("max_model_len", 0),
    ("max_model_len", -5),
    ("max_model_len", 1.5),
    ("request_timeout", 0),
    ("request_timeout", -1.0),
    ("request_timeout", math.nan),
    ("request_timeout", math.inf),
    ("admission_timeout", 0.0),
    ("admission_timeout", True),
])
def test_a_bad_value_is_a_value_error_naming_the_field(field, value):
    kwargs = {"router": ROUTER, field: value}
    with pytest.raises(ValueError, match=field):
        GatewaySettings(**kwargs)


def test_good_values_are_kept():
    s = GatewaySettings(router="ipc:///tmp/router", api_key="sk-abc_123", max_model_len=64,
                        served_model_name="m", request_timeout=0.5, admission_timeout=3)
    assert (s.api_key, s.max_model_len, s.request_timeout) == ("sk-abc_123", 64, 0.5)


def test_the_cli_reports_a_bad_setting_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "cli", "gateway", "--router", ROUTER,
                           "--request-timeout", "0"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "request_timeout" in lines[0], proc.stderr
