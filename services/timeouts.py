"""The timeouts that live in different processes but must agree with each other.

Each one's value and validation belong to its own service's settings; this module holds
the rules that tie them together, so ``tandem up`` (which starts every process) refuses
a combination that cannot work before anything starts, and each service logs a warning
when it meets a peer configured against it:

- the gateway waits for admission longer than the router lets a request queue;
- the router waits for a silent worker across at least two of its heartbeats;
- a prefill worker lends blocks to a transfer longer than the transport waits for a frame;
- whoever stops a worker or the gateway (``tandem up``, compose's ``stop_grace_period``,
  Kubernetes' ``terminationGracePeriodSeconds``) waits longer than its drain timeout.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from common.flags import default_of, env
from services.gateway.settings import GatewaySettings
from services.router.service import RouterSettings
from services.worker_settings import WorkerSettings


@dataclass(frozen=True, slots=True)
class Timeouts:
    queue_timeout: float = default_of(RouterSettings, "queue_timeout")
    admission_timeout: float = default_of(GatewaySettings, "admission_timeout")
    heartbeat_interval: float = default_of(WorkerSettings, "heartbeat_interval")
    heartbeat_timeout: float = default_of(RouterSettings, "heartbeat_timeout")
    lease_seconds: float = default_of(WorkerSettings, "lease_seconds")
    drain_timeout: float = default_of(WorkerSettings, "drain_timeout")
    router_reach_timeout: float = default_of(GatewaySettings, "router_reach_timeout")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0")
        check_admission(self.admission_timeout, self.queue_timeout)
        check_heartbeat(self.heartbeat_interval, self.heartbeat_timeout)

    def router_argv(self) -> list[str]:
        return _argv(self, "queue_timeout", "heartbeat_timeout")

    def worker_argv(self) -> list[str]:
        return _argv(self, "heartbeat_interval", "lease_seconds", "drain_timeout")

    def gateway_argv(self) -> list[str]:
        return _argv(self, "admission_timeout", "drain_timeout", "router_reach_timeout")


def check_admission(admission_timeout: float, queue_timeout: float) -> None:
    if admission_timeout <= queue_timeout:
        raise ValueError(f"--admission-timeout {admission_timeout:g} must exceed the router's "
                         f"--queue-timeout {queue_timeout:g}: a request still queued would "
                         "be given up by the gateway while the router may yet place it")


def check_heartbeat(interval: float, timeout: float) -> None:
    if timeout < 2 * interval:
        raise ValueError(f"--heartbeat-timeout {timeout:g} must span at least two "
                         f"--heartbeat-interval {interval:g}: one late beat would kill a worker")


def add_timeout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timeouts (checked against each other)")
    for f in fields(Timeouts):  # TANDEM_<NAME> as for the services themselves
        g.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=env(f.name, f.default, float))


def timeouts(args: argparse.Namespace) -> Timeouts:
    return Timeouts(**{f.name: getattr(args, f.name) for f in fields(Timeouts)})


def _argv(t: Timeouts, *names: str) -> list[str]:
    return [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(t, name)))]
