"""``/dashboard``: a live page of the cluster, and ``/dashboard/state``, the JSON it polls.

Who asks whom: the page (``static/dashboard.html``, one file, no build step, nothing
fetched from elsewhere) polls ``/dashboard/state`` every second; each poll sends the
router one ``Survey`` and waits at most ``SURVEY_TIMEOUT_S`` for its ``Roster`` (every
worker's role, drain state, heartbeat age and latest heartbeat). ``DashboardState`` turns
rosters into what the page shows: KV usage, prefix-hit rate, KV transfer MB/s (from the
heartbeats' byte totals over the last few seconds), workers that vanished (``lost``), and
this gateway's recent requests from its ``Timeline``. A router that does not answer is
shown as such, with the workers last seen; the endpoint still answers at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi.responses import HTMLResponse, JSONResponse

from common.protocol import Roster, WorkerView
from common.roles import WorkerRole
from services.gateway.router_link import RouterUnavailable
from services.gateway.timeline import RequestTrace, Timeline

if TYPE_CHECKING:
    from fastapi import FastAPI

    from services.gateway.app import Gateway

log = logging.getLogger("tandem.gateway")
SURVEY_TIMEOUT_S = 0.5  # a poll never waits longer for the router
LATE_S = 0.6  # heartbeat older than this: "late" (the router drops a worker after ~1 s)
LOST_S = 30.0  # a worker that left the roster stays on the page this long, as "lost"
RATE_WINDOW_S = 5.0  # transfer MB/s over about this many seconds of samples
MAX_REQUESTS = 50  # rows in the timeline
PAGE = "static/dashboard.html"
# The page is self-contained: the browser may load nothing from anywhere else.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self' data:")


@dataclass(slots=True)
class _Seen:
    """What the page last knew of a worker, and its byte totals over the rate window."""

    view: WorkerView
    last_listed: float
    samples: deque[tuple[float, int]]  # (when, bytes sent + received)


class DashboardState:
    """Rosters + the timeline → the JSON ``/dashboard/state`` answers. Keeps, per worker,
    a few seconds of byte totals (for MB/s) and the last view (for ``lost`` workers)."""

    def __init__(self, timeline: Timeline, model: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeline, self.model, self.clock = timeline, model, clock
        self._seen: dict[str, _Seen] = {}

    def assemble(self, roster: Roster | None, error: str | None = None) -> dict[str, Any]:
        """The page's state now; ``roster`` None means the router did not answer (``error``
        says why)."""
        now = self.clock()
        if roster is not None:
            self._observe(roster, now)
        listed = {v.worker_id for v in roster.workers} if roster is not None else set()
        workers = [self._worker(seen, now, roster is not None, seen.view.worker_id in listed)
                   for seen in self._seen.values()]
        prefill_only = {w["worker_id"] for w in workers if w["role"] == WorkerRole.PREFILL.value}
        return {
            "model": self.model,
            "router": {"reachable": roster is not None, "error": error,
                       "queue_length": roster.queue_length if roster is not None else None},
            "workers": workers,
            "requests": [request_row(t, now, prefill_only)
                         for t in self.timeline.recent()[:MAX_REQUESTS]],
        }

    def _observe(self, roster: Roster, now: float) -> None:
        for view in roster.workers:
            total = view.kv_bytes_sent + view.kv_bytes_received
            seen = self._seen.get(view.worker_id)
            if seen is None or total < seen.samples[-1][1]:  # new, or restarted (totals reset)
                seen = self._seen[view.worker_id] = _Seen(view, now, deque())
            seen.view, seen.last_listed = view, now
            seen.samples.append((now - view.heartbeat_age, total))
            while len(seen.samples) > 2 and seen.samples[1][0] <= now - RATE_WINDOW_S:
                seen.samples.popleft()
        for worker_id in [w for w, s in self._seen.items() if now - s.last_listed > LOST_S]:
            del self._seen[worker_id]

    def _worker(self, seen: _Seen, now: float, router_up: bool, listed: bool) -> dict[str, Any]:
        v = seen.view
        return {
            "worker_id": v.worker_id, "role": v.role.value,
            "health": health(v, router_up, listed),
            "heartbeat_age": round(v.heartbeat_age + (now - seen.last_listed), 3),
            "kv_usage": round(1 - v.free_blocks / v.total_blocks, 4) if v.total_blocks else 0.0,
            "running": v.num_running, "waiting": v.num_waiting,
            "outstanding_tokens": v.outstanding_tokens, "reserved_blocks": v.reserved_blocks,
            "prefix_hit_rate": round(v.prefix_hits / v.prefix_queries, 4) if v.prefix_queries else None,
            "transfer_mb_s": transfer_rate(seen.samples),
            "kv_mb_total": round((v.kv_bytes_sent + v.kv_bytes_received) / 1e6, 3),
            "step_ms": None if v.step_seconds is None else round(v.step_seconds * 1000, 2),
        }


def health(view: WorkerView, router_up: bool, listed: bool) -> str:
    """ok | late (heartbeat overdue) | draining | lost (the router dropped it) | unknown
    (the router does not answer: this is what it last said)."""
    if not router_up:
        return "unknown"
    if not listed:
        return "lost"
    if view.draining:
        return "draining"
    return "late" if view.heartbeat_age > LATE_S else "ok"


def transfer_rate(samples: deque[tuple[float, int]]) -> float | None:
    """MB/s between the oldest and newest sample; None until two samples a moment apart."""
    if len(samples) < 2:
        return None
    (t0, b0), (t1, b1) = samples[0], samples[-1]
    if t1 - t0 < 0.1:
        return None
    return round((b1 - b0) / (t1 - t0) / 1e6, 3)


def request_row(trace: RequestTrace, now: float, prefill_only: set[str]) -> dict[str, Any]:
    """One timeline row: the phases' seconds so far, where it is now, who served it."""
    awaiting = bool(trace.workers) and trace.workers[0] in prefill_only and len(trace.workers) == 1
    return {
        "request_id": trace.request_id,
        "phase": trace.phase(awaiting),
        "age": round(now - trace.submitted, 3),
        "phases": {k: round(v, 4) for k, v in trace.durations(now, awaiting).items()},
        "workers": list(trace.workers),
        "output_tokens": trace.output_tokens,
    }


def install_dashboard(app: FastAPI, gw: Gateway) -> None:
    """The two routes. The page itself needs no API key (it holds no data; the browser
    sends the key given as ``/dashboard#key=...`` with each state poll)."""
    page = resources.files("services.gateway").joinpath(PAGE).read_text(encoding="utf-8")
    state = DashboardState(gw.timeline, gw.model_name)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache",
                                           "Content-Security-Policy": CSP})

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state() -> JSONResponse:
        roster, error = None, None
        try:
            roster = await gw.link.survey(timeout=SURVEY_TIMEOUT_S)
        except RouterUnavailable as e:
            error = str(e)
        except Exception as e:  # the page must keep answering whatever the router sent
            log.exception("dashboard survey failed")
            error = f"survey failed: {e}"
        return JSONResponse(state.assemble(roster, error), headers={"Cache-Control": "no-store"})
