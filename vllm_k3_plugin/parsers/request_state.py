"""What a request tells the reader: where the output starts, and how it ended.

The thinking switch comes from the chat template kwargs the parser is built with;
the rest from the request's facts (``request_facts.RequestFacts``), read once.

vLLM hands parsers no finish reason. It keeps the stop token (EOS or a
``stop_token_ids`` entry) in the output token ids while dropping it from the text, so
a last id in the stop set means the model stopped itself. A stop string leaves no such
id; it is told from a length cut by the token budget: an output that did not reach
``max_tokens`` or the model length, in a request that set stop strings, was ended by
one. Everything else (a length cut, an abort) is "not stopped".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_k3_plugin.format.channel_ids import Decode, reasoning_open_after
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.parsers.request_facts import RequestFacts


def thinking_requested(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """The request's thinking switch, as the K3 chat template reads it."""
    kwargs = chat_template_kwargs or {}
    thinking = kwargs.get("thinking")
    if thinking is None:
        thinking = kwargs.get("enable_thinking", True)
    return bool(thinking)


def start_channel(
    prompt_ids: Sequence[int] | None, decode: Decode, thinking: bool
) -> Channel:
    """Rule 2: the prompt's last channel element, else the thinking setting."""
    if prompt_ids:
        open_think = reasoning_open_after(prompt_ids, decode)
        if open_think is not None:
            return Channel.THINK if open_think else Channel.RESPONSE
    return Channel.THINK if thinking else Channel.RESPONSE


def model_stopped(
    facts: RequestFacts, *, last_id: int | None, output_len: int, prompt_len: int
) -> bool:
    """Whether the output ended by EOS, a stop token or a stop string."""
    if last_id is not None and last_id in facts.stop_ids:
        return True
    if not facts.stop_strings:
        return False
    budget = facts.budget
    if budget is not None and output_len >= budget:
        return False
    max_model_len = facts.max_model_len
    return not (max_model_len is not None and prompt_len + output_len >= max_model_len)
