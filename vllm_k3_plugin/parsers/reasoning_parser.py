"""``kimi_k3`` as a vLLM ``ReasoningParser``.

Two callers use it:

- the engine core, for structured output: ``is_reasoning_end`` on the prompt and
  ``is_reasoning_end_streaming`` once per decode step (it runs every step: it looks at
  the delta only); the grammar constrains from the token after the end. vLLM 0.34
  asks ``reasoning_end_token_ids`` first and, where a parser names any,
  ``find_reasoning_end`` on a step's ids alone; K3's reasoning ends on an element,
  never on one id, so it names none and 0.34 asks as 0.32 and 0.33 do. 0.34 passes
  token buffers and views rather than lists: both functions only index and slice
  (0.34's view copies the request's ids on its first read, once a step while a
  structured request reasons, as 0.33 copied the list);
- the API server, through our combined parser (``parser.K3Parser``), which owns the
  reader. The streaming and non-streaming methods here are for callers that drive a
  bare reasoning parser; they use the same reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.reasoning import ReasoningParser

from vllm_k3_plugin.envs import replay_policy
from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.format.channel_ids import (
    count_reasoning_ids,
    reasoning_ends_in_delta,
    reasoning_open_after,
    reasoning_span_end,
)
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import (
    ReasoningReader,
    collect,
    read_whole,
)
from vllm_k3_plugin.parsers.deltas import delta_message
from vllm_k3_plugin.parsers.request_state import start_channel, thinking_requested

_ATOM_TOKENS: dict[int, tuple[Any, marked.AtomTokens]] = {}


def _atom_tokens(tokenizer: Any) -> marked.AtomTokens:
    # Keyed by identity; the tokenizer is kept with its table (a server has one).
    found = _ATOM_TOKENS.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=False)

        found = _ATOM_TOKENS[id(tokenizer)] = (tokenizer, marked.AtomTokens(decode))
    return found[1]


class K3ReasoningParser(ReasoningParser):
    """The Kimi-K3 think channel, read by ``ReasoningReader``."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if tokenizer is None:
            raise ValueError("the kimi_k3 reasoning parser needs the model tokenizer")
        self.thinking = thinking_requested(kwargs.get("chat_template_kwargs"))
        self.policy = replay_policy()
        self._prompt_ids: Sequence[int] | None = None
        self._reader: ReasoningReader | None = None

    # -- shared helpers ---------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def atom_tokens(self) -> marked.AtomTokens:
        """Which tokens can end an atom spelled in BPE pieces: one table per
        tokenizer, shared by every request (it is filled as tokens are seen)."""
        return _atom_tokens(self.model_tokenizer)

    def start(self, prompt_ids: Sequence[int] | None = None) -> Channel:
        ids = prompt_ids if prompt_ids is not None else self._prompt_ids
        return start_channel(ids, self.decode, self.thinking)

    # -- vLLM ReasoningParser API -----------------------------------------------------

    @property
    def reasoning_start_str(self) -> str | None:
        return vocab.THINK_START

    @property
    def reasoning_end_str(self) -> str | None:
        return vocab.THINK_END

    def adjust_request(self, request: Any) -> Any:
        # The markers are added tokens; the reader needs them in the text, unspaced.
        request.skip_special_tokens = False
        if hasattr(request, "spaces_between_special_tokens"):
            request.spaces_between_special_tokens = False
        return request

    def set_prompt_token_ids(self, prompt_token_ids: Sequence[int]) -> None:
        # vLLM 0.33 hands the rendered prompt here; 0.32 never calls it.
        self._prompt_ids = prompt_token_ids

    def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        self._prompt_ids = prompt_token_ids

    # vLLM 0.34's structured-output gate (0.32 and 0.33 never ask). The think
    # channel ends on ``<|close|>think<|sep|>``, a response opener or a tools
    # opener the next ids decide: several ids, and the gate would hand
    # ``find_reasoning_end`` one step's ids without those before them. So no id
    # ends reasoning alone, and the gate reads each step with
    # ``is_reasoning_end_streaming``, which sees what precedes the step.
    @property
    def reasoning_end_token_ids(self) -> frozenset[int]:
        return frozenset()

    @property
    def implicit_reasoning_end_token_ids(self) -> frozenset[int]:
        return frozenset()

    def find_reasoning_end(self, token_ids: Sequence[int]) -> None:
        return None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        open_think = reasoning_open_after(input_ids, self.decode)
        if open_think is None:
            return not self.thinking
        return not open_think

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Iterable[int]
    ) -> bool:
        delta_len = len(delta_ids) if isinstance(delta_ids, Sequence) else None
        if delta_len is None:
            delta_len = len(list(delta_ids))
        if delta_len == 0:
            return False
        return reasoning_ends_in_delta(input_ids, delta_len, self.decode)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        end = reasoning_span_end(input_ids, self.decode, starts_in_think=True)
        return input_ids[end:]

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        starts_in_think = self.start() is Channel.THINK
        return count_reasoning_ids(
            token_ids, self.decode, starts_in_think=starts_in_think
        )

    def extract_reasoning(
        self, model_output: str, request: Any
    ) -> tuple[str | None, str | None]:
        # This entry point gets no token ids, so it cannot know how the output
        # ended: it reads as a cut output (nothing replayed). Our combined parser
        # never calls it; it reads with the finish it learns from the token ids.
        reading = read_whole(
            model_output,
            start=self.start(),
            stopped=False,
            policy=self.policy,
            tools_as_content=True,
        )
        return reading.reasoning or None, reading.content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if self._reader is None:
            self._reader = ReasoningReader(start=self.start(), policy=self.policy)
        reading = collect(self._reader.feed(delta_text), tools_as_content=True)
        return delta_message(reading.reasoning, reading.content)
