"""What a worker measures of its own speed, for the router's heartbeat: the recent engine
step time (every role), and on a prefill worker the compute and link costs per token that
conditional disaggregation weighs (``services.router.disagg``).

Step and prefill costs are exponential moving averages, so one slow step on a loaded
machine moves them only by ``SMOOTHING``. The link cost is the *least* time per token of
the last ``LINK_WINDOW`` transfers: a transfer is timed from send to ack, and the ack also
waits for the receiver to get round to it (a decode step, a full cache), which is not the
link's cost; the quickest recent transfer waited least. ``None`` until the first sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest sample
LINK_WINDOW = 16  # transfers whose quickest prices the link


def _mix(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass(slots=True)
class WorkRates:
    step_seconds: float | None = None  # one engine step that ran something
    prefill_s_per_token: float | None = None  # a prefill worker's step time per token computed
    _link: deque[float] = field(default_factory=lambda: deque(maxlen=LINK_WINDOW))

    def observe_step(self, seconds: float, tokens: int, prefill_only: bool) -> None:
        """A step that computed ``tokens`` took ``seconds``; ``prefill_only``: every token
        in it was a prompt token (a prefill worker's steps), so it also prices prefill."""
        if tokens <= 0:
            return
        self.step_seconds = _mix(self.step_seconds, seconds)
        if prefill_only:
            self.prefill_s_per_token = _mix(self.prefill_s_per_token, seconds / tokens)

    def observe_transfer(self, seconds: float, nbytes: int, bytes_per_token: float) -> None:
        if nbytes <= 0 or bytes_per_token <= 0:
            return
        self._link.append(seconds / (nbytes / bytes_per_token))

    @property
    def transfer_s_per_token(self) -> float | None:
        """Seconds per prompt token of KV on the link (the quickest recent transfer)."""
        return min(self._link) if self._link else None
