"""Command-line flags shared by every command that runs an engine.

Each flag also reads a ``TANDEM_<NAME>`` environment variable (``--max-num-seqs`` ↔
``TANDEM_MAX_NUM_SEQS``), which is how ``compose.yaml`` configures services; a flag given
on the command line wins.
"""

from __future__ import annotations

import argparse
import os

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size


def env_default(dest: str, default=None):
    return os.environ.get("TANDEM_" + dest.upper(), default)


def env_bool(dest: str, default: bool) -> bool:
    value = env_default(dest)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=env_default("model"),
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=env_default("served_model_name"))
    g.add_argument("--dtype", default=env_default("dtype", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=env_default("device", "auto"), choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=env_default("max_model_len"))
    g.add_argument("--block-size", type=int, default=int(env_default("block_size", 16)))
    g.add_argument("--kv-cache-memory", default=env_default("kv_cache_memory", "2GiB"),
                   help="KV-cache budget, e.g. 512MiB or 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=env_default("num_kv_blocks"),
                   help="size the KV cache by block count instead of memory")
    g.add_argument("--kv-cache-dtype", default=env_default("kv_cache_dtype", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env_bool("enable_prefix_caching", True))
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=env_bool("enable_chunked_prefill", True))
    g.add_argument("--max-num-seqs", type=int, default=int(env_default("max_num_seqs", 256)))
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=int(env_default("max_num_batched_tokens", 512)),
                   help="token budget of one engine step (prefill chunks + decodes)")
    g.add_argument("--threads", type=int, default=env_default("threads"),
                   help="torch threads (default: every CPU this process may use)")
    g.add_argument("--seed", type=int, default=int(env_default("seed", 0)))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Build the engine settings; raises ValueError with a one-line reason."""
    num_blocks = args.num_kv_blocks
    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype,
                          max_model_len=_opt_int(args.max_model_len),
                          served_name=args.served_model_name, device=args.device),
        cache=CacheConfig(block_size=args.block_size, memory_bytes=parse_size(args.kv_cache_memory),
                          num_blocks=_opt_int(num_blocks),
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill),
        threads=_opt_int(args.threads),
        seed=args.seed,
    )


def _opt_int(value) -> int | None:
    return None if value is None else int(value)
