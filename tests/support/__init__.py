"""Test support: the tiny Llama checkpoint with the real tokenizer, the logits
processor and stand-in engine that force chosen output ids, the ``vllm serve`` runner,
and the helpers the tests share (ids, endpoints, expected readings, host reads).

Not shipped: the wheel holds the plugin only. The test servers import ``force`` and
``standin_engine`` as ``support.*``, with ``tests/`` on their path.
"""
