"""The kernels' untimed options side by side on a GPU, timed by CUDA-graph replays as
``bench_kernels.py`` times them, at K3's shapes, with vLLM's kernels for the same
job in the same process:

- MLA decode (bf16 queries, 16 heads, 64-token pages), FP8 cache: the default
  (fp16 dots, 4 warps), 8 warps, and each tile's reads issued an
  iteration early (``prefetch``) at 8 warps (its default) and 4; bf16 cache (the
  cache without ``--kv-cache-dtype fp8``, never timed before): the default (bf16
  dots), 8 warps, prefetch and twice the default split count; vLLM's
  ``decode_attention_fwd`` on the same cache; each row's HBM fraction, and how far
  each variant's output is from the default's.
- Latent MoE, FP8 per-channel weights (112 experts, top-16, latent 3584, inner
  3072): exact sums (``imprecise_products=0``); the default (Hopper's narrow FP8
  accumulation over each K tile, the down GEMM's column blocks first); the down
  GEMM's row blocks first (``down_rows_first``); never promoting (as vLLM's
  ``fused_moe``); under 256 tokens 2 pipeline stages; from 256 tokens
  128-row blocks at 8 warps (vLLM's large-batch tiles), promoting each K tile
  and never, and K tiles of 256 (a promotion every 256 products); vLLM's two GEMMs
  alone; each variant's gap to the exact sums' output, and of the gate/up GEMM's
  output alone. Then the same experts as MXFP4 (``tl.dot_scaled``) at the
  default tiles.
- For the defaults (and MLA's prefetch), each kernel's share of a call's device
  time, from the PyTorch profiler.

    python benchmarks/compare_variants.py           # on a GPU; about 4 minutes
    python benchmarks/compare_variants.py --smoke   # tiny shapes, CPU interpreter

The defaults in ``mla_decode`` and ``latent_moe`` are decided from its output,
kept in ``benchmarks/results/``.
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

import torch
from bench_kernels import (
    K3_MOE,
    _vllm_mla,
    expert_weights,
    graph_microseconds,
    kernel_microseconds,
    routed_tokens,
    script_device,
)

HBM = 4.8e12  # H200


class Shapes(NamedTuple):
    mla: tuple[tuple[int, int], ...]  # (batch, context)
    moe_tokens: tuple[int, ...]
    moe: tuple[int, int, int, int]  # experts, top-k, latent, inner
    # From this many tokens the MoE also tries 128-row blocks and 256-wide K tiles.
    large_batch: int


K3_SHAPES = Shapes(
    mla=((1, 131072), (32, 32768), (128, 32768), (32, 131072)),
    moe_tokens=(1, 256, 4096),
    moe=K3_MOE,
    large_batch=256,
)
# --smoke: every variant and baseline once, on the CPU interpreter (MXFP4 takes
# latent and inner in whole 32-wide scale groups).
SMOKE_SHAPES = Shapes(
    mla=((2, 100),), moe_tokens=(1, 16), moe=(8, 2, 64, 32), large_batch=16
)


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


MLA_VARIANTS = {
    "fp8": (
        ("default", {}),
        ("w8", {"num_warps": 8}),
        ("prefetch", {"prefetch": True}),  # 8 warps on NVIDIA
        ("prefetch w4", {"prefetch": True, "num_warps": 4}),
    ),
    # A bf16 cache (no --kv-cache-dtype) takes bf16 dots, its tile staged by
    # Triton's pipeliner as it reaches the dots unconverted.
    "bf16": (
        ("default", {}),
        ("w8", {"num_warps": 8}),
        ("prefetch", {"prefetch": True}),
    ),
}


def compare_mla(device, shapes: Shapes) -> None:
    from k3_triton_kernels.mla import decode as mla

    cache_dtypes = {"fp8": mla.FP8_DTYPES[0], "bf16": torch.bfloat16}
    for cache_label, cache_dtype in cache_dtypes.items():
        for batch, context in shapes.mla:
            compare_mla_shape(device, batch, context, cache_label, cache_dtype)


def compare_mla_shape(device, batch, context, cache_label, cache_dtype) -> None:
    from k3_triton_kernels.mla import decode as mla

    cuda = device.type == "cuda"
    microseconds = functools.partial(graph_microseconds, cuda=cuda)
    pages = math.ceil(context / 64)
    cache = torch.randn(batch * pages, 64, 576, device=device).to(cache_dtype)
    table = torch.arange(batch * pages, device=device, dtype=torch.int32)
    table = table.view(batch, pages)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, 1, 16, 576, device=device, dtype=torch.bfloat16)
    cache_bytes = batch * context * 576 * cache.element_size()
    cells, outputs = [], {}
    variants = list(MLA_VARIANTS[cache_label])
    if cache_label == "bf16":
        # On sm90 the bf16 path holds 128 registers: 4 programs of 4 warps fit a
        # multiprocessor, where the default split count fills 2.
        splits = mla.default_num_splits(context, batch, device)
        variants.append(("splits x2", {"num_splits": 2 * splits}))
    for label, options in variants:
        run = functools.partial(
            mla.mla_decode, q, cache, table, lens, max_seq_len=context, **options
        )
        try:
            us = microseconds(run)
            outputs[label] = run()[0]
        except Exception as error:  # report, go on
            cells.append(f"{label} failed: {error!r:.120}")
            continue
        cells.append(f"{label} {us:.1f}us {cache_bytes / us * 1e6 / HBM:.0%}")
    seconds, theirs = _vllm_mla(q, cache, table, lens, 2 if cuda else 0, 10, cuda)
    if seconds is None:
        cells.append(str(theirs)[:120])
    else:
        cells.append(f"vLLM {seconds * 1e6:.1f}us")
    for label, out in outputs.items():
        if label != "default" and "default" in outputs:
            cells.append(f"{label} gap {gap(out, outputs['default']):.1e}")
    shape = f"MLA {cache_label} cache B={batch} ctx={context}"
    print(f"{shape}: " + "; ".join(cells), flush=True)
    for label, options in (("default", {}), ("prefetch", {"prefetch": True})):
        run = functools.partial(
            mla.mla_decode, q, cache, table, lens, max_seq_len=context, **options
        )
        print(f"{shape} {label}, by kernel: {breakdown(run)}", flush=True)


def breakdown(run) -> str:
    """Where one call's device time goes, kernel by kernel (profiled, eager)."""
    try:
        by_kernel = kernel_microseconds(run)
    except Exception as error:  # a profiler that does not run is reported
        return f"profiler failed ({error!r:.80})"
    if not by_kernel:
        return "no device kernels recorded"
    return ", ".join(f"{name[:40]} {us:.1f}us" for name, us in by_kernel.items())


def output_and_gate_up(run) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s output, and its gate/up GEMM's SiTU output (before its
    requantization): the same FP8 inputs for every variant, so that gap is the
    accumulation's alone."""
    from k3_triton_kernels.moe import latent_moe as moe

    recorded = []
    quantize = moe.quantize_rows

    def recording(x, dtype, **padding):
        if "rows" in padding:  # the intermediate, a row a routed pair, in pair order
            rows = padding["rows"].long()  # (the kernel's row order varies)
            by_pair = torch.zeros(int((rows >= 0).sum()), x.shape[1], device=x.device)
            by_pair[rows[rows >= 0]] = x[rows >= 0]
            recorded.append(by_pair)
        return quantize(x, dtype, **padding)

    moe.quantize_rows = recording
    try:
        out = run()
    finally:
        moe.quantize_rows = quantize
    return out, recorded[-1]


def compare_moe(device, shapes: Shapes) -> None:
    from k3_triton_kernels.moe import latent_moe as moe

    microseconds = functools.partial(graph_microseconds, cuda=device.type == "cuda")
    num_experts, top_k, latent, inner = shapes.moe
    torch.manual_seed(0)
    w13, w2 = expert_weights(num_experts, latent, inner, device)
    packed = moe.fp8_experts_from(w13, w2)
    mxfp4 = moe.mxfp4_experts_from(w13, w2)
    del w13, w2
    weight_bytes = packed.w13[0].numel() + packed.w2[0].numel()
    mxfp4_bytes = sum(t[0].numel() for t in mxfp4[1:])
    for tokens in shapes.moe_tokens:
        z, ids, weights = routed_tokens(tokens, num_experts, top_k, latent, device)
        experts_used = len(torch.unique(ids))
        flops = 2 * tokens * top_k * latent * 3 * inner
        cells, outputs, intermediates = [], {}, {}
        variants = [
            ("exact", {"imprecise_products": 0}),
            ("default", {}),
            ("rows-first", {"down_rows_first": True}),
            ("never", {"imprecise_products": None}),
        ]
        if tokens < shapes.large_batch:
            # 2 stages: at one token the gate/up GEMM's 768 programs fill 1.45
            # waves of 4 a multiprocessor at 3 (55 KB of shared memory each).
            variants.append(("s2", {"num_stages": 2}))
        else:
            variants.append(("bm128 w8", {"block_m": 128, "num_warps": 8}))
            # vLLM's large-batch tiles (128 x 128, 8 warps) and its accumulation:
            # how much of the gap to its GEMMs is the promotion into fp32 alone.
            variants.append(
                (
                    "bm128 w8 never",
                    {"block_m": 128, "num_warps": 8, "imprecise_products": None},
                )
            )
            # K tiles of 256: half the promotions into fp32 (one a tile).
            variants.append(("bk256", {"block_k": 256}))
        variants.append(("mxfp4", {"experts": mxfp4}))
        for label, options in variants:
            experts = options.pop("experts", packed)
            run = functools.partial(moe.latent_moe, z, ids, weights, experts, **options)
            try:
                us = microseconds(run)
                outputs[label], intermediates[label] = output_and_gate_up(run)
            except Exception as error:  # report, go on
                cells.append(f"{label} failed: {error!r:.120}")
                continue
            moved = weight_bytes if experts is packed else mxfp4_bytes
            hbm = experts_used * moved / us * 1e6 / HBM
            tflops = flops / us / 1e6
            cells.append(f"{label} {us:.1f}us {hbm:.0%} HBM {tflops:.0f} TFLOP/s")
        try:
            from vllm_baselines import VllmLatentMoe

            vllm = VllmLatentMoe(z, ids, weights, packed)
            cells.append(f"vLLM GEMMs {microseconds(vllm.gemms):.1f}us")
        except Exception as error:  # a baseline that does not run is reported
            cells.append(f"vLLM failed ({error!r:.80})")
        for label in outputs:
            # MXFP4 rounds the weights themselves: no accumulation gap to show.
            if label not in ("exact", "mxfp4") and "exact" in outputs:
                cells.append(
                    f"{label} gap {gap(outputs[label], outputs['exact']):.1e}, "
                    f"gate/up {gap(intermediates[label], intermediates['exact']):.1e}"
                )
        print(f"MoE T={tokens}: " + "; ".join(cells), flush=True)
        for label, experts in (("fp8", packed), ("mxfp4", mxfp4)):
            print(
                f"MoE T={tokens} {label} default, by kernel: "
                + breakdown(
                    functools.partial(moe.latent_moe, z, ids, weights, experts)
                ),
                flush=True,
            )


def main(argv=None) -> None:
    device = script_device(__doc__, argv)
    if device.type == "cuda":
        shapes, name = K3_SHAPES, torch.cuda.get_device_name()
    else:
        shapes, name = SMOKE_SHAPES, "CPU (interpreter)"
    started = time.time()
    print(name, "torch", torch.__version__, flush=True)
    compare_moe(device, shapes)
    compare_mla(device, shapes)
    print(f"elapsed {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
