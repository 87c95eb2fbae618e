"""Kimi-K3 over two "nodes": vLLM's multi-node launches, each node a process group
of its own on this host, reaching the other through the addresses and ports its
flags name (``tests/support/nodes.py``), the test-only collectives stand-in loaded
in every process (``tests/support/cpu_collectives.py``).

- Data parallel 2 with expert parallelism, one DP rank a node
  (``--data-parallel-size-local 1``; the other ``--headless
  --data-parallel-start-rank 1``); tensor parallel 2 and pipeline parallel 2, one
  rank a node (``--nnodes 2 --node-rank``, the other ``--headless``): the
  reference's greedy tokens and logprobs; the plugin registered in every process of
  both nodes.
- A node lost: the other node's processes killed while four streams are open:
  each stream ends within 30 s with vLLM's error frame, ``/health`` fails, the
  head exits.
- A node that builds another class (``tests/support/other_class.py``): the server
  stops at start, naming that node's rank.

CI runs the DP launch and the lost node under tensor parallel; the rest is marked
``multinode`` and runs with ``scripts/test_multinode.sh`` (docs/testing.md).
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.support.model_checks import (
    assert_reference,
    greedy,
    greedy_concurrently,
    prompts,
)
from tests.support.nodes import kill_node, registered_processes, two_nodes, wait_exit
from tests.support.other_class import OTHER_CLASS_ENV

pytestmark = [pytest.mark.server, pytest.mark.model_server]

MULTINODE = pytest.mark.multinode
# The processes of a node that load vLLM's general plugins, as vLLM names them
# in its log: the launching process, API servers, engine cores and workers.
PLUGIN_PROCESSES = re.compile(
    r"\(((?:MainProcess|APIServer|ApiServer_\d+|EngineCore(?:_DP\d+)?|"
    r"VllmWorker-\d+|Worker\S*)) pid=(\d+)\)"
)


@pytest.fixture(
    scope="module",
    params=[
        "dp2-ep",
        pytest.param("tp2", marks=MULTINODE),
        pytest.param("pp2", marks=MULTINODE),
    ],
)
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def nodes(layout, tiny_k3_checkpoint, tmp_path_factory):
    with two_nodes(
        tiny_k3_checkpoint, tmp_path_factory.mktemp(f"k3-nodes-{layout}"), layout
    ) as launched:
        yield launched


def test_every_process_of_both_nodes_registers_the_plugin(nodes):
    for node in (nodes.head, nodes.other):
        text = node.text()
        pids = {int(pid) for _, pid in PLUGIN_PROCESSES.findall(text)}
        registered = {pid for _, pid in registered_processes(text)}
        assert registered, node.log
        assert pids <= registered, (node.log, pids - registered)


def test_the_reference_tokens_and_logprobs(nodes, k3_reference_model):
    # One request alone (one rank idle), then all eight at once.
    batch = prompts()
    served = [greedy(nodes.url, batch[-1]), *greedy_concurrently(nodes.url, batch)]
    assert_reference([batch[-1], *batch], served, k3_reference_model)


OPEN_STREAMS = 4
FRAMES_BEFORE_THE_LOSS = 3
STREAM_END_S = 30.0
HEAD_EXIT_S = 60.0


def _open_stream(url: str, started: threading.Barrier, ended: dict) -> None:
    """A long chat completion, streamed; records its last frames and when and
    how it ended."""
    frames: list[str] = []
    how = "closed"
    try:
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={
                "model": "k3-tiny",
                "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": 3000,
                "min_tokens": 3000,
                "stream": True,
            },
            timeout=120,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    frames.append(line.removeprefix("data: "))
                    if len(frames) == FRAMES_BEFORE_THE_LOSS:
                        started.wait(timeout=120)
    except httpx.HTTPError as error:
        how = repr(error)
    ended[threading.get_ident()] = (time.monotonic(), how, frames)


@pytest.mark.parametrize(
    "layout_lost", [pytest.param("dp2-ep", marks=MULTINODE), "tp2"]
)
def test_a_lost_node_ends_every_stream_and_the_server(
    layout_lost, tiny_k3_checkpoint, tmp_path_factory
):
    log_dir = tmp_path_factory.mktemp(f"k3-lost-{layout_lost}")
    with two_nodes(tiny_k3_checkpoint, log_dir, layout_lost) as launched:
        started = threading.Barrier(OPEN_STREAMS + 1)
        ended: dict = {}
        streams = [
            threading.Thread(target=_open_stream, args=(launched.url, started, ended))
            for _ in range(OPEN_STREAMS)
        ]
        for stream in streams:
            stream.start()
        started.wait(timeout=120)
        lost_at = time.monotonic()
        kill_node(launched.other)
        for stream in streams:
            stream.join(timeout=STREAM_END_S + 30)
        assert len(ended) == OPEN_STREAMS, "a stream still open"
        for ended_at, how, frames in ended.values():
            assert ended_at - lost_at < STREAM_END_S, how
            assert how == "closed", how
            assert frames[-1] == "[DONE]", frames[-3:]
            error = json.loads(frames[-2])["error"]
            assert error["code"] == 500 and error["message"], error
        with pytest.raises((httpx.HTTPStatusError, httpx.TransportError)):
            httpx.get(launched.url + "/health", timeout=5).raise_for_status()
        assert wait_exit(launched.head.process, HEAD_EXIT_S) is not None


@MULTINODE
def test_a_node_with_another_class_stops_the_server(
    tiny_k3_checkpoint, tmp_path_factory
):
    log_dir = tmp_path_factory.mktemp("k3-other-class")
    with (
        pytest.raises(RuntimeError, match="vllm serve exited"),
        two_nodes(tiny_k3_checkpoint, log_dir, "tp2", other_env={OTHER_CLASS_ENV: "1"}),
    ):
        pass
    head = (log_dir / "node0.log").read_text(errors="replace")
    assert "OtherK3Class" in (log_dir / "node1.log").read_text(errors="replace")
    assert re.search(
        r"MixedModelClassesError: Kimi-K3: rank 1 of 2 \(node 1 of 2\) wrote no "
        r"entry within 60 s",
        head,
    ), head[-3000:]
