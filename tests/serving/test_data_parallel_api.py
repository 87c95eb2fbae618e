"""The API side under data parallel: ``vllm serve --data-parallel-size 2
--api-server-count 2`` with Moonshot's wire switch. Requests land on either API
server process and either engine; each reply must read as on the one-API-server
``k3_server`` (the readings ``test_server.py`` pins, every shape ended by the stop
token, on all six readings: the switch rewrites chat completions' frames, which
the ``openai`` SDK reads the same), and the plugin's metrics must sum over both
API servers on one scrape, whichever answers it.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.serving.test_metrics import LABELS, scrape
from tests.serving.test_server import EXPECTED
from tests.serving.test_wire_spec import SWITCH
from tests.support.cpu_collectives import server_env
from tests.support.endpoints import ENDPOINTS
from tests.support.server import running_server
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids

pytestmark = pytest.mark.server

STOPPED = sorted(shape for shape, readings in EXPECTED.items() if readings[0])


@pytest.fixture(scope="module")
def dp_api_server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp-api") / "vllm-serve.log"
    with running_server(
        tiny_checkpoint,
        log,
        *SWITCH,
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "2",
        cli=True,
        env={**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ) as url:
        yield url, log


def test_every_shape_reads_as_on_one_api_server(dp_api_server):
    url, log = dp_api_server
    before = scrape(url)
    sent: Counter = Counter()
    for shape in STOPPED:
        output, thinking, _ = SHAPES[shape]
        ids = output_ids(output, stop=True)
        for endpoint in sorted(ENDPOINTS):
            reply = ENDPOINTS[endpoint](
                url, ids, max_tokens=len(ids) + 16, thinking=thinking
            )
            assert (reply.reasoning, reply.content) == EXPECTED[shape][0], (
                shape,
                endpoint,
            )
            sent[LABELS[endpoint]] += 1
    text = log.read_text(errors="replace")
    # Both API server processes answered.
    assert set(re.findall(r"\((ApiServer_\d) pid=\d+\) .*POST", text)) == {
        "ApiServer_0",
        "ApiServer_1",
    }
    # Every reading counted once, summed over both processes, whichever answers.
    for _ in range(4):
        after = scrape(url)
        counted: Counter = Counter()
        for (name, labels), value in after.items():
            if name == "vllm_k3_outputs_total":
                label = dict(labels)
                key = (label["endpoint"], label["stream"])
                counted[key] += value - before.get((name, labels), 0)
        assert +counted == sent
