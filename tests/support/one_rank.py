"""vLLM's model-parallel state for one in-process rank (gloo), as the in-process
model tests build layers under it."""

from __future__ import annotations

import contextlib
import tempfile


@contextlib.contextmanager
def one_rank(vllm_config):
    """``vllm_config`` current, with tensor and pipeline parallel size 1, until
    the block ends (then vLLM's distributed state is torn down)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with set_current_vllm_config(vllm_config), tempfile.TemporaryDirectory() as scratch:
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{scratch}/rendezvous",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        try:
            yield vllm_config
        finally:
            cleanup_dist_env_and_memory()
