"""The Responses API against a Kimi-K3 server with the plugin: a streamed turn with a
function call, then the next turn with its ``function_call_output``.

    python examples/client_responses.py [--base-url URL] [--model NAME] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import os

import openai

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def stream_turn(client, model, input_items, extra_body):
    """One streamed turn; returns the function calls it made."""
    reasoning, text, calls = [], [], []
    stream = client.responses.create(
        model=model,
        input=input_items,
        tools=[WEATHER_TOOL],
        stream=True,
        extra_body=extra_body,
    )
    for event in stream:
        if event.type == "response.reasoning_text.delta":
            reasoning.append(event.delta)
        elif event.type == "response.output_text.delta":
            text.append(event.delta)
        elif event.type == "response.function_call_arguments.delta":
            pass  # arguments stream here as they are generated
        elif (
            event.type == "response.output_item.done"
            and event.item.type == "function_call"
        ):
            calls.append(event.item)
        elif event.type in ("response.completed", "response.incomplete"):
            print(f"status:    {event.response.status}")
    print(f"reasoning: {''.join(reasoning)!r}")
    print(f"text:      {''.join(text)!r}")
    for call in calls:
        print(f"call:      {call.call_id} {call.name}({call.arguments})")
    return calls


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
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    model = args.model or client.models.list().data[0].id

    items = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls = stream_turn(client, model, items, args.extra_body)
    if not calls:
        return 0
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        items.append(
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": json.dumps({"sky": "clear"}),
            }
        )
    print("-- next turn --")
    stream_turn(client, model, items, args.next_extra_body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
