"""The serving hooks' own rules; the served behaviour is in ``test_server_tools``."""

from __future__ import annotations

import contextvars
import json

import pytest

from vllm_k3_plugin.parsers import serving_hooks
from vllm_k3_plugin.parsers.raw_arguments import RAW_ARGUMENTS_KEY, json_object_text
from vllm_k3_plugin.parsers.serving_hooks import last_output_cut, record_output


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', "{}"])
def test_an_object_stays_as_it_is(arguments):
    assert json_object_text(arguments, stream=False) == arguments


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]", "", "null", "x"])
def test_anything_else_is_kept_as_text(arguments):
    assert json.loads(json_object_text(arguments, stream=False)) == {
        RAW_ARGUMENTS_KEY: arguments
    }


def test_the_last_output_decides_in_its_own_context():
    def run():
        assert not last_output_cut()
        record_output(calls_cut=True, stopped=False)
        assert last_output_cut()
        record_output(calls_cut=False, stopped=True)
        assert not last_output_cut()
        record_output(calls_cut=True, stopped=True)
        return last_output_cut()

    assert contextvars.Context().run(run)
    # Another request's task (a context of its own) saw nothing of it.
    assert not contextvars.Context().run(last_output_cut)


def test_resolve_finish_reason_keeps_what_ended_a_cut_output():
    def resolve(engine, request, made):
        return "tool_calls" if made and engine == "stop" else engine

    wrapped = serving_hooks._resolving_cut_calls(resolve)

    def run():
        record_output(calls_cut=False, stopped=True)
        assert wrapped("stop", None, True) == "tool_calls"
        record_output(calls_cut=True, stopped=True)
        assert wrapped("stop", None, True) == "stop"
        assert wrapped("length", None, True) == "length"

    contextvars.Context().run(run)


def test_install_is_idempotent_in_this_vllm():
    serving_hooks.install()
    serving_hooks.install()
    from vllm.entrypoints.anthropic import serving

    wrapped = serving._to_anthropic_stop_reason
    assert getattr(wrapped, serving_hooks._MARK)
    assert not getattr(wrapped.__wrapped__, serving_hooks._MARK, False)


def test_a_length_cut_with_every_call_closed_stays_length_on_0_32():
    """vLLM 0.32's full response says ``tool_calls`` whenever calls were made; its
    stream says ``length`` for the same output, and so must the response."""
    import asyncio
    from types import SimpleNamespace

    async def full_generator(self):
        record_output(calls_cut=False, stopped=False)
        record_output(calls_cut=False, stopped=True)
        choices = [SimpleNamespace(finish_reason="tool_calls") for _ in range(2)]
        return SimpleNamespace(choices=choices)

    wrapped = serving_hooks._full_reply_reasons(full_generator)
    response = contextvars.Context().run(asyncio.run, wrapped(None))
    assert [c.finish_reason for c in response.choices] == ["length", "tool_calls"]
