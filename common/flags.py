"""Command-line flags, with their defaults taken from the settings dataclasses.

One source per default: a setting's value and its validation live in its frozen
dataclass (``common.config`` for the engine, ``RouterSettings``, ``WorkerSettings``,
``GatewaySettings``); argparse only reads them (``default_of``). Each flag also reads a
``TANDEM_<NAME>`` environment variable (``--max-num-seqs`` ↔ ``TANDEM_MAX_NUM_SEQS``),
which is how ``compose.yaml`` configures services; a flag given on the command line wins.

``add_engine_flags`` puts the engine's flags in one argument group titled
``ENGINE_GROUP``; ``tandem up`` forwards every flag of that group to its workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from common.config import (
    DECODE_PREFILL_BUDGET,
    KV_CACHE_DTYPES,
    QUANTIZATION_AUTO_FOR_GGUF,
    QUANTIZATION_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
)

ENGINE_GROUP = "engine"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def env(dest: str, default: Any = None, kind: type = str) -> Any:
    """``TANDEM_<DEST>`` converted to ``kind``, else ``default``."""
    name = "TANDEM_" + dest.upper()
    raw = os.environ.get(name)
    if raw is None:
        return default
    if kind is bool:
        value = raw.strip().lower()
        if value not in _TRUE + _FALSE:
            raise ValueError(f"{name}={raw!r}: use true or false")
        return value in _TRUE
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def add_engine_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the engine's flags (one group); returns their definitions."""
    g = parser.add_argument_group(ENGINE_GROUP)
    actions: list[argparse.Action] = []

    def add(*names: str, **kw: Any) -> None:
        actions.append(g.add_argument(*names, **kw))

    m, c, s = ModelConfig, CacheConfig, SchedulerConfig
    add("--model", default=env("model", default_of(m, "path")),
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    add("--served-model-name", default=env("served_model_name", default_of(m, "served_name")))
    add("--dtype", default=env("dtype", default_of(m, "dtype")),
                   choices=["auto", "float32", "bfloat16", "float16"])
    add("--device", default=env("device", default_of(m, "device")),
                   choices=["auto", "cpu", "cuda"])
    add("--quantization", default=env("quantization", default_of(m, "quantization")),
                   choices=list(QUANTIZATION_MODES),
                   help="weights: none (float), gguf (the .gguf file's own quantised blocks), "
                        f"int8 (per-row int8 made at load); auto: {QUANTIZATION_AUTO_FOR_GGUF} for a "
                        ".gguf model, else none")
    add("--max-model-len", type=int, default=env("max_model_len", default_of(m, "max_model_len"), int))
    add("--block-size", type=int, default=env("block_size", default_of(c, "block_size"), int))
    add("--kv-cache-memory", default=env("kv_cache_memory", str(default_of(c, "memory_bytes"))),
                   help="KV-cache budget, e.g. 512MiB or 2GiB (default: 2GiB)")
    add("--num-kv-blocks", type=int, default=env("num_kv_blocks", default_of(c, "num_blocks"), int),
                   help="size the KV cache by block count instead of memory")
    add("--kv-cache-dtype", default=env("kv_cache_dtype", default_of(c, "kv_cache_dtype")),
                   choices=list(KV_CACHE_DTYPES),
                   help="KV-cache element type; int8 / fp8 store one byte per value with "
                        "per-block, per-head scales (about 4x the tokens of float32)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env("enable_prefix_caching", default_of(c, "enable_prefix_caching"), bool))
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=env("enable_chunked_prefill", default_of(s, "enable_chunked_prefill"), bool))
    add("--max-num-seqs", type=int, default=env("max_num_seqs", default_of(s, "max_num_seqs"), int))
    add("--max-num-batched-tokens", type=int,
                   default=env("max_num_batched_tokens", default_of(s, "max_num_batched_tokens"), int),
                   help="token budget of one engine step (prefill chunks + decodes)")
    add("--decode-prefill-budget", type=int,
                   default=env("decode_prefill_budget", DECODE_PREFILL_BUDGET, int),
                   help="decode workers: prompt tokens per step for the prompts they prefill "
                        "themselves (conditional disaggregation), so running decodes are not "
                        "stalled; needs chunked prefill")
    add("--threads", type=int, default=env("threads", default_of(EngineConfig, "threads"), int),
                   help="torch threads (default: every CPU this process may use)")
    add("--share-cpus", action=argparse.BooleanOptionalAction,
                   default=env("share_cpus", default_of(EngineConfig, "share_cpus"), bool),
                   help="run each step on only as many threads as the other workers on "
                        "this host's CPUs leave free (for workers sharing CPUs without "
                        "--cpu-affinity; they see each other through /dev/shm)")
    add("--seed", type=int, default=env("seed", default_of(EngineConfig, "seed"), int))
    add("--speculative-config", default=env("speculative_config", default_of(EngineConfig, "speculative")),
                   help='n-gram speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 3}\' (default: off)')
    return actions


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Build the engine settings; raises ValueError with a one-line reason."""
    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          served_name=args.served_model_name, device=args.device,
                          quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size, memory_bytes=parse_size(args.kv_cache_memory),
                          num_blocks=args.num_kv_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  max_num_prefill_tokens=_prefill_cap(args)),
        threads=args.threads,
        share_cpus=args.share_cpus,
        seed=args.seed,
        speculative=SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None,
    )


def _prefill_cap(args: argparse.Namespace) -> int | None:
    """Only a decode worker caps its prompt chunks (and only when it chunks prompts)."""
    if getattr(args, "role", None) != "decode" or not args.enable_chunked_prefill:
        return None
    return args.decode_prefill_budget
