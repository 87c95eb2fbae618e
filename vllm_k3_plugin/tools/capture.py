"""``vllm-k3 capture``: the model's raw K3 text for chat requests, from a running vLLM.

For each request line, the server renders the chat prompt (``/tokenize`` with the
messages, tools and template arguments: the server's own renderer) and generates from
those token ids on ``/v1/completions`` with special tokens kept and no spaces between
them, so the text comes back with every K3 marker and no parser in the way. Each
output is one JSON line::

    {"id": ..., "text": ..., "token_ids": [...], "finish_reason": ...,
     "thinking": true | false}

``thinking`` says whether the prompt left the think channel open. Lines are written
in the order of the requests, whatever order they finish in, so a capture resumed
after an interruption (lines already written are kept and not redone; a torn last
line is rewritten) gives the same file as one that was never interrupted.

A request line is a chat completion body (``messages``, optional ``tools``,
``chat_template_kwargs``, ``max_tokens``, sampling fields, ``vllm_xargs``) with an
optional ``id`` (default: ``line-N``): one request as a client sent it to
``/v1/chat/completions``. vLLM keeps no record of the requests it served; they come
from the clients' or a gateway's logs.

A server started with ``--api-key`` is sent the key (``Authorization: Bearer``, the
header vLLM checks) with every request; a refusal (401) is a ``CaptureError`` that
names ``--api-key``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_k3_plugin.format import vocab

# Fields of a request line passed through to /v1/completions as they are.
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "vllm_xargs",
)
_RENDER_FIELDS = ("tools", "chat_template_kwargs")
# Where the key comes from when the command line gives none, as for vLLM's own
# OpenAI clients.
API_KEY_ENV = "OPENAI_API_KEY"


class CaptureError(Exception):
    """A clear, user-facing failure (bad input file, unreachable server)."""


def read_requests(path: Path) -> list[tuple[str, dict[str, Any]]]:
    if not path.exists():
        raise CaptureError(f"{path}: no such file")
    requests: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for number, body, error in json_lines(path):
        if error is None and not (
            isinstance(body, dict) and isinstance(body.get("messages"), list)
        ):
            error = "needs a 'messages' list"
        if error is not None:
            raise CaptureError(f"{path}:{number}: {error}")
        request_id = str(body.get("id", f"line-{number}"))
        if request_id in seen:
            raise CaptureError(f"{path}:{number}: duplicate id {request_id!r}")
        seen.add(request_id)
        requests.append((request_id, body))
    if not requests:
        raise CaptureError(f"{path}: no requests")
    return requests


def _captured_id(raw: bytes) -> str | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(record, dict) and isinstance(record.get("id"), str):
        return record["id"]
    return None


def done_ids(out: Path) -> list[str]:
    """Ids already captured in ``out``. A torn last line (cut mid-write: no newline,
    or not a whole record) is cut off the file; a bad line before the last is an
    error, not something to overwrite."""
    if not out.exists():
        return []
    ids: list[str] = []
    keep = 0
    bad_line: int | None = None
    with out.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if bad_line is not None:
                raise CaptureError(
                    f"{out}:{bad_line}: not a captured output; not resuming"
                )
            if not raw.strip():
                keep += len(raw)
                continue
            request_id = _captured_id(raw) if raw.endswith(b"\n") else None
            if request_id is None:
                bad_line = number
                continue
            ids.append(request_id)
            keep += len(raw)
    with out.open("r+b") as handle:
        handle.truncate(keep)
    return ids


def _ends_in_think(token_strs: list[str]) -> bool:
    """Does the rendered prompt end with the think channel's opener?"""
    return "".join(token_strs[-8:]).endswith(vocab.THINK_START)


async def _capture_one(client, base_url: str, model: str, request_id: str, body):
    render = {
        "model": model,
        "messages": body["messages"],
        "add_generation_prompt": True,
        "return_token_strs": True,
        **{key: body[key] for key in _RENDER_FIELDS if key in body},
    }
    rendered = await client.post(f"{base_url}/tokenize", json=render)
    _check(rendered, request_id, "/tokenize")
    rendering = _json(rendered, request_id, "/tokenize")
    prompt_ids = rendering["tokens"]
    completion = {
        "model": model,
        "prompt": prompt_ids,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "return_token_ids": True,
        **{key: body[key] for key in _SAMPLING_FIELDS if key in body},
    }
    response = await client.post(f"{base_url}/v1/completions", json=completion)
    _check(response, request_id, "/v1/completions")
    choices = _json(response, request_id, "/v1/completions").get("choices") or [{}]
    choice = choices[0]
    if not isinstance(choice.get("text"), str):
        raise CaptureError(f"request {request_id!r}: /v1/completions returned no text")
    return {
        "id": request_id,
        "text": choice["text"],
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice.get("finish_reason"),
        "thinking": _ends_in_think(rendering.get("token_strs") or []),
    }


def _check(response, request_id: str, what: str) -> None:
    if response.status_code == 401:
        sent = "Authorization" in response.request.headers
        raise CaptureError(
            f"{response.request.url} answered 401 Unauthorized: "
            + (
                f"the server refused the API key given (--api-key or {API_KEY_ENV})"
                if sent
                else "the server wants an API key: give it with --api-key KEY "
                f"or {API_KEY_ENV}"
            )
        )
    if response.status_code != 200:
        raise CaptureError(
            f"request {request_id!r}: {what} answered {response.status_code}: "
            f"{response.text[:500]}"
        )


async def _served_model(client, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    _check(response, "-", "/v1/models")
    models = _json(response, "-", "/v1/models").get("data") or []
    if not models:
        raise CaptureError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def _json(response, request_id: str, what: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise CaptureError(f"request {request_id!r}: {what} did not answer JSON")
    return body


def _progress(total: int, initial: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with vLLM
        return None
    return tqdm(total=total, initial=initial, unit="req", file=sys.stderr)


async def capture(
    base_url: str,
    requests_path: Path,
    out: Path,
    *,
    concurrency: int = 8,
    model: str | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> int:
    """Capture every request not yet in ``out``; return how many were captured.
    ``api_key``: sent as ``Authorization: Bearer`` with every request (none: no
    header)."""
    import httpx

    requests = read_requests(requests_path)
    already = set(done_ids(out))
    unknown = already - {request_id for request_id, _ in requests}
    if unknown:
        raise CaptureError(f"{out} holds ids not in {requests_path}: {sorted(unknown)}")
    todo = [(rid, body) for rid, body in requests if rid not in already]
    base_url = base_url.rstrip("/")
    bar = _progress(len(requests), len(already)) if progress else None
    limit = asyncio.Semaphore(max(1, concurrency))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        try:
            model = model or await _served_model(client, base_url)
        except httpx.HTTPError as error:
            raise CaptureError(f"cannot reach {base_url}: {error}") from None

        async def bounded(request_id, body):
            async with limit:
                return await _capture_one(client, base_url, model, request_id, body)

        tasks = [asyncio.ensure_future(bounded(rid, body)) for rid, body in todo]
        try:
            with out.open("a", encoding="utf-8") as sink:
                # In request order: a line is written once all before it are.
                for task in tasks:
                    record = await task
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    sink.flush()
                    if bar is not None:
                        bar.update(1)
        except httpx.HTTPError as error:
            raise CaptureError(f"{base_url}: {error}") from None
        finally:
            for task in tasks:
                task.cancel()
            if bar is not None:
                bar.close()
    return len(todo)


def json_lines(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, error)`` per non-blank line of a JSONL file, streamed."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, None, f"not UTF-8 (byte {error.start})"
                continue
            try:
                yield number, json.loads(line), None
            except json.JSONDecodeError as error:
                yield number, None, f"not JSON ({error.msg})"


def iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """``(line number, record, error)`` per captured output, streamed."""
    for number, record, error in json_lines(path):
        if error is None and not (
            isinstance(record, dict) and isinstance(record.get("text"), str)
        ):
            error = "needs a 'text' string"
        yield number, (record if error is None else None), error
