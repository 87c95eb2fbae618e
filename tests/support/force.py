"""A test-only logits processor that makes the model write chosen token ids.

Serve with ``--logits-processors support.force:ForceTokens`` (``tests/`` on the
server's path) and send
``vllm_xargs={"k3_force_ids": [id, ...]}`` (chat completions, responses and messages
all accept it). Step ``n`` of the output may only be ``ids[n]``; past the list the
model may only write the stop token, so a forced request always ends. To end a forced
output by a length cut, send ``max_tokens`` no larger than the list.

vLLM 0.32 and 0.33 (their CPU model runner, V1) take V1's interface; 0.34 removed V1
and takes Model Runner V2's, which it checks at server start. One class of that name
is defined, on whichever interface the installed vLLM has; the rule is one function.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from vllm_k3_plugin.format import vocab

FORCE_KEY = "k3_force_ids"
# Seconds each step waits (the server's environment; unset: none): a test that must
# act while outputs are still being written paces the engine, whatever the host.
STEP_DELAY_ENV = "K3_TEST_STEP_DELAY_S"
_STEP_DELAY = float(os.environ.get(STEP_DELAY_ENV) or 0)


def pace() -> None:
    """One step's wait under ``STEP_DELAY_ENV``."""
    if _STEP_DELAY:
        time.sleep(_STEP_DELAY)


def forced_ids(params: Any) -> list[int] | None:
    extra = getattr(params, "extra_args", None) or {}
    ids = extra.get(FORCE_KEY)
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"vllm_xargs.{FORCE_KEY} must be a list of token ids")
    return ids


def forced_token(ids: list[int], step: int) -> int:
    """The id output step ``step`` must be: the list's, then the stop token."""
    return ids[step] if 0 <= step < len(ids) else vocab.END_OF_MSG_ID


def force_row(row: torch.Tensor, token: int) -> None:
    row.fill_(float("-inf"))
    row[token] = 0.0


try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
except ImportError:  # vLLM 0.34: Model Runner V2's interface only
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsContext,
        LogitsProcessor,
        LogitsProcRequestState,
    )

    class ForceTokens(LogitsProcessor):
        """Per request slot, the forced ids; the step from the row's position."""

        def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState):
            self._prompt_len = req_states.prompt_len
            self._forced: dict[int, list[int]] = {}

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            forced_ids(sampling_params)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            # Slots are reused: a request without forced ids clears its slot.
            ids = forced_ids(sampling_params)
            if ids is None:
                self._forced.pop(req_idx, None)
                return False
            self._forced[req_idx] = ids
            return True

        def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
            pace()
            slots = ctx.expanded_idx_mapping.tolist()
            positions = ctx.pos.tolist()
            for row, (slot, position) in enumerate(zip(slots, positions)):
                ids = self._forced.get(slot)
                if ids is not None:
                    # The row samples the token after ``position``.
                    step = position + 1 - int(self._prompt_len.np[slot])
                    force_row(logits[row], forced_token(ids, step))
            return logits

else:

    class ForceTokens(LogitsProcessor):
        """Per batch index, the forced ids and the request's live output list."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
            self._forced: dict[int, tuple[list[int], list[int]]] = {}

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            forced_ids(sampling_params)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index, params, _prompt_ids, output_ids in batch_update.added:
                ids = forced_ids(params)
                if ids is None:
                    self._forced.pop(index, None)
                else:
                    self._forced[index] = (ids, output_ids)
            for index in batch_update.removed:
                self._forced.pop(index, None)
            for source, target, directionality in batch_update.moved:
                moving = self._forced.pop(source, None)
                if directionality.name == "SWAP":
                    swapped = self._forced.pop(target, None)
                    if swapped is not None:
                        self._forced[source] = swapped
                if moving is not None:
                    self._forced[target] = moving

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            pace()
            for index, (ids, output_ids) in self._forced.items():
                force_row(logits[index], forced_token(ids, len(output_ids)))
            return logits
