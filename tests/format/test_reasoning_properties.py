"""Property tests of the text-only reading (no token ids: a saved output replayed):
the streamed reading equals the whole reading, byte for byte. The reading with ids,
and conservation, are in ``test_output_properties``.

Outputs are built from every marker the reader knows, partial markers, whitespace and
text; chunkings are 1 character, 1 token (real K3 BPE pieces), random splits and the
whole output. Long outputs put a marker across the 4095/4096 boundary.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import read_streamed
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import read_whole
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

MARKERS = list(vocab.REASONING_MARKERS)
PARTIALS = [m[:i] for m in MARKERS for i in range(1, len(m))]

outputs = st.lists(
    st.one_of(
        st.sampled_from(MARKERS),
        st.sampled_from(PARTIALS),
        st.sampled_from([" ", "\n", "\t "]),
        st.text(alphabet="ab<|>é 思", max_size=5),
    ),
    max_size=30,
).map("".join)


def split_at(text, cuts):
    cuts = sorted(set(cuts))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@given(
    outputs,
    st.sampled_from([Channel.THINK, Channel.RESPONSE]),
    st.booleans(),
    st.sampled_from(list(ReplayPolicy)),
    st.data(),
)
def test_streaming_equals_the_whole_read(text, start, stopped, policy, data):
    whole = read_whole(text, start=start, stopped=stopped, policy=policy)
    assert read_streamed(list(text), start, stopped, policy) == whole
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert read_streamed(split_at(text, cuts), start, stopped, policy) == whole


@given(
    st.sampled_from(MARKERS),
    st.integers(4090, 4100),
    st.sampled_from(list(ReplayPolicy)),
)
def test_a_marker_across_a_4096_boundary(marker, offset, policy):
    text = "x" * offset + marker + "y" * 200 + vocab.RESPONSE_END + vocab.MESSAGE_END
    for start in (Channel.THINK, Channel.RESPONSE):
        whole = read_whole(text, start=start, stopped=True, policy=policy)
        chunks = [text[i : i + 4096] for i in range(0, len(text), 4096)]
        assert read_streamed(chunks, start, True, policy) == whole
        assert (
            read_streamed(split_at(text, [4095, 4096, 4097]), start, True, policy)
            == whole
        )


def test_token_chunking_with_the_real_tokenizer(k3_tokenizer):
    text = (
        "Let me check the weather <|close|>response<|sep|> quoted, ok."
        + vocab.THINK_END
        + vocab.RESPONSE_START
        + "It is sunny in Paris, 21°C."
        + vocab.RESPONSE_END
        + vocab.MESSAGE_END
    )
    ids = k3_tokenizer.encode(text, allowed_special="all")
    pieces = [k3_tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    for policy in ReplayPolicy:
        whole = read_whole(text, stopped=True, policy=policy)
        assert read_streamed(pieces, Channel.THINK, True, policy) == whole
        assert whole.content == "It is sunny in Paris, 21°C."
