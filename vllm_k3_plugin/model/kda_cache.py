"""A KDA layer's place in vLLM's hybrid cache: the shapes and dtypes of its two
states (a conv state and the recurrent state, per cache slot), and each step's batch
as vLLM's GDN metadata lays it out: which tokens are each sequence's, which slot
holds its state and whether that state is initialized (``host_batch``, read on the
host once a step), and the decode and speculative rows as windows that stay on the
device (``Windows``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)


class HostBatch(NamedTuple):
    """Per sequence of the batch: token span ``starts[i]:starts[i + 1]``, state slot,
    and whether the slot holds its state already."""

    starts: list[int]
    slots: list[int]
    initialized: list[bool]


def host_batch(metadata) -> HostBatch:
    """The GDN metadata's batch on the host: read back in one transfer, then kept on
    the metadata object, which vLLM shares between the layers of a step, so one
    sync per step instead of three per layer."""
    cached = getattr(metadata, "_k3_host_batch", None)
    if cached is not None:
        return cached
    starts = metadata.non_spec_query_start_loc
    count = starts.shape[0] - 1
    parts = [starts.long(), metadata.non_spec_state_indices_tensor[:count].long()]
    if metadata.has_initial_state is not None:
        parts.append(metadata.has_initial_state[:count].long())
    values = torch.cat(parts).tolist()
    initialized = values[2 * count + 1 :] or [1] * count
    batch = HostBatch(
        starts=values[: count + 1],
        slots=values[count + 1 : 2 * count + 1],
        initialized=[bool(flag) for flag in initialized],
    )
    metadata._k3_host_batch = batch
    return batch


class Windows(NamedTuple):
    """Rows of a step taken together as windows of ``W`` token positions, all on the
    device, in fixed shapes (a CUDA graph replays them with other values): row ``r``'s
    token ``t`` is at batch position ``tokens[r, t]`` if ``valid[r, t]``; the
    recurrent state after it goes to slot ``slots[r, t]``; the row starts from the
    state in ``slots[r, skip[r]]`` and its conv history at column ``skip[r]`` of the
    conv buffer in ``slots[r, 0]``."""

    tokens: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    skip: torch.Tensor


def speculative_windows(metadata, num_tokens: int, width: int) -> Windows:
    """The speculative rows of vLLM's GDN metadata (``width`` = drafts + 1). A row
    may hold fewer tokens (fewer drafts, or a padded row of a graph replay, which
    holds none and points at vLLM's null block); its missing positions read a
    clamped token and write nothing that a later step reads."""
    starts = metadata.spec_query_start_loc.long()
    rows = starts.shape[0] - 1
    offsets = torch.arange(width, device=starts.device)
    spec_tokens = metadata.spec_token_indx.long()
    ordinal = (starts[:rows, None] + offsets).clamp(max=spec_tokens.shape[0] - 1)
    return Windows(
        tokens=spec_tokens[ordinal].clamp(0, num_tokens - 1),
        valid=offsets < (starts[1:] - starts[:-1])[:, None],
        slots=metadata.spec_state_indices_tensor[:rows, :width].long().clamp(min=0),
        # vLLM counts at least one accepted token; a 0 would index column -1.
        skip=(metadata.num_accepted_tokens[:rows].long() - 1).clamp(0, width - 1),
    )


def decode_windows(metadata, num_tokens: int) -> Windows:
    """A decode-only batch's rows as windows of one token (vLLM's GDN builder
    counts a row as a decode only with one token), padded rows included."""
    starts = metadata.non_spec_query_start_loc.long()
    rows = starts.shape[0] - 1
    slots = metadata.non_spec_state_indices_tensor[:rows].long().clamp(min=0)
    return Windows(
        tokens=starts[:rows, None].clamp(0, num_tokens - 1),
        valid=(starts[1:] > starts[:-1])[:, None],
        slots=slots[:, None],
        skip=torch.zeros_like(slots),
    )


def kda_state_shapes(
    kda: dict, tp_size: int, num_spec: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state, recurrent state) shapes of one KDA layer on one rank, from the
    text config's ``linear_attn_config``; with ``num_spec`` draft tokens a step the
    conv state keeps ``kernel - 1 + num_spec`` inputs (``KdaAttention._windows``)."""
    return MambaStateShapeCalculator.kda_state_shape(
        tp_size,
        kda["num_heads"],
        kda["head_dim"],
        conv_kernel_size=kda["short_conv_kernel_size"],
        num_spec=num_spec,
    )


def kda_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    return MambaStateDtypeCalculator.kda_state_dtype(
        vllm_config.model_config.dtype,
        vllm_config.cache_config.mamba_cache_dtype,
        vllm_config.cache_config.mamba_ssm_cache_dtype,
    )
