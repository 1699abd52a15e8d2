"""The one-call C decode loop (``kernels/cpu/decode_layers.c``) against the fused Python
path it replaces: bit-identical logprobs on float, biased and quantised models, short
chunks run as decode rows, and bad rows rejected without harm."""

from __future__ import annotations

import pytest
import torch

from common.config import ModelConfig
from common.engine import runner
from common.engine.runner import DECODE_ROWS_MAX
from common.engine.setup import load_model
from common.sampling_params import SamplingParams
from kernels import cpu_decode
from tests.conftest import loaded_model, make_engine
from tests.tiny_gguf import Q, write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="C kernels not built here")


def _run(engine, prompts, *, loop: bool, n: int = 12):
    """Token ids and chosen-token logprobs of each prompt, the loop on or off."""
    engine.loaded.model.decode_loop = loop
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        outs = engine.generate(prompts, params)
    finally:
        engine.pool.reset_prefix_cache()
    return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for o in outs for c in o.choices]


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _loop_calls(model, monkeypatch) -> list[int]:
    calls: list[int] = []
    run = cpu_decode.DecodeLayers.run

    def counting(self, x, *args):
        calls.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(cpu_decode.DecodeLayers, "run", counting)
    return calls


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", proj=Q.Q4_1,
                           overrides={"blk.1.ffn_down.weight": Q.Q5_0})  # one layer's down in fp32
    return path, load_model(ModelConfig(path=str(path), quantization="gguf"))


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_qwen2_dir", "tiny_q4_1"])
def test_loop_is_bit_identical_to_the_fused_path(which, request, monkeypatch):
    value = request.getfixturevalue(which)
    directory, loaded = value if which == "tiny_q4_1" else (value, loaded_model(value))
    engine = make_engine(directory, loaded=loaded)
    assert engine.loaded.model.fused_ops, "the fused path is the one being replaced"
    prompts = _prompts(engine.spec.vocab_size, [5, 17, 40])
    off = _run(engine, prompts, loop=False)
    calls = _loop_calls(engine.loaded.model, monkeypatch)
    on = _run(engine, prompts, loop=True)
    assert calls and max(calls) == 3, "decode steps of all three sequences went through the loop"
    assert on == off  # token ids and every logprob, exactly


def test_short_chunks_run_as_decode_rows(tiny_model_dir, monkeypatch):
    """A prompt of at most DECODE_ROWS_MAX tokens is prefilled in the loop too, one decode
    row per token, each attending up to its own position; the result is the one the
    prefill path computes, to float32 summation order."""
    engine = make_engine(tiny_model_dir)
    prompts = _prompts(engine.spec.vocab_size, [DECODE_ROWS_MAX, 3])
    with monkeypatch.context() as m:
        m.setattr(runner, "DECODE_ROWS_MAX", 0)  # every chunk through the prefill path
        ref = _run(engine, prompts, loop=False)
    calls = _loop_calls(engine.loaded.model, monkeypatch)
    got = _run(engine, prompts, loop=True)
    assert calls[0] == DECODE_ROWS_MAX + 3  # the first step: both prompts, every token a row
    assert [ids for ids, _ in got] == [ids for ids, _ in ref]
    for (_, a), (_, b) in zip(got, ref, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_longer_chunk_keeps_the_prefill_path(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    calls = _loop_calls(engine.loaded.model, monkeypatch)
    _run(engine, _prompts(engine.spec.vocab_size, [DECODE_ROWS_MAX + 1]), loop=True, n=3)
    assert calls == [1, 1]  # the prefill step did not come here; the two decode steps did


def _rows(engine, t: int, slot: int, block: int):
    model = engine.loaded.model
    runner = engine.runner
    loop = cpu_decode.DecodeLayers(model, runner.kv_cache)
    x = torch.zeros(t, engine.spec.hidden_size)
    pos = torch.arange(t, dtype=torch.int64)
    slots = torch.full((t,), slot, dtype=torch.int64)
    tables = torch.full((t, 1), block, dtype=torch.int32)
    lens = torch.ones(t, dtype=torch.int32)
    return loop, (x, pos, slots, tables, lens, 1)


@pytest.mark.parametrize("slot, block, match", [
    (-1, 0, "slot outside the cache"),
    (10**9, 0, "slot outside the cache"),
    (0, 10**6, "layer 0's attention rejected"),
])  # fmt: skip
def test_bad_rows_are_rejected_and_the_engine_serves_on(tiny_model_dir, slot, block, match):
    engine = make_engine(tiny_model_dir, num_blocks=32)
    loop, args = _rows(engine, 2, slot, block)
    with pytest.raises(ValueError, match=match):
        loop.run(*args)
    out = engine.generate(_prompts(engine.spec.vocab_size, [4]), SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].choices[0].token_ids) == 3


def test_mismatched_shapes_are_refused(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    loop, (x, pos, slots, tables, lens, threads) = _rows(engine, 2, 0, 0)
    with pytest.raises(ValueError, match="mismatched shapes"):
        loop.run(x, pos[:1], slots, tables, lens, threads)


def test_a_quantised_cache_keeps_the_python_path(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, kv_cache_dtype="int8")
    calls = _loop_calls(engine.loaded.model, monkeypatch)
    _run(engine, _prompts(engine.spec.vocab_size, [20]), loop=True, n=3)
    assert calls == []
