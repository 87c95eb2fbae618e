"""``python -m vllm_k3_plugin``: the ``vllm-k3`` command."""

from vllm_k3_plugin.tools.cli import main

raise SystemExit(main())
