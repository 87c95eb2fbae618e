"""Test-only: proof that an idle data-parallel rank's dummy steps leave its caches
alone.

Under data parallelism with expert parallelism, a rank with nothing scheduled runs
vLLM's dummy batch (``Worker.execute_dummy_batch``) in lockstep with the busy ranks,
so that their MoE collectives meet. That forward runs every layer of the model
class: its KDA layers, which carry each sequence's state in a cache slot, and its
MLA layers, which write the latent cache. A dummy step must touch neither.

Loaded in every process of a test server as a vLLM general plugin (the entry point
in ``collectives_plugin/``, beside the collectives stand-in). In each worker it
wraps ``execute_dummy_batch``: once the KV caches exist, every byte of every cache
tensor the model runner holds (KDA states and MLA latents alike) is copied before
the dummy step and compared after. It logs the running count of checked steps
(at 1, 2, 4, 8, ...) and, at any step that changed a cache, an error naming the
tensors. Nothing of the plugin ships or imports this.
"""

from __future__ import annotations

import functools
import logging

import torch

_MARK = "_k3_test_dummy_step_watch"
CHECKED_LINE = (
    "idle-rank dummy steps checked: %d, every KV cache tensor unchanged "
    "(%d storages, %d bytes)"
)
CHANGED_LINE = "idle-rank dummy step %d changed cache tensors %s"

logger = logging.getLogger("vllm.k3_test.dummy_step_watch")


def install() -> None:
    """Wrap vLLM's worker's dummy step (idempotent)."""
    from vllm.v1.worker.gpu_worker import Worker

    step = Worker.execute_dummy_batch
    if getattr(step, _MARK, False):
        return

    @functools.wraps(step)
    def execute_dummy_batch(self) -> None:
        caches = cache_bytes(getattr(self.model_runner, "kv_caches", None))
        if not caches:
            # Profiling and warm-up: no cache yet.
            return step(self)
        before = [cache.clone() for cache in caches]
        step(self)
        changed = [
            index
            for index, (was, now) in enumerate(zip(before, caches, strict=True))
            if not torch.equal(was, now)
        ]
        count = getattr(self, _MARK, 0) + 1
        setattr(self, _MARK, count)
        if changed:
            logger.error(CHANGED_LINE, count, changed)
        elif count & (count - 1) == 0:
            logger.info(
                CHECKED_LINE, count, len(caches), sum(c.numel() for c in caches)
            )

    setattr(execute_dummy_batch, _MARK, True)
    Worker.execute_dummy_batch = execute_dummy_batch


def cache_bytes(caches) -> list[torch.Tensor]:
    """Every distinct storage under ``caches`` (tensors, nested in lists and
    tuples), as a flat byte tensor: bytes, not values, so uninitialised NaNs compare
    equal to themselves."""
    seen: dict[int, torch.Tensor] = {}
    pending = [caches] if caches is not None else []
    while pending:
        item = pending.pop(0)
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(
                    storage
                )
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return list(seen.values())
