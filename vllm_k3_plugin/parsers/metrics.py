"""What the kimi_k3 parsers read, on vLLM's ``/metrics`` (Prometheus).

Counted in the API server, once per output, when the combined parser finishes
reading it (``K3Parser``), labelled by the endpoint that served it and whether it
streamed. A streamed output whose stream closes before its end was read (its client
left, or an error ended the stream) is counted ``aborted`` when the stream closes
(``StreamTally``), so each output that began is counted once, whatever the order in
which its end and its client's leaving reach the server. The per-token path pays
nothing but a few attribute updates on events it already handles (a call opened, cut
or dropped); a stream, one more generator step a chunk (``tallied``). The metrics
are made on first use with ``prometheus_client``'s default registry: vLLM serves
that registry, and in its multiprocess mode (several API servers) each process
writes its values where vLLM's ``/metrics`` collects them. ``VLLM_K3_METRICS=0``
counts nothing.

``README.md`` says what each metric means.
"""

from __future__ import annotations

import collections
import contextvars
from collections.abc import AsyncGenerator, Iterable
from typing import Any, NamedTuple

from vllm_k3_plugin.envs import metrics as metrics_enabled
from vllm_k3_plugin.format.events import CALL_DROPS, CallCut, CallOpened, Dropped

ENDINGS = (
    "answered",
    "skipped_channel_replayed",
    "thought_only",
    "cut",
    "tool_calls",
    "empty",
    "aborted",
)
# Characters read before the think channel was decided.
_DECIDED_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, float("inf"))


class StreamTally:
    """A streamed request's outputs: how many began (their first delta read) and
    how many ended (their last), as the parser reads them (``RequestFacts.tally``);
    at the stream's close (``tallied``), the outputs that began and did not end are
    counted ``aborted``. Held by the request's entry, not by a task: vLLM may read a
    stream in a new task for each chunk (``--sse-keep-alive-interval``)."""

    __slots__ = ("began", "ended", "labels")

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = labels
        self.began = 0
        self.ended = 0

    def close(self) -> None:
        unfinished, self.began = self.began - self.ended, self.ended
        if unfinished > 0 and metrics_enabled():
            _metrics().outputs.labels(*self.labels, "aborted").inc(unfinished)


class Serving(NamedTuple):
    """How a request's outputs are counted."""

    labels: tuple[str, str]
    """``(endpoint, stream)``."""
    tally: StreamTally | None
    """A streamed request's tally; ``None`` for a whole reply."""


_SERVING: contextvars.ContextVar[Serving | None] = contextvars.ContextVar(
    "vllm_k3_plugin_serving", default=None
)
_OTHER = Serving(("other", "false"), None)


# How requests being served are counted, by the identity of the request object the
# parser is handed: a stream is read in the response's task, which does not see
# what the handler's task set (vLLM runs handlers in a task of their own). Each
# output of the request (``n`` of them) reads its entry; the oldest go past the
# bound, and a new request at a reused identity is stamped afresh.
_LABELS: collections.OrderedDict[int, Serving] = collections.OrderedDict()
_MAX_LABELS = 16384


def serving(endpoint: str, stream: Any, request: Any = None) -> StreamTally | None:
    """The request being served: ``endpoint`` as the metrics name it, the first
    that says so (``/v1/messages`` runs through chat completions); ``request``: the
    object the parser will be handed, if this is it (``/v1/messages``' inner chat
    request gets its entry). The first to say so of a streamed request gets the
    tally its stream is closed with (``tallied``)."""
    served = _SERVING.get()
    new_tally = None
    if served is None:
        labels = (endpoint, "true" if stream else "false")
        new_tally = StreamTally(labels) if stream else None
        served = Serving(labels, new_tally)
        _SERVING.set(served)
    if request is not None:
        _LABELS[id(request)] = served
        _LABELS.move_to_end(id(request))
        while len(_LABELS) > _MAX_LABELS:
            _LABELS.popitem(last=False)
    return new_tally


async def tallied(
    stream: AsyncGenerator[Any, None], tally: StreamTally
) -> AsyncGenerator[Any, None]:
    """``stream``; when it closes, however it ends (read to its end, an error, or
    closed or cancelled when its client left), its outputs that began and did not
    end are counted ``aborted``."""
    try:
        async for item in stream:
            yield item
    finally:
        try:
            tally.close()
        finally:
            await stream.aclose()


def serving_of(request_id: int, *, outputs: int) -> Serving:
    """How an output of the request whose identity is ``request_id`` is counted
    (``id(request)``, as ``serving`` stamped it), looked up when the output's
    reading begins (``request_facts.read_request``)."""
    # Kept for the request's other outputs (``n``); with one, dropped now, so that
    # a later request at the same identity that was never stamped reads "other".
    kept = outputs > 1
    served = _LABELS.get(request_id) if kept else _LABELS.pop(request_id, None)
    return served or _SERVING.get() or _OTHER


class _Metrics(NamedTuple):
    outputs: Any
    markup_dropped: Any
    tool_calls: Any
    tool_calls_dropped: Any
    tool_calls_undeclared: Any
    decided_after: Any
    kept_as_text: Any


_METRICS: _Metrics | None = None


def _metrics() -> _Metrics:
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Histogram

        labels = ("endpoint", "stream")
        _METRICS = _Metrics(
            Counter(
                "vllm_k3_outputs",
                "Kimi-K3 outputs the kimi_k3 parsers read, by how each ended.",
                (*labels, "ending"),
            ),
            Counter(
                "vllm_k3_markup_dropped",
                "K3 markup read as no structure and dropped, by kind.",
                (*labels, "kind"),
            ),
            Counter(
                "vllm_k3_tool_calls",
                "Tool calls read: parsed (closed) or cut by the end of the output.",
                (*labels, "outcome"),
            ),
            Counter(
                "vllm_k3_tool_calls_dropped",
                "Calls the model began that no call came of, by reason.",
                (*labels, "reason"),
            ),
            Counter(
                "vllm_k3_tool_calls_undeclared",
                "Tool calls to a tool the request did not declare.",
                labels,
            ),
            Histogram(
                "vllm_k3_think_decided_after_characters",
                "Characters of the think channel read before it was decided as "
                "thought or reply (held back that long under hold-back).",
                labels,
                buckets=_DECIDED_BUCKETS,
            ),
            Counter(
                "vllm_k3_arguments_kept_as_text",
                "Tool-call arguments that were not a JSON object where the endpoint "
                'needs one, sent as {"_raw_arguments": "<the text>"}.',
                labels,
            ),
        )
    return _METRICS


class OutputCounts:
    """One output's tool-call events, counted as they pass."""

    __slots__ = ("calls", "cut", "dropped", "undeclared")

    def __init__(self) -> None:
        self.calls = 0
        self.cut = 0
        self.undeclared = 0
        self.dropped: dict[str, int] = {}

    def events(self, events: Iterable[Any]) -> None:
        for event in events:
            kind = type(event)
            if kind is CallOpened:
                self.calls += 1
            elif kind is CallCut:
                self.cut += 1
            elif kind is Dropped:
                self.dropped[event.kind] = self.dropped.get(event.kind, 0) + 1


def ending(
    *, stopped: bool, calls: int, replayed: bool, content: bool, reasoning: bool
) -> str:
    """How an output ended, as ``vllm_k3_outputs_total`` labels it."""
    if not stopped:
        return "cut"
    if calls:
        return "tool_calls"
    if replayed:
        return "skipped_channel_replayed"
    if content:
        return "answered"
    if reasoning:
        return "thought_only"
    return "empty"


def count_output(
    counts: OutputCounts,
    labels: tuple[str, str],
    *,
    ended: str,
    markup_dropped: dict[str, int],
    decided_after: int | None,
) -> None:
    """Count one finished output, under ``labels`` (``serving_of``)."""
    if not metrics_enabled():
        return
    metrics = _metrics()
    metrics.outputs.labels(*labels, ended).inc()
    for kind, number in markup_dropped.items():
        metrics.markup_dropped.labels(*labels, kind).inc(number)
    for kind, number in counts.dropped.items():
        if kind in CALL_DROPS:
            metrics.tool_calls_dropped.labels(*labels, kind).inc(number)
        else:
            metrics.markup_dropped.labels(*labels, kind).inc(number)
    if counts.calls:
        metrics.tool_calls.labels(*labels, "parsed").inc(counts.calls - counts.cut)
    if counts.cut:
        metrics.tool_calls.labels(*labels, "cut").inc(counts.cut)
    if counts.undeclared:
        metrics.tool_calls_undeclared.labels(*labels).inc(counts.undeclared)
    if decided_after is not None:
        metrics.decided_after.labels(*labels).observe(decided_after)


def count_kept_as_text(endpoint: str, stream: bool) -> None:
    """One call's arguments kept as text where the endpoint needs an object."""
    if metrics_enabled():
        labels = (endpoint, "true" if stream else "false")
        _metrics().kept_as_text.labels(*labels).inc()
