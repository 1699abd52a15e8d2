"""Every message that crosses a socket between Tandem processes.

Each is a frozen dataclass registered under a tag and version (``common.wire`` is the
codec: msgpack arrays, typed fields, size bound, unknown tags rejected). Tensors never
go inside a message: KV blocks travel as raw frames after a ``KVHandoff`` header (see
``common/connector``). A message checks its own consistency in ``__post_init__``, so an
inconsistent peer is refused with a ``ProtocolError`` where its bytes are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.hashing import HASH_BYTES, hash_prefix_blocks
from common.outputs import FinishReason, TokenLogprob
from common.roles import FinishStage, WorkerRole
from common.sampling_params import SamplingParams
from common.wire import MAX_MESSAGE_BYTES, Message, ProtocolError, decode, encode, message
from common.wire import require as _require

__all__ = ["MAX_MESSAGE_BYTES", "Message", "ProtocolError", "decode", "encode", "message"]


# ---- gateway <-> router ---------------------------------------------------------------

@message("job")
@dataclass(frozen=True, slots=True)
class Job(Message):
    """What a worker needs to run a request, beyond its id: the prompt and how to sample.

    The gateway encodes it once, into its ``Submit``; the router carries those bytes into
    the ``Task`` unopened (placement reads only the ``Submit``'s header, never a token),
    and the worker decodes them (``Task.open``)."""

    prompt_token_ids: list[int]
    params: SamplingParams


def _job(data: bytes, where: str) -> Job:
    job = decode(data)
    _require(isinstance(job, Job), f"{where}.job holds a {job.TAG}, not a job")
    return job


@message("submit", version=4)
@dataclass(frozen=True, slots=True)
class Submit(Message):
    """A request for the router: a header that is all placement reads, and the ``Job``.

    The gateway states what the router needs of the job (its length, ``max_tokens`` and
    ``priority``) and hashes the prompt's full blocks in the workers' block size, which
    the router's ``Status`` tells it (``block_size`` None: not hashed; the router then opens
    the job and hashes it itself). ``Submit.of`` builds the header from the job, so the two
    agree; nothing downstream trusts the header for correctness (the worker checks the
    job's own tokens and context), only for where the request goes."""

    request_id: str
    reply_to: str  # the gateway's token-stream address
    num_prompt_tokens: int
    max_tokens: int | None
    priority: int
    block_size: int | None  # of ``block_hashes``; None when the gateway did not hash
    block_hashes: list[bytes]  # ``common.hashing.hash_prefix_blocks`` of the prompt
    job: bytes  # an encoded ``Job``

    def __post_init__(self) -> None:
        _require(self.num_prompt_tokens >= 0 and (self.block_size is None or self.block_size >= 1),
                 "submit: a negative prompt length or a block size below 1")
        expected = self.num_prompt_tokens // self.block_size if self.block_size else 0
        _require(len(self.block_hashes) == expected,
                 f"submit: {len(self.block_hashes)} block hashes for {self.num_prompt_tokens} "
                 f"tokens in blocks of {self.block_size}")
        _require(all(len(h) == HASH_BYTES for h in self.block_hashes),
                 f"submit: block hashes are {HASH_BYTES} bytes")

    @classmethod
    def of(cls, request_id: str, prompt: list[int], params: SamplingParams, reply_to: str,
           block_size: int | None = None) -> Submit:
        hashes = hash_prefix_blocks(prompt, block_size) if block_size else []
        return cls(request_id, reply_to, len(prompt), params.max_tokens, params.priority,
                   block_size, hashes, encode(Job(prompt, params)))

    def open(self) -> Job:
        return _job(self.job, "submit")


@message("admitted")
@dataclass(frozen=True, slots=True)
class Admitted(Message):
    request_id: str


@message("queued")
@dataclass(frozen=True, slots=True)
class Queued(Message):
    """The router holds the request until a worker can take it (``Admitted`` follows, or
    ``Rejected``). With ``Admitted`` and ``Rejected`` it tells the gateway its ``Submit``
    arrived: one that is not acknowledged was lost (a router that died as it was sent)."""

    request_id: str


@message("rejected")
@dataclass(frozen=True, slots=True)
class Rejected(Message):
    request_id: str
    status: int  # the HTTP status the gateway should answer with (429, 503, 400)
    reason: str
    retry_after: float | None = None

    def __post_init__(self) -> None:
        _require(400 <= self.status < 600, f"rejected.status {self.status} is not an HTTP error")


@message("abort")
@dataclass(frozen=True, slots=True)
class Abort(Message):
    request_id: str
    reason: str = "client"


@message("ping")
@dataclass(frozen=True, slots=True)
class Ping(Message):
    nonce: int


@message("status", version=3)
@dataclass(frozen=True, slots=True)
class Status(Message):
    """The router's answer to a ping: what it can serve right now."""

    nonce: int
    prefill_workers: int  # prefill-capable (prefill + colocated)
    decode_workers: int  # decode-capable (decode + colocated)
    queue_length: int
    max_model_len: int | None  # the smallest limit among live workers; None without workers
    queue_timeout: float  # the router's; a gateway must wait longer for admission
    block_size: int | None = None  # the prefill workers' (how a Submit hashes its prompt)


@message("survey")
@dataclass(frozen=True, slots=True)
class Survey(Message):
    """Gateway → router: describe every worker (the gateway's ``/dashboard``)."""

    nonce: int


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it: what it registered, its latest heartbeat, and the
    router's own charges on it (a record inside ``Roster``)."""

    worker_id: str
    role: WorkerRole
    draining: bool
    heartbeat_age: float  # seconds since the router last heard from it
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    outstanding_tokens: int  # prompt tokens placed there, prefill not yet done
    reserved_blocks: int  # blocks promised to KV on its way there
    prefix_queries: int  # the heartbeat's totals since the worker started
    prefix_hits: int
    kv_bytes_sent: int
    kv_bytes_received: int
    step_seconds: float | None

    def __post_init__(self) -> None:
        _require(0 <= self.free_blocks <= self.total_blocks and self.heartbeat_age >= 0,
                 "worker_view: inconsistent counts")


@message("roster")
@dataclass(frozen=True, slots=True)
class Roster(Message):
    """The router's answer to a ``Survey``: every registered worker, in registration order."""

    nonce: int
    workers: list[WorkerView]
    queue_length: int


# ---- router -> workers ----------------------------------------------------------------

@message("task", version=4)
@dataclass(frozen=True, slots=True)
class Task(Message):
    """Run a request: prefill only (``handoff_addr`` set) or to completion (colocated).
    ``job`` is the ``Submit``'s, as the gateway encoded it."""

    request_id: str
    reply_to: str
    job: bytes  # an encoded ``Job``
    handoff_addr: str | None = None  # the chosen decode worker's KV receiver address

    @classmethod
    def of(cls, request_id: str, prompt: list[int], params: SamplingParams, reply_to: str,
           handoff_addr: str | None = None) -> Task:
        return cls(request_id, reply_to, encode(Job(prompt, params)), handoff_addr)

    def open(self) -> Job:
        """The job, decoded and checked (a ``ProtocolError`` if it is not one)."""
        return _job(self.job, "task")


@message("reregister", version=2)
@dataclass(frozen=True, slots=True)
class Reregister(Message):
    """The router does not know this worker: register anew.

    ``lost_work``: the router declared the worker dead and failed its requests (drop them);
    otherwise the router is new (restarted) and the requests are still the worker's to finish.
    """

    worker_id: str
    lost_work: bool


@message("registered")
@dataclass(frozen=True, slots=True)
class Registered(Message):
    """The router's answer to every ``Register``: it knows the worker now (a worker is
    ready, ``/ready``, only once its latest registration was answered)."""

    worker_id: str


@message("drained")
@dataclass(frozen=True, slots=True)
class Drained(Message):
    """To a draining worker: nothing the router placed on it is left (every request it was
    given has reported ``Finished``, failed or been aborted), so it may leave."""

    worker_id: str


# ---- workers -> gateway ---------------------------------------------------------------

@message("tokens", version=3)
@dataclass(frozen=True, slots=True)
class Tokens(Message):
    request_id: str
    choice: int
    index: int  # position of token_ids[0] in the choice's output, for reordering
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed on the server side
    retryable: bool = False  # with error: a worker was lost, the request may run elsewhere
    # On choice 0's first message of a request that asked for them: one record per prompt
    # token after the first (which has no context to be scored in), in prompt order.
    prompt_logprobs: list[TokenLogprob] | None = None
    worker_id: str = ""  # the worker that produced these tokens (the gateway's timeline)

    def __post_init__(self) -> None:
        _require(self.choice >= 0 and self.index >= 0, "tokens.choice and index must be >= 0")
        _require(self.logprobs is None or len(self.logprobs) == len(self.token_ids),
                 "tokens.logprobs needs one entry per token")


# ---- workers -> router ----------------------------------------------------------------

@message("register", version=2)
@dataclass(frozen=True, slots=True)
class Register(Message):
    worker_id: str
    role: WorkerRole
    kv_addr: str | None  # decode/colocated workers: where KV handoffs arrive
    metrics_url: str
    num_blocks: int
    block_size: int
    max_model_len: int
    model: str
    heartbeat_interval: float  # the router's timeout must span several of these
    cached_blocks: list[bytes] = field(default_factory=list)  # every block hash it holds now

    def __post_init__(self) -> None:
        _require(self.num_blocks >= 1 and self.block_size >= 1 and self.max_model_len >= 2,
                 "register: num_blocks, block_size and max_model_len must be positive")
        _require(self.heartbeat_interval > 0, "register.heartbeat_interval must be > 0")
        _require((self.kv_addr is None) == (self.role is WorkerRole.PREFILL),
                 "register.kv_addr is required exactly for decode-capable workers")


@message("heartbeat", version=3)
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Load and speed. The three rates are moving averages, ``None`` before a first sample:
    ``step_seconds`` of the engine's steps (the router's decode choice weighs it), and on a
    prefill worker the seconds per token of prefill and of KV transfer (what conditional
    disaggregation weighs). The four totals count since the worker started (v3; the
    router passes them on in ``Roster`` for the gateway's ``/dashboard``)."""

    worker_id: str
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    step_seconds: float | None = None
    prefill_s_per_token: float | None = None
    transfer_s_per_token: float | None = None
    prefix_queries: int = 0  # prompt tokens looked up in its prefix cache
    prefix_hits: int = 0  # of those, found there
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0

    def __post_init__(self) -> None:
        _require(min(self.num_running, self.num_waiting, self.free_blocks) >= 0
                 and self.free_blocks <= self.total_blocks, "heartbeat: inconsistent counts")
        _require(0 <= self.prefix_hits <= self.prefix_queries
                 and min(self.kv_bytes_sent, self.kv_bytes_received) >= 0,
                 "heartbeat: inconsistent totals")
        for rate in (self.step_seconds, self.prefill_s_per_token, self.transfer_s_per_token):
            _require(rate is None or 0 <= rate < float("inf"),
                     "heartbeat: a rate must be a finite number >= 0")


@message("kv_events")
@dataclass(frozen=True, slots=True)
class KVEvents(Message):
    worker_id: str
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    cleared: bool = False  # the worker forgot its whole cache (e.g. restarted)


@message("finished", version=2)
@dataclass(frozen=True, slots=True)
class Finished(Message):
    """A worker is done with a request, at ``stage``."""

    request_id: str
    worker_id: str
    stage: FinishStage
    error: str | None = None


@message("draining")
@dataclass(frozen=True, slots=True)
class Draining(Message):
    """The worker is shutting down: place nothing new on it. It stays registered (KV
    transfers to and from it, its ``Finished`` reports and its heartbeats go on) and
    finishes what it holds; the router answers ``Drained`` once none of its placements is
    left. Sent again after every registration while the drain lasts."""

    worker_id: str


@message("deregister")
@dataclass(frozen=True, slots=True)
class Deregister(Message):
    """The worker leaves now (its drain is over, or it stops at once): the router forgets
    it, and fails whatever it still had placed there back to the gateways as retryable."""

    worker_id: str


# ---- prefill -> decode (KV connector control) -----------------------------------------

KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8")  # a cache's element types


@message("kv_handoff", version=5)
@dataclass(frozen=True, slots=True)
class KVHandoff(Message):
    """Header of a KV transfer; ``num_blocks`` raw frames of ``block_nbytes`` follow.

    Per-choice lists (``first_tokens``, ``first_logprobs``, ``generator_states``,
    ``finished``) have one entry per choice; the blocks cover the prompt from block
    ``first_block`` to its end. A whole transfer (``stream_id`` None) starts at block 0;
    the final transfer of a stream follows its ``num_pieces`` ``KVPiece`` transfers, which
    carried blocks ``0 .. first_block - 1`` under the same ``stream_id``.
    ``common.engine.handoff`` converts it to and from the engine's ``Handoff``.
    """

    transfer_id: str
    request_id: str
    prompt_token_ids: list[int]
    first_tokens: list[int]  # one per choice, sampled by the prefill worker
    first_logprobs: list[TokenLogprob | None]
    generator_states: list[bytes | None]  # seeded choices continue their random stream
    finished: list[bool]  # choices that already ended at their first token
    params: SamplingParams
    reply_to: str
    num_cached_tokens: int
    num_blocks: int
    block_nbytes: int
    layout: list[int]  # [num_layers, block_size, kv_heads, head_dim, element_size]
    kv_dtype: str  # what the blocks' bytes are: one of KV_DTYPES
    stream_id: str | None = None  # the stream this transfer ends; None: a whole transfer
    first_block: int = 0  # index of the first block that follows (the pieces held the rest)
    num_pieces: int = 0  # KVPiece transfers of the stream before this one

    def __post_init__(self) -> None:
        n = len(self.first_tokens)
        _require(n == self.params.n, f"kv_handoff has {n} first tokens for n={self.params.n}")
        _require(len(self.first_logprobs) == len(self.generator_states) == len(self.finished) == n,
                 "kv_handoff: per-choice lists differ in length")
        _require(not all(self.finished), "kv_handoff: every choice has finished already")
        _require(len(self.layout) == 5 and all(x >= 1 for x in self.layout),
                 "kv_handoff.layout needs five positive sizes")
        _require(len(self.prompt_token_ids) >= 1, "kv_handoff: empty prompt")
        need = -(-len(self.prompt_token_ids) // self.layout[1])
        _require(self.num_blocks == need - self.first_block >= 1,
                 f"kv_handoff: {self.num_blocks} blocks from block {self.first_block} for a "
                 f"prompt that needs {need}")
        _require(0 <= self.num_cached_tokens <= len(self.prompt_token_ids),
                 "kv_handoff.num_cached_tokens out of range")
        _require(self.block_nbytes >= 1, "kv_handoff.block_nbytes must be positive")
        _require(self.kv_dtype in KV_DTYPES,
                 f"kv_handoff.kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        streamed = self.stream_id is not None
        _require(streamed == (self.num_pieces > 0) == (self.first_block > 0),
                 "kv_handoff: stream_id, num_pieces and first_block are set together or not at all")
        _require(self.num_pieces <= self.first_block and self.stream_id != "",
                 "kv_handoff: more pieces than streamed blocks, or an empty stream_id")


@message("kv_piece")
@dataclass(frozen=True, slots=True)
class KVPiece(Message):
    """Header of one non-final piece of a KV stream; ``num_blocks`` raw frames follow.

    A prefill worker that computes a long prompt in chunks ships each chunk's full,
    computed blocks as a piece while it computes the next; the stream's final transfer
    is a ``KVHandoff`` with the same ``stream_id``. A piece holds full prompt blocks only
    and never the prompt's last block (that one comes with the final transfer, which is
    sent when the first token is sampled). ``piece`` counts from 0 in sending order.
    """

    transfer_id: str
    stream_id: str
    request_id: str
    piece: int
    first_block: int
    num_blocks: int
    num_prompt_tokens: int  # the decode side reserves blocks for the whole prompt
    block_nbytes: int
    layout: list[int]  # as KVHandoff's
    kv_dtype: str
    reply_to: str  # the gateway's token-stream address (to fail the request from decode)

    def __post_init__(self) -> None:
        _require(bool(self.transfer_id) and bool(self.stream_id) and bool(self.request_id),
                 "kv_piece: empty transfer, stream or request id")
        _require(len(self.layout) == 5 and all(x >= 1 for x in self.layout),
                 "kv_piece.layout needs five positive sizes")
        _require(self.piece >= 0 and self.first_block >= self.piece and self.num_blocks >= 1,
                 "kv_piece: piece, first_block and num_blocks out of range")
        streamable = (self.num_prompt_tokens - 1) // self.layout[1]  # full blocks before the last
        _require(self.first_block + self.num_blocks <= streamable,
                 f"kv_piece: blocks {self.first_block}..{self.first_block + self.num_blocks - 1} "
                 f"are not full blocks before the last of a {self.num_prompt_tokens}-token prompt")
        _require(self.block_nbytes >= 1, "kv_piece.block_nbytes must be positive")
        _require(self.kv_dtype in KV_DTYPES,
                 f"kv_piece.kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")


@dataclass(frozen=True, slots=True)
class ShmSegmentRef:
    """Where a prefill worker's shared KV segment is (``common.shared_memory``): a peer
    with the same ``host`` identity opens ``/proc/<pid>/fd/<fd>`` and checks its size and
    the token written at its start."""

    host: str  # common.shared_memory.host_identity() of the owner
    pid: int
    fd: int
    nbytes: int
    token: bytes  # random per segment: a restarted owner's new segment never passes for the old

    def __post_init__(self) -> None:
        _require(self.pid >= 1 and self.fd >= 0 and self.nbytes >= 1, "shm segment: bad pid, fd or size")
        _require(len(self.token) == 16, "shm segment: the token has 16 bytes")


@message("kv_shm_handoff")
@dataclass(frozen=True, slots=True)
class KVShmHandoff(Message):
    """A KV transfer through same-host shared memory: the header, and where its blocks lie
    in the sender's segment instead of block frames (nothing follows this message).

    The blocks are lent: the receiver copies them out before it acks, and only while the
    sender's monotonic clock (the same host's) reads before ``lent_until``, after which the
    sender may reuse them.
    """

    handoff: KVHandoff | None  # a whole transfer or a stream's final one, or
    piece: KVPiece | None  # a piece of a stream: exactly one of the two is set
    segment: ShmSegmentRef
    offsets: list[int]  # byte offset of each block in the segment, block order
    lent_until: float  # time.monotonic() of the sender by which it may take the blocks back

    def __post_init__(self) -> None:
        _require((self.handoff is None) != (self.piece is None),
                 "kv_shm_handoff: exactly one of handoff and piece")
        _require(all(o >= 0 for o in self.offsets), "kv_shm_handoff: negative block offset")
        # One offset per block is the receiver's check (``check_transfer``), as the frame
        # count is for frames: a short transfer is refused and nacked there, then resent.

    @classmethod
    def of(cls, header: KVHandoff | KVPiece, segment: ShmSegmentRef, offsets: list[int],
           lent_until: float) -> KVShmHandoff:
        piece = header if isinstance(header, KVPiece) else None
        return cls(None if piece else header, piece, segment, offsets, lent_until)

    @property
    def header(self) -> KVHandoff | KVPiece:
        return self.handoff if self.handoff is not None else self.piece


@message("kv_ack")
@dataclass(frozen=True, slots=True)
class KVAck(Message):
    transfer_id: str
    ok: bool
    reason: str = ""
