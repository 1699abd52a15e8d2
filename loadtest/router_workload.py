"""What ``tandem bench router`` offers the router: the simulated fleet's caches and the
simulated gateway's prompts, both derived from one ``Workload`` and a seed.

The fleet holds ``groups`` shared prefixes (``prefix_blocks`` blocks each, real token
sequences hashed with ``common.hashing``), each cached on ``replicas`` prefill-capable
workers, and filler hashes up to ``blocks`` in all (``blocks // workers`` distinct
hashes per worker). A prompt is a random leading part (half to all) of one group's prefix
plus ``tail_tokens`` fresh tokens, so every placement walks the prefix index and its
best match sits on a known pair of workers. Every process rebuilds the same data from
the settings alone, so nothing large crosses a pipe.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from common.hashing import BlockHash, hash_prefix_blocks
from common.roles import WorkerRole

VOCAB = 32_000


class Topology(str, enum.Enum):
    PD = "pd"  # half prefill, half decode workers
    COLOCATED = "colocated"  # every worker does both


@dataclass(frozen=True, slots=True)
class Workload:
    workers: int = 256
    topology: Topology = Topology.PD
    blocks: int = 1_000_000  # indexed block hashes, over all workers
    block_size: int = 16
    groups: int = 1024  # shared prefixes
    prefix_blocks: int = 32
    replicas: int = 2  # prefill-capable workers holding each shared prefix
    tail_tokens: int = 128  # fresh tokens after the shared part of each prompt
    seed: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", Topology(self.topology))
        if self.workers < 2 or self.block_size < 1 or self.prefix_blocks < 1 or self.groups < 1:
            raise ValueError("workers must be >= 2; block_size, prefix_blocks and groups >= 1")
        if not 1 <= self.replicas <= len(self.prefill_ids()):
            raise ValueError("replicas must be between 1 and the number of prefill-capable workers")
        if self.blocks_per_worker() < self.chain_blocks_per_worker():
            raise ValueError(f"blocks {self.blocks} cannot hold every worker's shared prefixes "
                             f"({self.chain_blocks_per_worker()} blocks each)")

    def worker_ids(self) -> list[str]:
        return [f"sim-{i:04d}" for i in range(self.workers)]

    def role(self, index: int) -> WorkerRole:
        if self.topology is Topology.COLOCATED:
            return WorkerRole.COLOCATED
        return WorkerRole.PREFILL if index < (self.workers + 1) // 2 else WorkerRole.DECODE

    def prefill_ids(self) -> list[int]:
        return [i for i in range(self.workers) if self.role(i).can_prefill]

    def holders(self, group: int) -> list[int]:
        """The worker indices that cache ``group``'s prefix."""
        prefill = self.prefill_ids()
        return [prefill[(group * self.replicas + r) % len(prefill)] for r in range(self.replicas)]

    def blocks_per_worker(self) -> int:
        return self.blocks // self.workers

    def chain_blocks_per_worker(self) -> int:
        return -(-self.groups * self.replicas // len(self.prefill_ids())) * self.prefix_blocks

    def indexed_blocks(self) -> int:
        """What the router's index holds once every worker registered."""
        return self.blocks_per_worker() * self.workers

    def group_tokens(self, group: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + group)
        return [rng.randrange(VOCAB) for _ in range(self.prefix_blocks * self.block_size)]

    def groups_held(self) -> list[list[int]]:
        """The groups each worker caches, by worker index."""
        held: list[list[int]] = [[] for _ in range(self.workers)]
        for group in range(self.groups):
            for index in self.holders(group):
                held[index].append(group)
        return held

    def snapshots(self) -> list[tuple[list[BlockHash], list[BlockHash]]]:
        """What each worker registers with, by worker index: its prefixes' block chains,
        and filler up to ``blocks_per_worker`` distinct hashes in all."""
        chains = {g: hash_prefix_blocks(self.group_tokens(g), self.block_size) for g in range(self.groups)}
        out = []
        for index, groups in enumerate(self.groups_held()):
            held = [h for g in groups for h in chains[g]]
            rng = random.Random(self.seed * 7_919 + index)
            out.append((held, [rng.randbytes(16) for _ in range(self.blocks_per_worker() - len(held))]))
        return out


def prompts(w: Workload, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts (deterministic per seed); the gateway cycles through them, which
    costs the router the same as fresh ones (it caches nothing of a prompt)."""
    rng = random.Random(seed)
    groups = [w.group_tokens(g) for g in range(w.groups)]
    out = []
    for _ in range(count):
        shared = groups[rng.randrange(w.groups)]
        blocks = rng.randint(max(1, w.prefix_blocks // 2), w.prefix_blocks)
        out.append(shared[: blocks * w.block_size] + [rng.randrange(VOCAB) for _ in range(w.tail_tokens)])
    return out
