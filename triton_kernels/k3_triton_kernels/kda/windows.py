"""KDA over windows of tokens in vLLM's speculative layout, in PyTorch: each row
verifies a window (the last sampled token and its drafts) from the state its last
step accepted, keeping the state after every window token. A window of one token
without drafts is a decode step (``decode.kda_decode``'s job, for a conv buffer of
``W-1`` inputs). No kernel: vLLM's in-tree K3 runs windows in its
``fused_recurrent_kda``.

Everything runs in fixed shapes from device tensors: nothing is read back, so a CUDA
graph holds it and replays it with other values in the same tensors.

vLLM's layout (its GDN metadata and the in-tree KDA): a row's slots ``s_0 … s_k``
are one per window position; the recurrent state after window token ``t`` goes to
``s_t``, and a row that accepted ``a`` tokens last step starts from ``s_{a-1}``
(``skip = a - 1``). The conv state is one buffer in ``s_0`` of ``W - 1 + k`` inputs:
the history is the ``W - 1`` starting at column ``skip``; after the window the
buffer holds the inputs from the history's second on, so that column ``a' - 1``
starts the history of the ``a'`` tokens the next step accepts. Positions past a
row's window (``valid`` false: fewer drafts, or a padded row of a graph replay, whose
slots are vLLM's null block 0) read a clamped token and write their state to slot 0
and conv inputs that no later step reads.

Shapes: ``qkv`` ``[T, 3C]``, ``conv_weight`` ``[3C, W]``, ``conv_state``
``[slots, 3C, ≥ W-1]``, ``decay`` ``[T, C]``, ``dt_bias`` ``[C]``, ``a_log`` ``[H]``,
``beta`` ``[T, H]``, ``recurrent_state`` ``[slots, H, K, V]`` fp32; ``tokens``,
``valid``, ``slots`` ``[R, L]`` (``L`` window positions), ``skip`` ``[R]``. Returns
``o`` ``[R, L, H, V]`` fp32; with ``out`` ``[T, H, V]`` given, each valid one is
also written there at its token (the others go to a spare row past the batch, so
that a clamped token shared with a valid one is not overwritten).
"""

from __future__ import annotations

import torch

from k3_triton_kernels.kda.naive import delta_rule_inputs, kda_step


def window_conv(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    skip: torch.Tensor,
) -> torch.Tensor:
    """The short conv (and SiLU) of every window position, ``[R, L, 3C]`` fp32,
    from each row's history at column ``skip`` of its conv buffer in ``slots[:,
    0]``; the buffers are updated in place as the module docstring says."""
    rows, length = tokens.shape
    conv = conv_weight.shape[-1]
    history = conv - 1
    buffer_slots = slots[:, 0]
    buffers = conv_state[buffer_slots].float()  # [R, 3C, buffer]
    columns = skip[:, None] + torch.arange(history, device=qkv.device)
    prior = buffers.gather(2, columns[:, None, :].expand(-1, buffers.shape[1], -1))
    x = qkv[tokens.reshape(-1)].float().reshape(rows, length, -1)
    inputs = torch.cat([prior, x.transpose(1, 2)], dim=2)  # [R, 3C, W-1+L]
    taps = inputs.unfold(2, conv, 1)  # [R, 3C, L, W]
    mixed = torch.nn.functional.silu((taps * conv_weight.float()[:, None, :]).sum(-1))
    buffers[:, :, : history - 1 + length] = inputs[:, :, 1:]
    conv_state[buffer_slots] = buffers.to(conv_state.dtype)
    return mixed.transpose(1, 2)


def place_outputs(
    out: torch.Tensor, outputs: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor
) -> None:
    """Write each valid window position's output ``outputs`` ``[R, L, ...]`` into
    ``out`` at its token; the others go to a spare row past the batch, so that a
    clamped token shared with a valid one is not overwritten."""
    staged = torch.cat([out, out.new_zeros(1, *out.shape[1:])])
    places = torch.where(valid, tokens, out.shape[0]).reshape(-1)
    staged[places] = outputs.reshape(-1, *out.shape[1:]).to(out.dtype)
    out.copy_(staged[:-1])


def kda_windows(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    decay: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
    skip: torch.Tensor,
    *,
    lower_bound: float = -5.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    rows, length = tokens.shape
    heads, dim = a_log.shape[0], recurrent_state.shape[-1]
    positions = tokens.reshape(-1)
    mixed = window_conv(qkv, conv_weight, conv_state, tokens, slots, skip)
    q, k, v, g = (
        part.reshape(rows, length, heads, dim)
        for part in delta_rule_inputs(
            mixed.reshape(rows * length, -1),
            decay[positions],
            dt_bias,
            a_log,
            lower_bound,
        )
    )
    gates = beta[positions].float().reshape(rows, length, heads)
    state = recurrent_state[slots.gather(1, skip[:, None])[:, 0]].float()
    targets = torch.where(valid, slots, 0)
    outputs = []
    for t in range(length):
        o, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], gates[:, t], state)
        recurrent_state[targets[:, t]] = state.to(recurrent_state.dtype)
        outputs.append(o)
    outputs = torch.stack(outputs, dim=1)
    if out is not None:
        place_outputs(out, outputs, tokens, valid)
    return outputs
