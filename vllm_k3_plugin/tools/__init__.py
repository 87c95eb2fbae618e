"""The ``vllm-k3`` tool and what it stands on: capture and replay of K3 outputs, the
built-in corpus of output shapes, vLLM's parsers driven beside ours, the bundled Kimi
tokenizer, and the tiny K3 checkpoint writer."""
