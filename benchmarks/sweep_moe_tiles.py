"""Tile sweep of the latent MoE on a GPU, timed by CUDA-graph replays as
``bench_kernels.py`` times it: K3's shapes on one device (112 experts, top-16,
latent 3584, inner 3072; MXFP4 weights) at 1, 16, 256 and 4,096 tokens:
block_m 16 (under 256 tokens) or 64/128, block_n x block_k 64 x 128 and 128 x 128
(the gate/up dot is 2 x block_n wide), 4 warps, and from 256 tokens 8 too (a 128 x
256 gate/up accumulator needs two warp groups), 3 and 4 pipeline stages; under 256
tokens each with the dots both ways (``swap_ab``) and 2 stages too. Prints
the default and the four fastest per token count, and what the launch before the
GEMMs takes alone (the expert grouping, the activations' quantization, the zeroed
output).

    python benchmarks/sweep_moe_tiles.py          # on a GPU; about 5 minutes
    python benchmarks/sweep_moe_tiles.py --smoke  # tiny shapes, CPU interpreter

``latent_moe.default_tiles`` is set from its output, kept in
``benchmarks/results/moe_tiles_h200.txt``.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch
from kernel_cases import K3_MOE, expert_weights, routed_tokens
from kernel_timing import graph_microseconds, script_device

TOKENS = (1, 16, 256, 4096)
# From this many tokens: 64- and 128-row blocks, 4 and 8 warps, one orientation.
LARGE_BATCH = 256
# --smoke: every configuration once on the CPU interpreter (experts, top-k, latent,
# inner; MXFP4 takes latent and inner in whole 32-wide scale groups).
SMOKE_MOE = (8, 2, 64, 32)
SMOKE_TOKENS = (1, 16)
SMOKE_LARGE_BATCH = 16


def sweep(
    packed, tokens, z, ids, weights, microseconds, large_batch=LARGE_BATCH
) -> tuple[float, list[str]]:
    """The default tiles' time and the four fastest configurations."""
    from k3_triton_kernels.moe import latent_moe as moe

    default = moe.default_tiles(tokens)
    large = tokens >= large_batch
    block_ms = (64, 128) if large else (16,)
    warps = (4, 8) if large else (4,)
    # Under 256 tokens 2 stages too: at one token the gate/up GEMM's 768 programs
    # (16 experts x 48 column blocks) fill 1.45 waves of 4 a multiprocessor at 3
    # stages (55 KB of shared memory each); at 2 stages 6 fit, one wave.
    stages = (3, 4) if large else (2, 3, 4)
    configs = itertools.product(block_ms, ((64, 128), (128, 128)), warps, stages)
    # Under 64-row blocks both orientations of the dots (None: the default).
    swaps = (None,) if large else (True, False)
    results, default_us = [], float("nan")
    for index, ((block_m, (block_n, block_k), warps, stages), swap) in enumerate(
        [((default[0], default[1:], 4, None), None), *itertools.product(configs, swaps)]
    ):
        run = functools.partial(
            moe.latent_moe, z, ids, weights, packed, block_m=block_m,
            block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
            swap_ab=swap,
        )  # fmt: skip
        try:
            us = microseconds(run)
        except Exception as error:  # out of resources: report, go on
            print(
                f"T={tokens} bm{block_m} bn{block_n} bk{block_k} w{warps} "
                f"s{stages} swap{swap}: failed, {error!r:.100}"
            )
            continue
        if index == 0:
            default_us = us
        results.append((us, block_m, block_n, block_k, warps, stages, swap))
    results.sort(key=lambda result: result[0])
    best = [
        f"{us:.1f} bm{bm} bn{bn} bk{bk} w{w} s{s}"
        + ("" if sw is None else f" swap{sw}")
        for us, bm, bn, bk, w, s, sw in results[:4]
    ]
    return default_us, best


def main(argv=None) -> None:
    device = script_device(__doc__, argv)
    if device.type == "cuda":
        shape, token_counts, large_batch = K3_MOE, TOKENS, LARGE_BATCH
    else:
        shape, token_counts, large_batch = SMOKE_MOE, SMOKE_TOKENS, SMOKE_LARGE_BATCH
    run_sweeps(device, shape, token_counts, large_batch)


def run_sweeps(device, shape, token_counts, large_batch) -> None:
    from k3_triton_kernels.moe import latent_moe as moe
    from k3_triton_kernels.moe.naive import FP8, mxfp4_experts_from

    microseconds = functools.partial(graph_microseconds, cuda=device.type == "cuda")
    num_experts, top_k, latent, inner = shape
    torch.manual_seed(0)
    w13, w2 = expert_weights(num_experts, latent, inner, device)
    packed = mxfp4_experts_from(w13, w2)
    del w13, w2
    started = time.time()
    for tokens in token_counts:
        z, ids, weights = routed_tokens(tokens, num_experts, top_k, latent, device)
        default_us, best = sweep(
            packed, tokens, z, ids, weights, microseconds, large_batch
        )
        block_m = moe.default_tiles(tokens)[0]
        try:  # the launch before the GEMMs: grouping, FP8 latent, zeroed output
            preparation = microseconds(
                lambda ids=ids, bm=block_m, z=z: moe.prepare_rows(
                    ids, num_experts, bm, z, FP8
                )
            )
            preparation = f"{preparation:.1f}us"
        except Exception as error:  # reported, the sweep goes on
            preparation = f"failed ({error!r:.80})"
        print(
            f"T={tokens} default={default_us:.1f}us best: {best}; preparation "
            f"{preparation}",
            flush=True,
        )
    print("elapsed", time.time() - started)


if __name__ == "__main__":
    main()
