"""What a worker measures of its own speed, for the router's heartbeat: the recent engine
step time (every role), and on a prefill worker the compute and link costs per token that
conditional disaggregation weighs (``services.router.disagg``).

Each is an exponential moving average, so one slow step on a loaded machine moves it
only by ``SMOOTHING``; ``None`` until the first sample.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest sample


def _mix(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass(slots=True)
class WorkRates:
    step_seconds: float | None = None  # one engine step that ran something
    prefill_s_per_token: float | None = None  # a prefill worker's step time per token computed
    transfer_s_per_token: float | None = None  # a shipped prompt's transfer time per token

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
        self.transfer_s_per_token = _mix(self.transfer_s_per_token, seconds / (nbytes / bytes_per_token))
