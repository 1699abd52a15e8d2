"""``/dashboard`` in a real headless Chromium against a real tiny P/D cluster: the page
shows every worker with its role and health, then — while it stays open, polling —
requests sent to the cluster appear with their queue → prefill → transfer → decode
phases and the workers that served them; a dead router shows as unreachable."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.browser import Browser, chromium
from tests.cluster import Cluster
from tests.extras import missing


@pytest.fixture(autouse=True)
def _chromium_installed() -> None:
    if chromium() is None:
        missing("Debian's chromium (./setup.sh --dev installs it)")

WORKERS_JS = """JSON.stringify(Array.from(document.querySelectorAll('tr.worker'))
  .map(r => [r.dataset.workerId, r.dataset.role, r.dataset.health]))"""
REQUESTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#requests .request'))
  .map(r => ({id: r.dataset.requestId, phase: r.dataset.phase,
              segments: Array.from(r.querySelectorAll('.seg'))
                .map(s => [s.dataset.phase, Number(s.dataset.seconds)]),
              served: r.querySelector('.served').textContent})))"""
POLLS_JS = "Number(document.getElementById('poll').dataset.polls)"


def rows(browser: Browser, js: str) -> list:
    return json.loads(browser.evaluate(js))


def test_the_dashboard_shows_the_workers_and_each_requests_phases_live(tiny_model_dir, tmp_path):
    # A short drain: with the router killed below, the workers' drain at exit waits it out.
    extra = ("--num-kv-blocks", "512", "--drain-timeout", "2")
    with Cluster(str(tiny_model_dir), extra=extra) as cluster, Browser() as browser:
        browser.open(f"{cluster.url}/dashboard")
        browser.wait_for(f"{WORKERS_JS}.includes('decode-0') && {WORKERS_JS}.includes('prefill-0')",
                         "both workers on the page")
        assert sorted(rows(browser, WORKERS_JS)) == [["decode-0", "decode", "ok"],
                                                     ["prefill-0", "prefill", "ok"]]
        assert rows(browser, REQUESTS_JS) == []
        polls = browser.evaluate(POLLS_JS)

        # Traffic while the page stays open: its polls pick the requests up.
        ids = []
        for i in range(2):
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
                "prompt": f"dashboard request {i}", "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        shown = " && ".join(f"{REQUESTS_JS}.includes('{i}')" for i in ids)
        browser.wait_for(shown, "the requests in the timeline")
        by_id = {row["id"]: row for row in rows(browser, REQUESTS_JS)}
        for request_id in ids:
            row = by_id[request_id]
            assert row["phase"] == "length"  # ignore_eos: ran to max_tokens
            assert [p for p, _ in row["segments"]] == ["queue", "prefill", "transfer", "decode"]
            assert all(seconds >= 0 for _, seconds in row["segments"])
            assert row["segments"][3][1] > 0  # five more tokens took some time
            assert "6 tok" in row["served"] and "prefill-0 → decode-0" in row["served"]
        assert browser.evaluate(POLLS_JS) > polls  # it kept polling: a live page
        png = browser.screenshot(tmp_path / "dashboard.png")
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000

        # The router dies: the page says so, and keeps the workers it last saw.
        cluster.router.proc.kill()
        cluster.router.proc.wait(30)
        browser.wait_for("document.getElementById('router').dataset.reachable === 'false'",
                         "the page to show the router unreachable")
        assert {health for _, _, health in rows(browser, WORKERS_JS)} == {"unknown"}
        state = httpx.get(f"{cluster.url}/dashboard/state", timeout=20)
        assert state.status_code == 200 and state.json()["router"]["reachable"] is False
