"""The plugin's metrics on vLLM's ``/metrics`` through a real ``vllm serve``: a known
set of shapes sent on each of the six endpoint readings, and the scrape's deltas
are exactly what they should be (issue 26's must-show 1)."""

from __future__ import annotations

import re
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.test_bad_outputs import ARGUMENT, CALL
from tests.support.endpoints import ENDPOINTS
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS, output_ids

pytestmark = pytest.mark.server

LABELS = {
    "chat": ("chat_completions", "false"),
    "chat-stream": ("chat_completions", "true"),
    "responses": ("responses", "false"),
    "responses-stream": ("responses", "true"),
    "messages": ("messages", "false"),
    "messages-stream": ("messages", "true"),
}
DROPPED = (
    "Before" + '<|open|>widget size="3"<|sep|>gone<|close|>widget<|sep|>'
    + vocab.TOOLS_START + '<|open|>call index="1"<|sep|>' + ARGUMENT + "x"
    + vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END + vocab.MESSAGE_END
)  # fmt: skip
NOT_JSON = (
    vocab.TOOLS_START + CALL + '<|open|>json type="object"<|sep|>city = Bern'
    + vocab.JSON_END + vocab.CALL_END + vocab.TOOLS_END + vocab.MESSAGE_END
)  # fmt: skip
UNDECLARED = (
    vocab.TOOLS_START + CALL.replace("get_weather", "launch") + ARGUMENT + "x"
    + vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END + vocab.MESSAGE_END
)  # fmt: skip


def scrape(url: str) -> Counter:
    """Every ``vllm_k3_*`` sample, by name and labels."""
    text = httpx.get(url + "/metrics", timeout=30).text
    samples: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm_k3_") and not sample.name.endswith(
                "_created"
            ):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = (
                    sample.value
                )
    return samples


def expected(endpoint: str, stream: str) -> Counter:
    base = {"endpoint": endpoint, "stream": stream}

    def key(name, **labels):
        return (name, tuple(sorted({**base, **labels}.items())))

    want = Counter()
    for ending in ("answered", "skipped_channel_replayed", "thought_only", "cut"):
        want[key("vllm_k3_outputs_total", ending=ending)] = 1
    want[key("vllm_k3_outputs_total", ending="tool_calls")] = 2
    want[key("vllm_k3_outputs_total", ending="answered")] += 1  # DROPPED's text
    want[key("vllm_k3_tool_calls_total", outcome="parsed")] = 2
    want[key("vllm_k3_tool_calls_dropped_total", reason="unnamed_call")] = 1
    # The widget's opener and its closer, each a tag dropped whole.
    want[key("vllm_k3_markup_dropped_total", kind="element_outside_tools")] = 2
    want[key("vllm_k3_tool_calls_undeclared_total")] = 1
    # NOT_JSON: a call whose arguments are text, kept as text where the endpoint
    # needs an object (``/v1/messages``).
    want[key("vllm_k3_outputs_total", ending="tool_calls")] += 1
    want[key("vllm_k3_tool_calls_total", outcome="parsed")] += 1
    if endpoint == "messages":
        want[key("vllm_k3_arguments_kept_as_text_total")] = 1
    return want


def test_each_reading_is_counted_as_it_ended(k3_server):
    sends = [
        (SHAPES["think-then-reply"].output, True, None),
        (SHAPES["skipped-channel"].output, True, None),
        (SHAPES["no-closer"].output, True, None),
        (SHAPES["think-then-reply"].output, True, 3),  # cut by max_tokens
        (SHAPES["tools-in-think"].output, True, None),
        (UNDECLARED, False, None),
        (DROPPED, False, None),
        (NOT_JSON, False, None),
    ]
    for reading, read in sorted(ENDPOINTS.items()):
        before = scrape(k3_server)
        for output, thinking, max_tokens in sends:
            ids = output_ids(output, stop=max_tokens is None)
            read(
                k3_server,
                ids,
                max_tokens=max_tokens or len(ids) + 8,
                thinking=thinking,
                tools=TOOLS,
            )
        after = scrape(k3_server)
        counted = {
            key: after[key] - before.get(key, 0)
            for key in after
            if key[0].endswith("_total") and after[key] != before.get(key, 0)
        }
        assert counted == expected(*LABELS[reading]), reading
        # The think channel's decision: one observation per output that had one.
        decided = [
            after[key] - before.get(key, 0)
            for key in after
            if key[0] == "vllm_k3_think_decided_after_characters_count"
            and dict(key[1])["endpoint"] == LABELS[reading][0]
            and dict(key[1])["stream"] == LABELS[reading][1]
        ]
        assert decided == [5], reading  # the thinking-on sends


def test_the_dashboard_reads_metrics_the_server_has(k3_server):
    """Every series ``examples/grafana_dashboard.json`` queries is on ``/metrics``
    (the plugin's, once an output was read, and vLLM's own)."""
    import json
    from pathlib import Path

    dashboard = Path(__file__).parents[2] / "examples" / "grafana_dashboard.json"
    exprs = [
        target["expr"]
        for panel in json.loads(dashboard.read_text())["panels"]
        for target in panel["targets"]
    ]
    wanted = {name for expr in exprs for name in re.findall(r"vllm[_:][a-z_:]+", expr)}
    ids = output_ids(SHAPES["think-then-reply"].output, stop=True)
    ENDPOINTS["chat"](k3_server, ids, max_tokens=len(ids) + 8)  # one output read
    text = httpx.get(k3_server + "/metrics", timeout=30).text
    served = set(re.findall(r"^(vllm[_:][a-z_:]+)", text, re.MULTILINE))
    assert wanted and wanted <= served, sorted(wanted - served)


def test_several_api_servers_count_into_one_scrape(tiny_checkpoint, tmp_path):
    """``vllm serve --api-server-count 2``: two API server processes, Prometheus in
    vLLM's multiprocess mode; the outputs both read are summed on one
    ``/metrics``, whichever process answers the scrape."""
    from tests.support.server import running_server

    ids = output_ids(SHAPES["think-then-reply"].output, stop=True)
    log = tmp_path / "vllm-serve.log"
    with running_server(
        tiny_checkpoint, log, "--api-server-count", "2", cli=True
    ) as url:
        before = scrape(url)
        for _ in range(8):
            ENDPOINTS["chat"](url, ids, max_tokens=len(ids) + 8)
        key = (
            "vllm_k3_outputs_total",
            (("ending", "answered"), ("endpoint", "chat_completions"),
             ("stream", "false")),
        )  # fmt: skip
        for _ in range(4):  # each scrape may land on either process
            assert scrape(url)[key] - before.get(key, 0) == 8
    servers = set(re.findall(r"ApiServer_(\d) pid", log.read_text(errors="replace")))
    assert servers == {"0", "1"}
