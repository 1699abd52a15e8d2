"""Conditional disaggregation: does a prompt run on a prefill worker, its KV then moved to
the decode worker (remote), or on the decode worker itself (local)?

Remote prefill keeps long prompts from stalling the decode worker's running batch, but a
prompt waits behind every other prompt on the prefill workers, and its KV must cross the
link. ``DisaggRule.decide`` weighs the three (the uncached length on each side after its
prefix cache, the prefill queue, the link's cost) and names its reason. It is pure: the
router gathers the inputs (``PrefillCosts``), the rule returns a ``Decision``.
``CostGauges`` exports the costs each prefill worker is priced at (its measurements, or
the defaults until it has some) as the router's metrics.

The rule, in order (``auto``):
1. no prefill worker can take the prompt now (all over their token budget) → local;
2. at most ``max_local_prefill`` uncached tokens on the decode worker, and the decode
   worker would finish the prompt no later (its own queue + the prompt ≤ the remote queue
   + the prompt: an idle prefill worker takes the short prompts off a busy decode worker)
   → local (short);
3. the prefill queue is over ``prefill_queue_tokens`` and the decode worker would finish
   the prompt no later → local (queue);
4. moving the prompt's KV costs more than computing it on the decode worker
   (tokens × transfer s/token ≥ uncached × prefill s/token) → local (link);
5. otherwise → remote.
Before the rule, the router gives a decode worker's own prompts the prefill workers' token
budget (``--prefill-token-budget``): past it, a prompt goes remote (or waits in the queue).
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from common.flags import default_of, env


class DisaggMode(str, enum.Enum):
    AUTO = "auto"  # decide per request (the rule above)
    ALWAYS = "always"  # every prompt on a prefill worker (the classic P/D path)
    NEVER = "never"  # every prompt on the decode worker (prefill workers idle)


class Where(str, enum.Enum):
    LOCAL = "local"  # a Task without handoff to the decode worker
    REMOTE = "remote"  # a Task with handoff to a prefill worker


@dataclass(frozen=True, slots=True)
class PrefillCosts:
    """What the router knows about one prompt's two possible homes."""

    prompt_tokens: int
    local_uncached: int  # prompt tokens not in the decode worker's prefix cache
    local_queue_tokens: int  # prompt tokens already placed on the decode worker, not yet prefilled
    remote_uncached: int | None  # on the chosen prefill worker; None: none can take it now
    remote_queue_tokens: int  # outstanding prompt tokens on that prefill worker
    transfer_s_per_token: float  # the link: seconds to move one token's KV
    prefill_s_per_token: float  # the compute: seconds to prefill one token

    def __post_init__(self) -> None:
        if not 0 <= self.local_uncached <= self.prompt_tokens:
            raise ValueError("local_uncached must be within the prompt")
        if self.remote_uncached is not None and not 0 <= self.remote_uncached <= self.prompt_tokens:
            raise ValueError("remote_uncached must be within the prompt")
        if min(self.local_queue_tokens, self.remote_queue_tokens) < 0:
            raise ValueError("queues must be >= 0")
        if self.transfer_s_per_token < 0 or self.prefill_s_per_token <= 0:
            raise ValueError("transfer_s_per_token must be >= 0, prefill_s_per_token > 0")


@dataclass(frozen=True, slots=True)
class Decision:
    where: Where
    reason: str  # one word, also the metric label: mode, busy, short, queue, link, long


@dataclass(frozen=True, slots=True)
class DisaggRule:
    mode: DisaggMode = DisaggMode.AUTO
    # 512: one decode-worker step of the default 512-token budget; a prompt this short costs
    # the running decodes about as much as one remote transfer's copy-in, and on the loaded
    # 2-core machine short prompts (256) went 2-8x faster to first token locally.
    max_local_prefill: int = 512
    # 2048: about one long prompt (2,000 tokens) already waiting on the prefill worker, i.e.
    # over a second of queueing on one CPU core before this prompt could start there.
    prefill_queue_tokens: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DisaggMode(self.mode))
        if self.max_local_prefill < 0 or self.prefill_queue_tokens < 0:
            raise ValueError("max_local_prefill and prefill_queue_tokens must be >= 0")

    def decide(self, c: PrefillCosts) -> Decision:
        if self.mode is DisaggMode.ALWAYS:
            return Decision(Where.REMOTE, "mode")
        if self.mode is DisaggMode.NEVER:
            return Decision(Where.LOCAL, "mode")
        if c.remote_uncached is None:
            return Decision(Where.LOCAL, "busy")
        sooner = (c.local_queue_tokens + c.local_uncached
                  <= c.remote_queue_tokens + c.remote_uncached)
        if sooner and c.local_uncached <= self.max_local_prefill:
            return Decision(Where.LOCAL, "short")
        if sooner and c.remote_queue_tokens > self.prefill_queue_tokens:
            return Decision(Where.LOCAL, "queue")
        if c.prompt_tokens * c.transfer_s_per_token >= c.local_uncached * c.prefill_s_per_token:
            return Decision(Where.LOCAL, "link")
        return Decision(Where.REMOTE, "long")


# Until a prefill worker has measured them: the link as the default model's fp32 KV
# (46,080 bytes a token) over zmq-tcp on one host (2.3 GB/s), the compute as one CPU core
# prefilling about 1,000 tokens a second. Either is replaced by the first measurement.
DEFAULT_TRANSFER_S_PER_TOKEN = 46_080 / 2.3e9
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3


class _Rates(Protocol):
    worker_id: str
    transfer_s_per_token: float | None
    prefill_s_per_token: float | None


def default_costs(worker: _Rates | None) -> tuple[float, float]:
    """(transfer, prefill) seconds per token: the worker's measurements, else the defaults."""
    transfer = worker.transfer_s_per_token if worker is not None else None
    prefill = worker.prefill_s_per_token if worker is not None else None
    return (DEFAULT_TRANSFER_S_PER_TOKEN if transfer is None else transfer,
            prefill or DEFAULT_PREFILL_S_PER_TOKEN)  # 0 would make every prompt "link"


class CostGauges:
    """The costs above as the router's metrics, per live prefill worker:
    ``tandem:router_link_seconds_per_token`` and ``tandem:router_prefill_seconds_per_token``,
    labelled with the worker and whether the value is its measurement or the default."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["worker", "source"]
        self._gauges = (
            Gauge("tandem:router_link_seconds_per_token", "Seconds to move one prompt token's "
                  "KV from a prefill worker, as conditional disaggregation prices it", labels,
                  registry=registry),
            Gauge("tandem:router_prefill_seconds_per_token", "Seconds a prefill worker computes "
                  "per prompt token, as conditional disaggregation prices it", labels,
                  registry=registry))
        self._labelled: set[tuple[Gauge, tuple[str, str]]] = set()

    def update(self, workers: Iterable[_Rates]) -> None:
        live = set()
        for w in workers:
            measured = (w.transfer_s_per_token, w.prefill_s_per_token)
            for gauge, value, own in zip(self._gauges, default_costs(w), measured, strict=True):
                labels = (w.worker_id, "default" if own is None else "measured")
                gauge.labels(*labels).set(value)
                live.add((gauge, labels))
        for gauge, labels in self._labelled - live:  # gone, or measured since
            gauge.remove(*labels)
        self._labelled = live


# ---- flags: the router's, and ``tandem up`` forwards them to its router ----------------

def add_disagg_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disagg-mode", default=env("disagg_mode", default_of(DisaggRule, "mode").value),
                   choices=[m.value for m in DisaggMode],
                   help="where a P/D cluster prefills a prompt: auto (per request: short prompts, "
                        "or any when the prefill queue is long, on the decode worker itself), "
                        "always (on a prefill worker), never (on the decode worker)")
    p.add_argument("--disagg-max-local-prefill", type=int, metavar="TOKENS",
                   default=env("disagg_max_local_prefill", default_of(DisaggRule, "max_local_prefill"), int),
                   help="auto: prompts with at most this many uncached tokens prefill on the decode worker")
    p.add_argument("--disagg-prefill-queue-tokens", type=int, metavar="TOKENS",
                   default=env("disagg_prefill_queue_tokens",
                               default_of(DisaggRule, "prefill_queue_tokens"), int),
                   help="auto: above this many prompt tokens queued on the prefill worker, longer "
                        "prompts prefill on the decode worker too, when it would start them sooner")


def disagg_rule(args: argparse.Namespace) -> DisaggRule:
    return DisaggRule(args.disagg_mode, args.disagg_max_local_prefill, args.disagg_prefill_queue_tokens)


def disagg_argv(args: argparse.Namespace) -> list[str]:
    return ["--disagg-mode", str(args.disagg_mode),
            "--disagg-max-local-prefill", str(args.disagg_max_local_prefill),
            "--disagg-prefill-queue-tokens", str(args.disagg_prefill_queue_tokens)]
