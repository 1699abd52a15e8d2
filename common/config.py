"""Engine settings: frozen dataclasses that validate themselves on construction.

Every process (the offline engine, prefill, decode and colocated workers) builds one
``EngineConfig`` from its flags; nothing else in the engine reads flags or environment.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
}  # fmt: skip


QUANTIZATION_MODES = ("auto", "none", "gguf", "int8")
# What --quantization auto means for a .gguf model (any other model: none). One constant,
# to be set by measurement: the fastest mode whose greedy output equals HF on its weights.
QUANTIZATION_AUTO_FOR_GGUF = "gguf"


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
    # weights: none = float (a GGUF dequantised), gguf = the GGUF's own quantised blocks,
    # int8 = per-row int8 made at load; auto = QUANTIZATION_AUTO_FOR_GGUF for a .gguf, else none
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be {', '.join(QUANTIZATION_MODES[:-1])} or "
                             f"{QUANTIZATION_MODES[-1]}, got {self.quantization!r}")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Size and shape of the paged KV cache."""

    block_size: int = 16
    memory_bytes: int = 2 * 1024**3  # used when num_blocks is None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto = the model dtype; int8 / fp8 = quantised (kernels.kv_quant)
    # The cache in a shared-memory segment same-host peers can map (a prefill worker's, for
    # --kv-shm; CPU only): it costs the transparent huge pages where shmem may not have them.
    shared_memory: bool = False

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


# The per-step prompt-token cap of a decode worker (``--decode-prefill-budget``): the
# prompts it prefills itself (conditional disaggregation) go in chunks this small, so its
# running decodes are not stalled. See SchedulerConfig.max_num_prefill_tokens. 64: the
# smallest cap whose prompt throughput matched an uncapped engine (1 thread, 8 running
# decodes, a 1,024-token prompt: 156 tok/s vs 153 uncapped; 32 fell to 111 from the
# per-step overhead), while a step with a chunk in it took ~4x a decode-only step (128: ~8x).
DECODE_PREFILL_BUDGET = 64


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 256
    # 512: on a CPU a step of 512 prompt tokens runs the GEMMs as fast per token as 2048
    # (measured), and a burst of prompts gets its first tokens 4x more finely spread.
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # Of a step's budget, the most that prompt chunks may take (None: all of it). Decode
    # workers prefilling short prompts themselves set it low (DECODE_PREFILL_BUDGET), so a
    # step with a prompt chunk in it is barely slower than a step of decodes alone.
    max_num_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_prefill_tokens is not None and self.max_num_prefill_tokens < 1:
            raise ValueError(f"max_num_prefill_tokens must be >= 1, got {self.max_num_prefill_tokens}")
        if self.max_num_prefill_tokens is not None and not self.enable_chunked_prefill:
            raise ValueError("max_num_prefill_tokens needs chunked prefill")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """N-gram speculative decoding (``--speculative-config``, vLLM's JSON keys).

    A decoding sequence drafts up to ``num_speculative_tokens`` tokens by prompt lookup: the
    longest suffix of its tokens (``prompt_lookup_max`` down to ``prompt_lookup_min`` long)
    that occurred before, continued as it went on there; ``prompt_lookup_min`` 0 (the
    default) means 2, or 1 when ``prompt_lookup_max`` is 1 (a one-token match drafts poorly:
    on the grounded workload of ``loadtest/spec_bench.py`` 9 of 11 such drafts were wholly
    rejected, and a rejected draft costs a step of 1 + k rows for one token). The last four
    fields are the switch-offs: no drafting in a step with more than
    ``disable_by_batch_size`` decoding sequences, and a request whose smoothed acceptance
    rate falls below ``min_acceptance_rate`` drafts nothing for ``backoff_steps`` steps.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 0  # 0: min(2, prompt_lookup_max)
    disable_by_batch_size: int = 8  # more decodes than this in a step: no drafts
    min_acceptance_rate: float = 0.2  # per request, of the smoothed rate
    acceptance_smoothing: float = 0.3  # weight of the newest step in the moving average
    backoff_steps: int = 16  # steps a request with low acceptance drafts nothing

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method must be 'ngram', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.prompt_lookup_min == 0:
            object.__setattr__(self, "prompt_lookup_min", min(2, self.prompt_lookup_max))
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")
        if not 0.0 < self.acceptance_smoothing <= 1.0:
            raise ValueError(f"acceptance_smoothing must be in (0, 1], got {self.acceptance_smoothing}")
        if self.backoff_steps < 0:
            raise ValueError(f"backoff_steps must be >= 0, got {self.backoff_steps}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON object; unknown keys and bad values raise ``ValueError``."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        kinds = {"int": (int,), "float": (int, float), "str": (str,)}
        for f in fields(cls):
            value = raw.get(f.name)
            if f.name in raw and (isinstance(value, bool) or not isinstance(value, kinds[f.type])):
                raise ValueError(f"--speculative-config: {f.name} must be a {f.type}, got {value!r}")
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None  # torch intra-op threads; None = every available CPU
    # Up to ``threads``, but each step only as many as other processes leave idle
    # (``common.engine.cpu_share``): for workers that share a host's CPUs unpinned.
    share_cpus: bool = False
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    speculative: SpeculativeConfig | None = None  # None = no speculative decoding

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
