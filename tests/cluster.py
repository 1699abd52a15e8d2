"""A real local cluster for end-to-end tests: the same launcher as ``tandem up``.

Every service is its own process on loopback; ``Cluster`` plans and starts them through
``services.launcher`` (so the launcher is tested too), waits until all report healthy,
and stops them all on exit. With ``supervise=True`` a ``Supervisor`` watches them as under
``tandem up`` (a killed child is restarted); without it, a killed child stays dead.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cli.main import build_parser
from common.addresses import free_port
from services import launcher
from services.supervision import Supervisor


class MissingMetricError(AssertionError):
    """A metric a test reads is not on the page: renamed or never registered."""


@dataclass
class Cluster:
    model: str
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    policy: str = "prefix"
    kv_transport: str = "zmq"
    # The classic P/D path (every prompt on a prefill worker) unless a test asks for the
    # per-request choice: the fault and migration tests are about that path.
    disagg_mode: str = "always"
    extra: tuple[str, ...] = ("--num-kv-blocks", "512")
    supervise: bool = False

    def __enter__(self) -> Cluster:
        self.port = free_port()
        argv = ["up", "--model", self.model, "--port", str(self.port), "--policy", self.policy,
                "--prefill", str(self.prefill), "--decode", str(self.decode),
                "--colocated", str(self.colocated), "--kv-transport", self.kv_transport,
                "--disagg-mode", self.disagg_mode,
                "--threads", "1", *self.extra]
        args = build_parser().parse_args(argv)
        self.local = launcher.LocalCluster(launcher.plan(args), args.drain_timeout)
        try:
            self.local.start(timeout=240)
        except launcher.StartupError as e:
            raise RuntimeError(f"cluster did not become healthy: {e}\n{self.logs()}") from e
        self.supervisor = Supervisor(self.local).start() if self.supervise else None
        return self

    def __exit__(self, *exc) -> None:
        self.local.stop()
        if self.supervisor is not None:  # after stop: its restarted children die with its thread
            self.supervisor.close()

    @property
    def children(self) -> list[launcher.Child]:
        return self.local.children

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> launcher.Child:
        [router] = [c for c in self.children if c.name == "router"]
        return router

    def child(self, name: str) -> launcher.Child:
        [child] = [c for c in self.children if c.name == name]
        return child

    def workers(self, role: str | None = None) -> list[launcher.Child]:
        names = ("prefill", "decode", "worker") if role is None else (role,)
        return [c for c in self.children if c.name.split("-")[0] in names]

    def metric(self, child: launcher.Child, name: str, **labels: str) -> float:
        """Sum of a metric's samples on one service (those with ``labels``, if given).
        Raises ``MissingMetricError`` when the page has no such metric at all, so a renamed
        metric fails the test instead of reading as zero."""
        url = child.health_url.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        families = {name, name.removesuffix("_total")}  # counters: either, by client version
        if not any(re.search(rf"^# TYPE {re.escape(f)} ", text, re.M) for f in families):
            raise MissingMetricError(f"{child.name} exports no metric {name}")
        pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+|NaN)$", re.M)
        wanted = {f'{k}="{v}"' for k, v in labels.items()}
        return sum(float(value) for label_text, value in pattern.findall(text)
                   if wanted <= set(label_text.split(",")) - {""})

    def workers_total(self, name: str, **labels: str) -> float:
        """A metric summed over every worker (what the cluster did, wherever it ran)."""
        return sum(self.metric(w, name, **labels) for w in self.workers())

    def health(self, child: launcher.Child) -> dict:
        with urllib.request.urlopen(child.health_url, timeout=5) as r:
            return json.loads(r.read())

    def logs(self) -> str:
        return "\n".join(f"[{c.name}] {line}" for c in self.children for line in c.tail)


def readable_prompt(model_dir: Path, ids: TokenIds, length: int, start: int, max_tokens: int,
                    step: int = 13, span: int = 2000) -> tuple[list[int], list[int]]:
    """A prompt of ``length`` consecutive ids whose HF greedy output (``max_tokens``) reads
    back exactly over HTTP (``TokenIds.exact``), and that output."""
    from tests.conftest import hf_greedy

    for offset in range(start, start + span, step):
        prompt = list(range(100 + offset, 100 + offset + length))
        out = hf_greedy(model_dir, prompt, max_tokens)
        if ids.exact(out):
            return prompt, out
    raise AssertionError("no prompt found whose output reads back exactly")


class TokenIds:
    """Reads output token ids back over HTTP, where completion logprobs carry each token's
    text but not its id. Each text maps back to the one id that decodes to it; the few
    texts several ids share (partial UTF-8 bytes all read U+FFFD) are refused, so a
    comparison is exact or fails — never a guess."""

    def __init__(self, model_dir: Path) -> None:
        from common.model.tokenizer import Tokenizer

        hf = Tokenizer(Path(model_dir)).hf
        self._texts = hf.batch_decode([[i] for i in range(len(hf))], skip_special_tokens=False)
        self._id: dict[str, int | None] = {}
        for token_id, text in enumerate(self._texts):
            self._id[text] = None if text in self._id else token_id

    def exact(self, token_ids: list[int]) -> bool:
        """Whether every one of ``token_ids`` reads back over HTTP as itself."""
        return all(self._id.get(self._texts[i]) == i for i in token_ids)

    def of(self, choice: dict) -> list[int]:
        """The token ids of one completions choice requested with ``"logprobs": 0``."""
        out = []
        for text in choice["logprobs"]["tokens"]:
            token_id = self._id.get(text)
            if token_id is None:
                raise AssertionError(f"token text {text!r} does not name one token id: "
                                     f"choose a prompt whose output avoids it")
            out.append(token_id)
        return out


def wait_for(condition: Callable[[], object], what: str, timeout: float = 60.0) -> object:
    """Poll an observable condition until it is truthy (and return it); fail with ``what``
    after ``timeout`` seconds. Polling a condition, never a guess at a duration."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
