"""Our parser and vLLM's in-tree ``kimi_k3`` parser, driven as vLLM's serving layer
drives them, for `vllm-k3 replay` and the benchmarks.

Streaming is one ``parse_delta`` per token with the text the engine's incremental
detokenizer would hand over (the stop token contributes no text), ``finished`` on
the last; whole is ``set_prompt_token_ids`` then ``parse``, as chat completions does.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from vllm_k3_plugin.format import vocab

MODEL_NAME = "moonshotai/Kimi-K3"


class Parsed(NamedTuple):
    reasoning: str
    content: str
    tool_calls: tuple[tuple[str, str], ...]
    """``(name, arguments)`` per call."""
    tool_call_ids: tuple[str | None, ...] = ()


def load_tokenizer(directory: Path | None = None) -> Any:
    """The real Kimi BPE with the K3 control ids, as vLLM loads a model's tokenizer.

    It is read from the tiny K3 checkpoint's folder without its weights (written
    into ``directory``), so vLLM finds a model config beside it as it would for a
    real checkpoint.
    """
    from vllm.tokenizers import get_tokenizer

    from vllm_k3_plugin.tools.tiny import write_tiny_k3_config

    directory = Path(directory or Path(tempfile.gettempdir()) / "vllm-k3-tokenizer")
    return get_tokenizer(str(write_tiny_k3_config(directory)))


def in_tree_parser_cls(tool_parser: str | None = None) -> type:
    """vLLM's own composition for ``kimi_k3``, whatever the registries now hold."""
    from vllm.parser.kimi_k3 import KimiK3Parser
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser

    return type(
        "InTreeKimiK3Parser",
        (KimiK3Parser,),
        {
            "reasoning_parser_cls": KimiK3ReasoningParser,
            "tool_parser_cls": _in_tree_tool_parser_cls(tool_parser),
        },
    )


def our_parser_cls(tool_parser: str | None = None) -> type:
    """What ``--reasoning-parser kimi_k3`` gets with the plugin loaded."""
    from vllm.parser.parser_manager import ParserManager

    import vllm_k3_plugin

    vllm_k3_plugin.register()
    return ParserManager.get_parser(
        tool_parser_name=tool_parser,
        reasoning_parser_name="kimi_k3",
        enable_auto_tools=tool_parser is not None,
    )


def text_only(parser_cls: type) -> type:
    """Our parser class reading structure from text alone (the fallback for callers
    without token ids), to measure what reading the ids costs beside it."""
    from vllm_k3_plugin.format import marked

    return type(
        "TextOnly" + parser_cls.__name__,
        (parser_cls,),
        {"_atoms": lambda self, ids: marked.TextAtoms()},
    )


def _in_tree_tool_parser_cls(name: str | None) -> type | None:
    """vLLM's own tool parser of that name, even where the plugin replaced it."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    if name in ToolParserManager.lazy_parsers:
        module, class_name = ToolParserManager.lazy_parsers[name]
        return getattr(importlib.import_module(module), class_name)
    return ToolParserManager.get_tool_parser(name)


def chat_request(max_tokens: int, *, tools: list[dict] | None = None) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
    )

    return ChatCompletionRequest(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=max_tokens,
        **({"tools": tools} if tools else {}),
    )


def prompt_ids(tokenizer: Any, thinking: bool) -> list[int]:
    prefix = vocab.THINKING_ON_PREFIX if thinking else vocab.THINKING_OFF_PREFIX
    return tokenizer.encode("What is 2 + 2?" + prefix, add_special_tokens=False)


def delta_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Per-token text as the engine's incremental detokenizer hands it over.

    A token that leaves an incomplete UTF-8 sequence yields ``""`` until the
    character completes; a stop token yields ``""``.
    """
    deltas: list[str] = []
    prefix = read = 0
    for i, token in enumerate(ids):
        if token in vocab.MODEL_STOP_IDS:
            deltas.append("")
            prefix = read = i + 1
            continue
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=False)
        after = tokenizer.decode(ids[prefix : i + 1], skip_special_tokens=False)
        if after.endswith("\ufffd"):
            deltas.append("")
            continue
        deltas.append(after[len(before) :])
        prefix, read = read, i + 1
    return deltas


def engine_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The whole output text as the engine hands it over (no stop token text)."""
    kept = [token for token in ids if token not in vocab.MODEL_STOP_IDS]
    return tokenizer.decode(kept, skip_special_tokens=False)


def _calls(tool_calls: Any) -> tuple[tuple[str, str], ...]:
    calls = []
    for call in tool_calls or ():
        function = getattr(call, "function", call)
        calls.append((function.name or "", function.arguments or ""))
    return tuple(calls)


def _call_ids(tool_calls: Any) -> tuple[str | None, ...]:
    return tuple(getattr(call, "id", None) for call in tool_calls or ())


def new_parser(parser_cls: type, tokenizer: Any, request: Any, thinking: bool) -> Any:
    """One request's parser, built as chat completions builds it."""
    return parser_cls(
        tokenizer, request.tools, chat_template_kwargs={"thinking": thinking}
    )


def parse_whole(
    parser_cls: type,
    tokenizer: Any,
    ids: Sequence[int],
    request: Any,
    *,
    thinking: bool = True,
    prompt: Sequence[int] | None = None,
) -> Parsed:
    text = engine_text(tokenizer, ids)
    return parse_text(
        parser_cls, tokenizer, text, ids, request, thinking=thinking, prompt=prompt
    )


def parse_text(
    parser_cls: type,
    tokenizer: Any,
    text: str,
    ids: Sequence[int],
    request: Any,
    *,
    thinking: bool = True,
    prompt: Sequence[int] | None = None,
) -> Parsed:
    """``parse`` of an output whose text (and, optionally, prompt) is prepared."""
    parser = new_parser(parser_cls, tokenizer, request, thinking)
    parser.set_prompt_token_ids(
        prompt_ids(tokenizer, thinking) if prompt is None else prompt
    )
    reasoning, content, calls = parser.parse(
        text,
        request,
        enable_auto_tools=parser_cls.tool_parser_cls is not None,
        model_output_token_ids=list(ids),
    )
    return Parsed(reasoning or "", content or "", _calls(calls), _call_ids(calls))


def parse_streamed(
    parser_cls: type,
    tokenizer: Any,
    ids: Sequence[int],
    request: Any,
    *,
    thinking: bool = True,
    prompt: Sequence[int] | None = None,
) -> Parsed:
    parser = new_parser(parser_cls, tokenizer, request, thinking)
    prompt = prompt_ids(tokenizer, thinking) if prompt is None else prompt
    deltas = delta_texts(tokenizer, ids)
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, tuple[list[str], list[str]]] = {}
    ids_by_index: dict[int, str | None] = {}
    last = len(ids) - 1
    for i, (token, text) in enumerate(zip(ids, deltas)):
        delta = parser.parse_delta(
            text, [token], request, prompt_token_ids=prompt, finished=i == last
        )
        if delta is None:
            continue
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or ():
            # Pieces in lists: a growing string per token would be quadratic.
            names, pieces = calls.setdefault(call.index, ([], []))
            ids_by_index.setdefault(call.index, call.id)
            if call.function is not None:
                names.append(call.function.name or "")
                pieces.append(call.function.arguments or "")
    return Parsed(
        "".join(reasoning),
        "".join(content),
        tuple(("".join(calls[i][0]), "".join(calls[i][1])) for i in sorted(calls)),
        tuple(ids_by_index[i] for i in sorted(calls)),
    )
