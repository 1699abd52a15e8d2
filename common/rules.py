"""Rules every layer applies to a request, each in one place: the gateway (to answer the
client early and precisely), the router (to refuse what no worker can serve) and the
engine (which trusts nobody) call the same functions, so they cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence

from common.errors import InvalidRequestError, PromptTooLongError

TOKEN_ID_LIMIT = 2**32  # block hashes pack ids as uint32; no vocabulary is larger


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def decode_blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks a decode worker must have free to take a prefilled prompt: the prompt's,
    plus one for the tokens that follow."""
    return blocks_for_tokens(num_prompt_tokens, block_size) + 1


def check_not_empty(num_tokens: int, where: str = "prompt") -> None:
    if not num_tokens:
        raise InvalidRequestError(f"{where} must not be empty", where)


def check_token_ids(ids: Sequence[object], vocab_size: int | None, where: str = "prompt") -> None:
    """Every id is an int in ``[0, vocab_size)`` (or below ``TOKEN_ID_LIMIT`` without one)."""
    check_not_empty(len(ids), where)
    bound = vocab_size if vocab_size is not None else TOKEN_ID_LIMIT
    if set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < bound:
        return  # the common case in C-speed passes; the loop below names the first bad id
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequestError(f"{where} token {i} must be an integer, got {type(t).__name__}",
                                      where)
        if not 0 <= t < bound:
            raise InvalidRequestError(f"{where} token {i} ({t}) is not a token id: token ids are "
                                      f"[0, {bound})", where)


def check_logit_bias(pairs: Sequence[tuple[int, float]], vocab_size: int | None) -> None:
    """Every token id ``logit_bias`` names is in the vocabulary (a 400 naming the field)."""
    for token, _ in pairs:
        if vocab_size is not None and token >= vocab_size:
            raise InvalidRequestError(f"logit_bias: {token} is not a token id (vocabulary size "
                                      f"{vocab_size})", "logit_bias")


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  where: str = "prompt") -> int:
    """The completion's token budget: ``max_tokens``, or the rest of the context when absent.

    Raises ``PromptTooLongError`` (OpenAI's ``context_length_exceeded``) when the prompt
    leaves no room, or the prompt plus ``max_tokens`` exceeds ``max_model_len``.
    """
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if prompt_len >= max_model_len:
        raise PromptTooLongError(
            f"{limit} However, your {where} resulted in {prompt_len} tokens, which leaves no "
            f"room for the completion. Please reduce the length of the {where}.", where)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"{limit} However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
            f"the {where}, {max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion.", where)
    return max_tokens
