"""Real-world tool schemas: the Kimi Vendor Verifier's cases, round-tripped.

For every case: generate valid argument objects (hypothesis-jsonschema), render them
as the K3 renderer does (typed ``argument`` elements, strings raw), read them back
through the reasoning reader and the tool reader, whole and at random chunkings, and
check that the arguments equal the originals and validate (Draft 2020-12).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis_jsonschema import from_schema
from jsonschema import Draft202012Validator

from tests.support import kvv
from tests.support.k3_ids import marked_rendering
from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.events import (
    ToolMarkup,
)
from vllm_k3_plugin.format.reasoning import ReasoningReader
from vllm_k3_plugin.format.tools import (
    ToolCallReader,
    collect_calls,
)
from vllm_k3_plugin.format.xtml import render_tools

# Cases no generator can produce a value for, and why.
UNGENERATABLE = {
    "TestRangeConstraints:3": "minLength 999999999999: a string of 10^12 characters",
}
CASES = list(kvv.cases())
GENERATABLE = [case for case in CASES if case.name not in UNGENERATABLE]


def test_the_corpus_is_all_there():
    assert len(CASES) == 212
    assert len({json.dumps(case.schema, sort_keys=True) for case in CASES}) == 189
    assert set(UNGENERATABLE) <= {case.name for case in CASES}


@pytest.mark.parametrize("name", sorted(UNGENERATABLE))
def test_ungeneratable_cases_really_are(name):
    (case,) = [case for case in CASES if case.name == name]

    @settings(max_examples=1, database=None)
    @given(from_schema(kvv.inline_refs(kvv.wrap(case.schema))))
    def draw(_value):
        pass

    with pytest.raises(InvalidArgument):
        draw()


def _read(chunks: list[str]) -> list:
    """Reasoning reader (thinking off) and tool reader, fed ``chunks``."""
    reader = ReasoningReader(start=Channel.RESPONSE, atoms=marked.ALREADY_MARKED)
    tools = ToolCallReader(marked.ALREADY_MARKED)
    events = []
    for chunk in chunks:
        for event in reader.feed(chunk):
            if type(event) is ToolMarkup:
                events += tools.feed(event.text)
    for event in reader.finish(stopped=True):
        if type(event) is ToolMarkup:
            events += tools.feed(event.text)
    return collect_calls(events + tools.finish())


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _cuts(text: str, data) -> list[str]:
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=16)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("case", GENERATABLE, ids=[case.name for case in GENERATABLE])
def test_generated_arguments_round_trip(case):
    wrapped = kvv.wrap(case.schema)
    validator = Draft202012Validator(wrapped)

    @settings(
        max_examples=8,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(from_schema(kvv.inline_refs(wrapped)), st.data())
    def round_trip(arguments, data):
        validator.validate(arguments)
        # Read as with ids: atom strings inside the values are BPE text.
        rendering = marked_rendering(render_tools, [("tool", arguments)])
        output = rendering + marked.marked(vocab.MESSAGE_END)
        for chunks in ([output], _cuts(output, data)):
            (call,) = _read(chunks)
            assert call.name == "tool"
            read_back = json.loads(call.arguments)
            # Compared as canonical JSON: ``True == 1`` in Python, not in JSON.
            assert _canonical(read_back) == _canonical(arguments)
            validator.validate(read_back)

    round_trip()
