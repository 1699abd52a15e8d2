"""Engine settings: frozen dataclasses that validate themselves on construction.

Every process (the offline engine, prefill, decode and colocated workers) builds one
``EngineConfig`` from its flags; nothing else in the engine reads flags or environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``"2GiB"`` → 2147483648; plain integers are bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def available_cpus() -> int:
    """CPUs this process may run on (respects affinity and container limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to serve and how to run them."""

    path: str | None = None  # HF directory or .gguf file; None = the default SmolLM2 model
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    served_name: str | None = None  # name reported to clients; None = derived from the path
    device: str = "auto"  # auto = cuda when available, else cpu

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Size and shape of the paged KV cache."""

    block_size: int = 16
    memory_bytes: int = 2 * 1024**3  # used when num_blocks is None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto = the model dtype; int8 / fp8 = quantised (kernels.kv_quant)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.memory_bytes <= 0:
            raise ValueError("kv cache memory must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 256
    # 512: on a CPU a step of 512 prompt tokens runs the GEMMs as fast per token as 2048
    # (measured), and a burst of prompts gets its first tokens 4x more finely spread.
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None  # torch intra-op threads; None = every available CPU
    seed: int = 0  # seeds the generator of requests that bring no seed of their own

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
