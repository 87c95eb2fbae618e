"""vLLM's own kernels on the same inputs as ours, timed: the baselines of
``bench_kernels.py``. Each returns ``(seconds, ...)``, or ``(None, why)`` where the
baseline did not run (a baseline that fails is reported, not hidden). vLLM's
kernels come from an installed vLLM, or are loaded from its source
(``vllm_baselines.py``) on a GPU machine without vLLM.
"""

from __future__ import annotations

import math

from kernel_timing import timed

# vLLM's in-tree K3 KDA ops (0.32 to 0.34), one copy per vendor.
K3_KDA_PACKAGES = (
    "vllm.models.kimi_k3.nvidia.ops.third_party.kda",
    "vllm.models.kimi_k3.amd.ops.third_party.kda",
)


def vllm_chunk_kda(q, k, v, g, beta, state, warmup, repeats, cuda):
    """vLLM's in-tree ``chunk_kda`` (its port of flash-linear-attention) on the same
    prompt: bf16 q/k/v as a real layer hands them over, fp32 gate and state."""
    if not cuda:
        return None, "vLLM's Triton kernels need a GPU"
    try:
        import torch

        chunk_kda, source = vllm_kda_op("chunk_kda")
        tokens = q.shape[0]
        q2, k2, v2 = (x[None].to(torch.bfloat16).contiguous() for x in (q, k, v))
        g2, beta2 = g[None].float().contiguous(), beta[None].float().contiguous()
        cu_seqlens = torch.tensor([0, tokens], device=q.device, dtype=torch.int32)
        initial = state[None].contiguous()

        def run():
            chunk_kda(
                q2, k2, v2, g2, beta2, scale=1.0, initial_state=initial.clone(),
                output_final_state=True, cu_seqlens=cu_seqlens,
            )  # fmt: skip

        return timed(run, warmup=warmup, repeats=repeats, cuda=True), source
    except Exception as error:  # a baseline that does not run is reported
        return None, f"vLLM baseline failed: {type(error).__name__}: {error}"[:200]


def vllm_kda_op(name: str):
    """``(op, where it came from)``: vLLM's in-tree K3 KDA op ``name`` from the
    installed vLLM (the platform's copy first), else loaded from vLLM's source
    (``vllm_baselines.k3_kda_ops``)."""
    import importlib

    import torch

    packages = K3_KDA_PACKAGES[::-1] if torch.version.hip else K3_KDA_PACKAGES
    for package in packages:
        try:
            return getattr(importlib.import_module(package), name), package
        except (ImportError, AttributeError):
            continue
    from vllm_baselines import k3_kda_ops

    ops = k3_kda_ops()
    return getattr(ops, name), f"from source: {ops.source}"


def vllm_kda_decode(args, warmup, repeats, cuda):
    """vLLM's in-tree K3 decode step, ``fused_recurrent_kda`` (gate, beta sigmoid
    and q/k L2 norm in the kernel; its state ``[V, K]``), on the same batch: one
    token a sequence, each in its own state slot. It takes the convolved q/k/v:
    vLLM runs ``causal_conv1d_update`` before it, which this time leaves out."""
    if not cuda:
        return None, "vLLM's Triton kernels need a GPU"
    try:
        import torch

        op, source = vllm_kda_op("fused_recurrent_kda")
        batch, heads, dim = args["recurrent_state"].shape[:3]
        qkv = args["qkv"].view(1, batch, 3, heads, dim)
        q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
        raw_g = args["decay"].view(1, batch, heads, dim)
        raw_beta = torch.logit(args["beta"]).view(1, batch, heads).to(q.dtype)
        # vLLM's kernel skips a sequence in slot 0 (its null block): slots 1..B.
        state = args["recurrent_state"]
        state = torch.cat([torch.zeros_like(state[:1]), state]).transpose(-1, -2)
        state = state.contiguous()
        cu_seqlens = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
        slots = (args["slots"] + 1).to(torch.int32)

        def run():
            op(
                q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=args["a_log"],
                dt_bias=args["dt_bias"], lower_bound=-5.0, initial_state=state,
                cu_seqlens=cu_seqlens, ssm_state_indices=slots,
            )  # fmt: skip

        return timed(run, warmup=warmup, repeats=repeats, cuda=True), source
    except Exception as error:  # a baseline that does not run is reported
        return None, f"vLLM baseline failed: {type(error).__name__}: {error}"[:200]


def vllm_mla(q, cache, table, lens, warmup, repeats, cuda):
    """vLLM's ``decode_attention_fwd`` on the same cache (MLA form: K = the latent,
    V = its first 512 channels, the same queries), with the KV splits vLLM's Triton
    MLA backend picks for the batch, and its output."""
    try:
        import torch
        from vllm_baselines import decode_attention_fwd, mla_num_kv_splits

        decode = decode_attention_fwd()
        batch, _, heads, width = q.shape
        page = cache.shape[1]
        sms = (
            torch.cuda.get_device_properties(q.device).multi_processor_count
            if cuda
            else 1
        )
        splits = mla_num_kv_splits()(int(lens.max()), sms)
        k_buffer = cache.view(-1, page, 1, width)
        v_buffer = k_buffer[..., :512]
        out = torch.empty(batch, heads, 512, device=q.device, dtype=q.dtype)
        lse = torch.empty(batch, heads, device=q.device, dtype=torch.float32)
        logits = torch.empty(batch, heads, splits, 513, device=q.device)
        q2 = q[:, 0].contiguous()
        # The layer's scales, made once (vLLM passes the layer's own tensors).
        k_scale = torch.ones((), device=q.device)
        v_scale = torch.ones((), device=q.device)

        def run():
            decode(
                q2, k_buffer, v_buffer, out, lse, table, lens, logits, splits,
                1 / math.sqrt(192), page_size=page, k_scale=k_scale, v_scale=v_scale,
                is_mla=True,
            )  # fmt: skip

        seconds = timed(run, warmup=warmup, repeats=repeats, cuda=cuda)
        return seconds, out.float()
    except Exception as error:  # a baseline that does not run is reported
        return None, f"vLLM baseline failed: {type(error).__name__}: {error}"[:200]


def vllm_moe(z, ids, weights, w13, w2, warmup, repeats, cuda):
    """vLLM's two ``fused_moe_kernel`` GEMMs with its default tile config, on the
    same experts quantized to FP8 per channel (per-token activations), timed alone:
    the sort, the FP8 activations and the SiTU between them are prepared once,
    untimed (``vllm_baselines``); its output and its reference's."""
    try:
        from vllm_baselines import VllmLatentMoe

        baseline = VllmLatentMoe(z, ids, weights, w13, w2)
        seconds = timed(baseline.gemms, warmup=warmup, repeats=repeats, cuda=cuda)
        return (seconds, baseline.output), baseline.reference
    except Exception as error:  # a baseline that does not run is reported
        return (
            None,
            f"vLLM baseline failed: {type(error).__name__}: {error}"[:200],
        ), None
