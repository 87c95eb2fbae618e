"""The stream rewrite on events still unparsed: ``StreamRewrite`` is
``spec.ChunkRewrite`` with a path in front for the chunks vLLM sends most, one
reasoning or content piece of one choice (with continuous usage or without),
matched and rewritten as bytes (``raw`` on a ``data:`` payload, ``framed`` on a
whole event). Each gives what ``chunk`` would give on the parsed payload, or
``None``: the caller parses it and calls ``chunk``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_k3_plugin.wire.spec import ChoiceState, ChunkRewrite

# A chunk as vLLM serialises most of them: compact JSON, scalar envelope fields, one
# choice whose delta is one non-empty reasoning or content string, and otherwise only
# nulls (none under a key the reading depends on). Such a chunk is rewritten without
# parsing it (``StreamRewrite.raw``); any other chunk, or one written another way,
# takes the parsed path. Written as strict JSON: what json.loads refuses fails here.
_CHAR = rb'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_STRING = rb'"' + _CHAR + rb'*+"'
_NONEMPTY_STRING = rb'"' + _CHAR + rb'++"'
_NUMBER = rb"(?:0|-?[1-9][0-9]*+|-0)"
# A piece's text that can be read as the bytes around it say (``StreamRewrite.framed``),
# and its closing quote: no quote or backslash (escapes go the regex's way), nothing
# JSON refuses unescaped.
_PLAIN_TEXT = re.compile(rb'[^"\\\x00-\x1f]++"')
# A server-sent event as vLLM writes one a message (P0.6).
SSE_DATA = b"data: "
SSE_END = b"\n\n"
_ONE_PIECE = re.compile(
    rb'\{(?:(?!"choices")"[a-z_]++":(?:' + _STRING + rb"|" + _NUMBER + rb"|null),)*+"
    rb'"choices":\[\{"index":(0|[1-9][0-9]*+),'
    rb'"delta":\{"(reasoning|content)":(' + _NONEMPTY_STRING + rb")\}"
    rb'(?:,(?!"(?:index|delta)")"[a-z_]++":null)*+\}\]'
    rb'(?:,(?!"choices")"[a-z_]++":null)*+\}'
)
_COUNT = rb"(0|[1-9][0-9]*+)"
# vLLM's continuous usage (``UsageInfo`` dumped as its stream generator sets it).
_USAGE = re.compile(
    rb'\{"prompt_tokens":' + _COUNT + rb',"total_tokens":' + _COUNT
    + rb',"completion_tokens":' + _COUNT
    + rb'(?:,"completion_tokens_details":(null|\{"reasoning_tokens":' + _COUNT
    + rb"\}))?\}"
)  # fmt: skip
# A one-choice chunk with continuous usage, exactly as vLLM writes it: the choice
# ends in its nulls (``token_ids`` on 0.32), the usage follows, then only nulls
# (``kv_transfer_params`` on 0.33). Groups: what precedes the text (its kind in 2),
# the text, what follows it up to the usage, the usage (``_USAGE``), and ``after``.
_ONE_PIECE_WITH_USAGE = re.compile(
    rb'(\{(?:(?!"(?:choices|prompt_token_ids)")"[a-z_]++":(?:' + _STRING + rb"|"
    + _NUMBER + rb'|null),)*+"choices":\[\{"index":0,"delta":\{"(reasoning|content)'
    rb'":")(' + _CHAR + rb'++)'
    rb'("\},"logprobs":null,"finish_reason":null(?:,"token_ids":null)?\}\],"usage":)'
    rb"(" + _USAGE.pattern + rb")"
    rb'(?P<after>(?:,(?!"(?:choices|usage|prompt_token_ids)")"[a-z_]++":null)*+)\}'
)  # fmt: skip
# What the parsed path writes after such a chunk's text: the choice without its
# token ids (the client did not ask for them).
_USAGE_MIDDLE = b'"},"logprobs":null,"finish_reason":null}],"usage":'


@dataclass
class StreamRewrite(ChunkRewrite):
    """One streamed response: ``framed`` takes each whole event, ``raw`` each
    ``data:`` payload ``framed`` did not take; what neither takes is parsed and
    goes to ``chunk`` (``ChunkRewrite``), and ``done`` is called at ``[DONE]``."""

    # The bytes around the text of a one-choice stream's one-piece events, as the
    # first of each kind that ``raw`` read showed them (``framed``): the tail when
    # the events carry no usage, else what leads from the text to the usage.
    _reasoning_head: bytes | None = None
    _content_head: bytes | None = None
    _tail: bytes | None = None
    _usage_middle: bytes | None = None
    _usage_end: bytes | None = None

    @property
    def _usage_bytes_path(self) -> bool:
        """One choice whose frames carry the continuous usage the client asked for
        and no token ids: ``raw`` reads them too."""
        asked = self.asked
        return (
            asked.continuous_usage
            and asked.choices == 1
            and not (asked.internal_content or asked.token_ids)
        )

    def raw(self, data: bytes) -> bytes | None:
        """``chunk`` on a ``data:`` payload still unparsed, for the chunks vLLM sends
        most (one reasoning or content piece; see ``_ONE_PIECE``, and
        ``_ONE_PIECE_WITH_USAGE`` for continuous usage): the bytes to send, or
        ``None``: parse it and call ``chunk``. Same result as ``chunk`` would give,
        without reading or writing the JSON."""
        if self._envelope is None:
            return None
        if self._usage_bytes_path:
            return self._raw_with_usage(data)
        if not self._plain:
            return None
        found = _ONE_PIECE.fullmatch(data)
        if found is None or not (data.isascii() or _utf8(data)):
            return None
        index = int(found.group(1))
        state = self._choices.get(index) or self._choices.setdefault(
            index, ChoiceState()
        )
        if index == 0 and self.asked.choices == 1:
            self._learn(data, found)
        if found.group(2) == b"reasoning":
            state.reasoning_sent = True
            end = found.end(3)
            return data[:end] + b',"reasoning_content":' + found.group(3) + data[end:]
        return None if state.boundary_due else data

    def _learn(self, data: bytes, found: re.Match[bytes]) -> None:
        text_start, text_end = found.start(3) + 1, found.end(3) - 1
        head = SSE_DATA + data[:text_start]
        if found.group(2) == b"reasoning":
            self._reasoning_head = head
        else:
            self._content_head = head
        if self._tail is None:
            self._tail = data[text_end:] + SSE_END

    def _raw_with_usage(self, data: bytes) -> bytes | None:
        found = _ONE_PIECE_WITH_USAGE.fullmatch(data)
        if found is None or not (data.isascii() or _utf8(data)):
            return None
        state = self._choices.get(0) or self._choices.setdefault(0, ChoiceState())
        reasoning = found.group(2) == b"reasoning"
        head = SSE_DATA + found.group(1)
        if reasoning:
            self._reasoning_head = head
        else:
            self._content_head = head
        self._usage_middle = found.group(4)
        self._usage_end = found["after"] + b"}" + SSE_END
        if not reasoning and state.boundary_due:
            return None
        usage = _USAGE.fullmatch(data, found.start(5), found.end(5))
        return self._with_usage(
            state, reasoning, found.group(1), found.group(3), usage, data
        )[len(SSE_DATA) : -len(SSE_END)]

    def _with_usage(
        self,
        state: ChoiceState,
        reasoning: bool,
        head: bytes,
        text: bytes,
        usage: re.Match[bytes],
        data: bytes,
    ) -> bytes:
        """The event of a one-piece chunk with continuous usage, as the parsed path
        writes it; ``head`` without the event's ``data: ``."""
        prompt, total, completion, details, reasoning_tokens = usage.groups()
        state.usage = {
            "prompt_tokens": int(prompt),
            "total_tokens": int(total),
            "completion_tokens": int(completion),
        }
        if details is not None:
            state.usage["completion_tokens_details"] = (
                None
                if reasoning_tokens is None
                else {"reasoning_tokens": int(reasoning_tokens)}
            )
        usage_bytes = data[usage.start() : usage.end()]
        if self.facts.known:
            cached = b',"prompt_tokens_details":{"cached_tokens":%d}}' % (
                self.facts.cached_tokens
            )
            usage_bytes = usage_bytes[:-1] + cached
        if reasoning:
            state.reasoning_sent = True
            text += b'","reasoning_content":"' + text
        end = self._usage_end
        return SSE_DATA + head + text + _USAGE_MIDDLE + usage_bytes + end

    def framed(self, event: bytes) -> bytes | None:
        """``raw`` on a whole event (``data: `` and its payload and the blank line),
        for the events of a one-choice stream that differ from one ``raw`` has read
        only in their text (and usage counts), and whose text holds no quote,
        backslash or control character: the bytes to send (``event`` itself if
        unchanged), or ``None``: call ``raw``. Compares bytes and reads nothing
        else, so most of a stream's events cost the switch a few comparisons."""
        head = self._content_head
        only = self._choices.get(0)
        if head is not None and event.startswith(head):
            if only.reasoning_sent and not only.boundary_sent:
                return None  # the boundary goes before it
            reasoning = False
        else:
            head = self._reasoning_head
            if head is None or not event.startswith(head):
                return None
            reasoning = True
        start = len(head)
        text_and_quote = _PLAIN_TEXT.match(event, start)
        if text_and_quote is None:
            return None
        end = text_and_quote.end() - 1
        if not (event.isascii() or _utf8(event[start:end])):
            return None
        middle = self._usage_middle
        if middle is not None:
            usage_end = len(event) - len(self._usage_end)
            usage = _USAGE.fullmatch(event, end + len(middle), usage_end)
            if (
                usage is None
                or not event.startswith(middle, end)
                or not event.endswith(self._usage_end)
            ):
                return None
            text = event[start:end]
            head = event[len(SSE_DATA) : start]
            return self._with_usage(only, reasoning, head, text, usage, event)
        tail = self._tail
        if tail is None or len(event) - end != len(tail) or not event.endswith(tail):
            return None
        if not reasoning:
            return event
        only.reasoning_sent = True
        text = event[start:end]
        return event[:end] + b'","reasoning_content":"' + text + event[end:]


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
