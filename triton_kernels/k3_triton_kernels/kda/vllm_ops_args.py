"""How the model class calls vLLM's in-tree K3 KDA ops (``VLLM_K3_KDA=auto``): the
arguments built from the layer's tensors, kept here (beside the ops' PyTorch
contract, ``vllm_ops_naive``) so that ``benchmarks/kda_ops_check.py`` holds vLLM's
kernels to the very calls the layer makes, on a GPU machine without vLLM.

vLLM's ops (``vllm/models/kimi_k3/{nvidia,amd}/ops/third_party/kda``, 0.32 and
0.33) take q, k, v ``[1, T, H, D]`` (the short conv's outputs, dense), the raw
decay ``raw_g`` ``[1, T, H, D]`` and ``raw_beta`` ``[1, T, H]``, sequences by int32
``cu_seqlens``; their states are ``[H, V, K]``.
"""

from __future__ import annotations

import torch


def vllm_chunk_args(
    mixed: torch.Tensor, decay: torch.Tensor, beta_logits: torch.Tensor, heads: int
) -> dict:
    """q, k, v, ``raw_g`` and ``raw_beta`` of ``chunk_kda_with_fused_gate`` for
    tokens in sequence order: ``mixed`` ``[T, 3C]`` (the conv's q, k, v, any
    float dtype), ``decay`` ``[T, C]`` and ``beta_logits`` ``[T, H]`` as the
    projections give them (the model's dtype)."""
    shaped = (1, mixed.shape[0], heads, -1)
    q, k, v = (
        part.reshape(shaped).to(decay.dtype).contiguous()
        for part in mixed.chunk(3, dim=-1)
    )
    return dict(
        q=q, k=k, v=v, raw_g=decay.reshape(shaped).contiguous(),
        raw_beta=beta_logits.reshape(shaped[:3]).contiguous(),
    )  # fmt: skip


def vllm_window_args(
    mixed: torch.Tensor,
    decay: torch.Tensor,
    beta_logits: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
    skip: torch.Tensor,
    heads: int,
) -> tuple[dict, torch.Tensor]:
    """The per-step arguments of vLLM's in-tree K3 ``fused_recurrent_kda`` for
    windows (``VLLM_K3_KDA=auto``), from ``window_conv``'s ``mixed`` ``[R, L, 3C]``
    and the step's raw ``decay`` ``[T, C]`` and ``beta_logits`` ``[T, H]``, and where
    each window position's output lands in the kernel's ``o``.

    As vLLM's own layer passes them: the rows' valid tokens packed one after the
    other (``cu_seqlens`` from the valid counts), so the kernel reads each row's
    start slot ``slots[r, skip[r]]`` and writes the state after token ``t`` into
    ``slots[r, t]`` for its own tokens only (a row shorter than last step's
    accepted count included; a padded row, on the null block, does nothing), and
    one empty row more so that a call is never of one sequence. The shapes stay
    fixed (``R·L`` positions, the unused ones past the last row) and nothing is
    read back. q, k, v are dense, in the model's dtype."""
    rows, length = tokens.shape
    counts = valid.sum(dim=1)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    offsets = torch.arange(length, device=tokens.device)
    spare = rows * length
    packed_at = torch.where(valid, starts[:-1, None] + offsets, spare).reshape(-1)

    def packed(x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[R·L, ...]`` in window order, packed: ``[R·L, ...]``."""
        staged = x.new_zeros(spare + 1, *x.shape[1:])
        staged[packed_at] = x
        return staged[:spare]

    positions = tokens.reshape(-1)
    shaped = (1, spare, heads, -1)
    q, k, v = (
        packed(part).reshape(shaped).to(decay.dtype).contiguous()
        for part in mixed.reshape(spare, -1).chunk(3, dim=-1)
    )
    # One empty sequence more, on the null block: vLLM's ROCm kernel runs a call
    # of one sequence as one sequence of all T tokens, ignoring ``cu_seqlens``.
    args = dict(
        q=q, k=k, v=v,
        raw_g=packed(decay[positions]).reshape(shaped).contiguous(),
        raw_beta=packed(beta_logits[positions]).reshape(1, spare, heads).contiguous(),
        cu_seqlens=torch.cat([starts, starts[-1:]]).to(torch.int32),
        ssm_state_indices=torch.cat([slots, torch.zeros_like(slots[:1])])
        .to(torch.int32)
        .contiguous(),
        num_accepted_tokens=torch.cat([skip + 1, torch.ones_like(skip[:1])]).to(
            torch.int32
        ),
    )  # fmt: skip
    return args, packed_at.clamp(max=spare - 1).reshape(rows, length)
