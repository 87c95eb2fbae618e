"""Anthropic Messages against a Kimi-K3 server with the plugin (vLLM serves
``/v1/messages``): a streamed turn with ``thinking``, text and ``tool_use``, then the
next turn with the ``tool_result``.

    python examples/client_messages.py [--base-url http://localhost:8000] [--model NAME]
        [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import os

import anthropic
import openai

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def stream_turn(client, model, messages, extra_body):
    """One streamed turn; returns the final message."""
    with client.messages.stream(
        model=model,
        max_tokens=4096,
        messages=messages,
        tools=[WEATHER_TOOL],
        extra_body=extra_body,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                pass  # text streams here; thinking_delta and input_json_delta likewise
        message = stream.get_final_message()
    for block in message.content:
        if block.type == "thinking":
            print(f"thinking:  {block.thinking!r}")
        elif block.type == "text":
            print(f"text:      {block.text!r}")
        elif block.type == "tool_use":
            print(f"tool_use:  {block.id} {block.name}({json.dumps(block.input)})")
    print(f"stop:      {message.stop_reason}")
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
    parser.add_argument("--extra-body", type=json.loads, default={})
    parser.add_argument("--next-extra-body", type=json.loads, default={})
    args = parser.parse_args(argv)
    model = (
        args.model
        or openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
        .models.list()
        .data[0]
        .id
    )
    # vLLM's --api-key checks the header "Authorization: Bearer KEY" only, on
    # /v1/messages too; auth_token is what the anthropic SDK sends that way (api_key
    # goes as X-Api-Key in its older versions).
    client = anthropic.Anthropic(base_url=args.base_url, auth_token=args.api_key)

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = stream_turn(client, model, messages, args.extra_body)
    uses = [block for block in reply.content if block.type == "tool_use"]
    if not uses:
        return 0
    messages.append(
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]}
    )
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": '{"sky": "clear"}',
                }
                for use in uses
            ],
        }
    )
    print("-- next turn --")
    stream_turn(client, model, messages, args.next_extra_body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
