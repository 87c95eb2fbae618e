"""Chat completions against a Kimi-K3 server with the plugin: a streamed reply with
reasoning, content and a tool call, then the next turn with the tool's result.

    python examples/client_chat.py [--base-url http://localhost:8000] [--model NAME]
        [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import os

import openai

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def stream_turn(client, model, messages, extra_body):
    """One streamed turn; returns the assistant message to append to the history."""
    reasoning, content, calls, finish = [], [], {}, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        stream=True,
        extra_body=extra_body,
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        # vLLM sends the think channel as `reasoning`.
        reasoning.append(getattr(delta, "reasoning", None) or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or ():
            entry = calls.setdefault(
                call.index, {"id": "", "name": "", "arguments": ""}
            )
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    print(f"reasoning: {''.join(reasoning)!r}")
    print(f"content:   {''.join(content)!r}")
    for call in calls.values():
        print(f"tool call: {call['id']} {call['name']}({call['arguments']})")
    print(f"finish:    {finish}")
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls.values()
        ]
    return message


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8000")
    parser.add_argument("--model")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="the key of a server started with --api-key (default: OPENAI_API_KEY; "
        "a server without one takes any)",
    )
    parser.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON passed through to the server (e.g. vllm_xargs)",
    )
    parser.add_argument("--next-extra-body", type=json.loads, default={})
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    model = args.model or client.models.list().data[0].id

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    assistant = stream_turn(client, model, messages, args.extra_body)
    messages.append(assistant)
    if not assistant.get("tool_calls"):
        return 0
    # Answer each call by its id: vLLM's K3 renderer matches results to calls by it.
    for call in assistant["tool_calls"]:
        result = {
            "city": json.loads(call["function"]["arguments"]).get("city"),
            "sky": "clear",
        }
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
        )
    print("-- next turn --")
    stream_turn(client, model, messages, args.next_extra_body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
