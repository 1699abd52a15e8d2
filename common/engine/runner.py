"""The model runner: owner of the weights, the KV-cache tensor and every per-step tensor.

The cache is one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``:
block-major, so one block of one sequence (all layers, K and V) is a single contiguous
buffer — a copy-on-write is one slice copy and a KV transfer is one frame per block.
A quantised cache (int8 / fp8) is a byte tensor ``[num_blocks, num_layers, 2, slab]``,
each slab a layer's K or V codes followed by their per-head scales
(``kernels.kv_quant``): still one contiguous buffer per block, so copies, transfers and
prefix caching treat its blocks exactly as float ones; the model gets per-layer views.
On the CPU the cache may live in a shared-memory segment (``kv_segment``, for a prefill
worker that lends blocks to same-host decode workers; ``common.shared_memory``).
``execute`` turns a ``SchedulerOutput`` into input tensors, runs the model and returns
the logits of the positions that sample: one row per sampling sequence, or 1 + k rows
for a sequence verifying a draft of k tokens (its last token's and each draft token's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.handoff import KVLayout
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.prompt_logprobs import PromptRows, prompt_rows
from common.engine.request import Sequence
from common.engine.scheduler import ScheduledChunk, SchedulerOutput
from common.model.llama import LlamaModel
from common.shared_memory import SharedSegment
from kernels import cpu_memory, kv_quant
from kernels.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from kernels.kv_quant import KVQuant

# A step whose prefill chunks all have at most this many new tokens runs every token as a
# decode row (``ModelRunner._decode_rows``): speculative verification (1 + k tokens) and
# short tails stay on the decode kernel, and on the CPU in the one-call decode loop.
DECODE_ROWS_MAX = 8


@dataclass(slots=True)
class StepResult:
    seqs: list[Sequence]  # the sequences that sample, in logits row order
    logits: torch.Tensor  # [sum(1 + len(draft) for each seq), vocab] fp32
    drafts: list[tuple[int, ...]]  # each seq's verified draft (empty: one row)
    prompt_rows: list[PromptRows] = field(default_factory=list)  # for prompt logprobs


@dataclass(slots=True)
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
    drafts: list[tuple[int, ...]]
    order: list[ScheduledChunk]  # the chunks in the order their tokens are fed


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, num_blocks: int,
                 cache_dtype: torch.dtype | KVQuant, backend: AttentionBackend,
                 shared_memory: bool = False) -> None:
        s = model.spec
        self.model, self.kv, self.backend = model, kv, backend
        self.device = model.embed.device
        self.block_size = kv.block_size
        self._share = shared_memory and self.device.type == "cpu"
        self.kv_segment: SharedSegment | None = None  # set when the cache is in shared memory
        if isinstance(cache_dtype, KVQuant):
            slab = kv_quant.slab_nbytes(kv.block_size, s.num_kv_heads, s.head_dim)
            self.kv_cache = self._zeros((num_blocks, s.num_layers, 2, slab), torch.uint8)
            views = kv_quant.layer_views(self.kv_cache, kv.block_size, s.num_kv_heads,
                                         s.head_dim, cache_dtype)
            self._model_cache: torch.Tensor | kv_quant.LayerViews = kv_quant.LayerViews(views)
            element_size, dtype_name = 1, cache_dtype.value
        else:
            shape = (num_blocks, s.num_layers, 2, kv.block_size, s.num_kv_heads, s.head_dim)
            self.kv_cache = self._model_cache = self._zeros(shape, cache_dtype)
            element_size, dtype_name = self.kv_cache.element_size(), str(cache_dtype).split(".")[-1]
        self._layout = KVLayout(s.num_layers, kv.block_size, s.num_kv_heads, s.head_dim,
                                element_size, dtype_name)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._share:
            numel = torch.Size(shape).numel()
            self.kv_segment = SharedSegment(numel * torch.empty((), dtype=dtype).element_size())
            return self.kv_segment.tensor(shape, dtype)
        if self.device.type == "cpu":  # read in scattered blocks: huge pages spare the TLB
            return cpu_memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def block_nbytes(self) -> int:
        return self.kv_cache[0].numel() * self.kv_cache.element_size()

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.copy_blocks(out.block_copies)
        inputs = self._prepare(out.chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, self._model_cache, inputs.meta,
                            self.backend)
        logits = self.model.logits(hidden[inputs.sample_rows])
        return StepResult(inputs.sample_seqs, logits, inputs.drafts,
                          prompt_rows(inputs.order, hidden))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = zip(*copies, strict=True)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]

    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        """Each block's bytes (all layers, K and V), without a copy on the CPU."""
        if self.device.type == "cpu":
            return [_byte_view(self.kv_cache[b]) for b in block_ids]
        return [_byte_view(self.kv_cache[b].cpu()) for b in block_ids]

    def write_blocks(self, block_ids: list[int], payload: list[memoryview]) -> None:
        """Fill blocks with bytes shipped from another worker's cache of the same layout
        (read-only: the transport's buffers, or a same-host peer's shared memory)."""
        if len(block_ids) != len(payload):
            raise ValueError(f"{len(payload)} blocks of payload for {len(block_ids)} cache blocks")
        cpu_memory.copy_blocks([self.kv_cache[b] for b in block_ids], payload,
                               torch.get_num_threads())

    @property
    def layout(self) -> KVLayout:
        """What a peer's cache must match for blocks to be copied byte for byte."""
        return self._layout

    def _prepare(self, chunks: list[ScheduledChunk]) -> _Inputs:
        # Single-token chunks first: the decode kernel takes them as one batch.
        decodes = [c for c in chunks if c.num_new_tokens == 1]
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables = [self.kv.block_ids(c.seq) for c in decodes + prefills]
        for chunk, table in zip(decodes + prefills, tables, strict=True):
            self._append_chunk(chunk, table, ids, positions, slots)
        meta = self._metadata(decodes, prefills, tables, slots)
        sample_rows, sample_seqs, drafts, row = [], [], [], 0
        for chunk in decodes + prefills:
            row += chunk.num_new_tokens
            if chunk.samples:
                sample_rows.extend(range(row - 1 - len(chunk.draft), row))
                sample_seqs.append(chunk.seq)
                drafts.append(chunk.draft)
        tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return _Inputs(tensor(ids), tensor(positions), meta, tensor(sample_rows), sample_seqs, drafts,
                       decodes + prefills)

    def _append_chunk(self, chunk: ScheduledChunk, table: list[int], ids: list[int],
                      positions: list[int], slots: list[int]) -> None:
        bs = self.block_size
        span = range(chunk.start, chunk.start + chunk.num_new_tokens)
        ids.extend(chunk.token_ids)
        positions.extend(span)
        slots.extend(table[p // bs] * bs + p % bs for p in span)

    def _metadata(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk],
                  tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
        if prefills and all(c.num_new_tokens <= DECODE_ROWS_MAX for c in prefills):
            return self._decode_rows(decodes + prefills, tables, slots)
        nd = len(decodes)
        spans, start = [], nd
        for row, chunk in enumerate(prefills):
            context = chunk.start + chunk.num_new_tokens
            spans.append(PrefillSpan(start, chunk.num_new_tokens, context, row))
            start += chunk.num_new_tokens
        query_start = [nd] + [s.start + s.num_new for s in spans]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=nd,
            decode_block_tables=self._table_tensor(tables[:nd]),
            decode_context_lens=self._int32([c.start + 1 for c in decodes]),
            prefills=spans,
            prefill_block_tables=self._table_tensor(tables[nd:]),
            prefill_query_start=self._int32([q - nd for q in query_start]),
            prefill_context_lens=self._int32([s.num_context for s in spans]),
        )

    def _decode_rows(self, chunks: list[ScheduledChunk], tables: list[list[int]],
                     slots: list[int]) -> AttentionMetadata:
        """Every token as a decode row: its sequence's block table and a context ending
        at its own position, which is causal attention over the cache for a short chunk
        (a draft being verified, a prompt's last few tokens) by the decode kernel, the
        one plain decoding uses. Each row re-reads its context, so only for short chunks."""
        row_tables, lens = [], []
        for chunk, table in zip(chunks, tables, strict=True):
            row_tables.extend([table] * chunk.num_new_tokens)
            lens.extend(range(chunk.start + 1, chunk.start + chunk.num_new_tokens + 1))
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=len(lens),
            decode_block_tables=self._table_tensor(row_tables),
            decode_context_lens=self._int32(lens),
            prefills=[],
            prefill_block_tables=self._table_tensor([]),
            prefill_query_start=self._int32([0]),
            prefill_context_lens=self._int32([]),
        )

    def _table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=1)
        return self._int32([t + [0] * (width - len(t)) for t in tables] or [[0]])

    def _int32(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
