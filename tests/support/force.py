"""A test-only logits processor that makes the model write chosen token ids.

Serve with ``--logits-processors support.force:ForceTokens`` (``tests/`` on the
server's path) and send
``vllm_xargs={"k3_force_ids": [id, ...]}`` (chat completions, responses and messages
all accept it). Step ``n`` of the output may only be ``ids[n]``; past the list the
model may only write the stop token, so a forced request always ends. To end a forced
output by a length cut, send ``max_tokens`` no larger than the list.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_k3_plugin.format import vocab

FORCE_KEY = "k3_force_ids"


def forced_ids(params: Any) -> list[int] | None:
    extra = getattr(params, "extra_args", None) or {}
    ids = extra.get(FORCE_KEY)
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"vllm_xargs.{FORCE_KEY} must be a list of token ids")
    return ids


class ForceTokens(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # batch index -> (forced ids, the request's live output id list)
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
        for index, (ids, output_ids) in self._forced.items():
            step = len(output_ids)
            token = ids[step] if step < len(ids) else vocab.END_OF_MSG_ID
            row = logits[index]
            row.fill_(float("-inf"))
            row[token] = 0.0
        return logits
