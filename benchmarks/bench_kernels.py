"""GPU benchmark of the Kimi-K3 Triton kernels against vLLM's own, in one process.

    python benchmarks/bench_kernels.py [--json OUT]  # on a CUDA / ROCm GPU
    python benchmarks/bench_kernels.py --smoke       # tiny shapes, CPU interpreter

For each kernel and shape it prints the device time (CUDA-graph replays: the
kernels' own time, as a captured decode step pays it), the wall time of one eager
call with its launches (what an uncaptured scheduler step pays), achieved TB/s and
TFLOP/s, the fraction of the chip's roofline (MI355X: 8 TB/s, ~5 PFLOP/s dense FP8;
H200: 4.8 TB/s, ~1.98 PFLOP/s dense FP8), and the ratio against vLLM's Triton kernel
for the same job (``decode_attention_fwd`` for MLA decode, ``fused_experts`` for the
MoE), when that kernel runs here; a baseline that fails is reported, not hidden. The
KDA prefill (the chunk-terms and state-pass kernels) is set against vLLM's
``chunk_kda``, the KDA decode step against vLLM's ``fused_recurrent_kda`` (both the
in-tree K3's, from an installed vLLM or loaded from its source), and the chunk-terms
kernel alone against the batched PyTorch terms it replaces. Some rows are inputs to
decisions rather than kernels of ours being judged: the KDA decode step against its
PyTorch reference, the chunked PyTorch prefill against the per-token definition, and
the attention-residual mix as PyTorch runs it today (how far it sits below the HBM
roofline is what a fused mix kernel could win).

Bytes are what the job must read and write at least (the FP8 cache rows of every
sequence; each used expert's weights once, plus activations); FLOPs are the GEMM
multiply-adds counted as two.

How a call is timed is ``kernel_timing.py``; the shapes and inputs are
``kernel_cases.py``; vLLM's kernels on them, ``vllm_kernel_runs.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

from kernel_cases import (
    expert_weights,
    kda_cases,
    kda_prefill_cases,
    mix_cases,
    mla_cases,
    moe_cases,
    routed_tokens,
)
from kernel_timing import UNCAPTURED, timed, wall_timed
from vllm_kernel_runs import (
    vllm_chunk_kda,
    vllm_kda_decode,
    vllm_mla,
    vllm_moe,
)

# Per block, what the model class's ``auto`` setting runs on a deployment and what
# this script can set beside ours on a GPU machine without vLLM (printed first).
AUTO_BASELINES = {
    "MLA": "auto runs the backend vLLM selects (FlashMLA or FA MLA on Hopper, AITER "
    "on MI355X: vLLM's compiled extensions, not loadable without vLLM); timed here: "
    "vLLM's Triton MLA decode (decode_attention_fwd), the TRITON_MLA backend's",
    "MoE": "auto runs vLLM's FusedMoE with the MXFP4 method vLLM picks (Marlin, "
    "triton_kernels or FlashInfer: compiled or separate packages); timed here: "
    "vLLM's fused_moe Triton GEMMs on FP8 weights",
    "KDA": "auto runs vLLM's in-tree K3 ops (chunk_kda_with_fused_gate, "
    "fused_recurrent_kda); timed here: those kernels, loaded from vLLM's source",
}

ROOFLINES = {  # (bytes/s, dense FP8 FLOP/s)
    "MI355X": (8.0e12, 5.0e15),
    "MI300X": (5.3e12, 2.6e15),
    "H200": (4.8e12, 1.979e15),
    "H100": (3.35e12, 1.979e15),
}


def roofline(device_name: str) -> tuple[float, float] | None:
    for key, value in ROOFLINES.items():
        if key.lower() in device_name.lower().replace(" ", ""):
            return value
    return None


def bench_kda(device, smoke, warmup, repeats):
    import torch

    from k3_triton_kernels.kda import decode as kda

    cuda = device.type == "cuda"
    for batch, heads, dim in kda_cases(smoke):
        channels, conv = heads * dim, 4
        generator = torch.Generator().manual_seed(0)

        def randn(*shape, generator=generator):
            return torch.randn(*shape, generator=generator).to(device)

        args = dict(
            qkv=randn(batch, 3 * channels).to(torch.bfloat16),
            conv_weight=randn(3 * channels, conv).to(torch.bfloat16),
            conv_state=randn(batch, 3 * channels, conv - 1).to(torch.bfloat16),
            decay=randn(batch, channels).to(torch.bfloat16),
            dt_bias=randn(channels),
            a_log=randn(heads),
            beta=torch.sigmoid(randn(batch, heads)),
            recurrent_state=randn(batch, heads, dim, dim) / dim**0.5,
            slots=torch.arange(batch, device=device),
        )
        seconds = timed(
            lambda args=args: kda.kda_decode(**args),
            warmup=warmup,
            repeats=repeats,
            cuda=cuda,
        )
        # The reference's thousands of small launches, timed eagerly (a graph of
        # them would take longer to capture than to run).
        reference_s = wall_timed(
            lambda args=args: kda.kda_decode_reference(**args),
            warmup=min(warmup, 1),
            repeats=max(1, repeats // 10),
            cuda=cuda,
        )
        state = batch * heads * dim * dim * 4
        yield (
            {
                "kernel": "kda_decode",
                "shape": f"B={batch} H={heads} K=V={dim}",
                "s": seconds,
                # the state read and written; per token its bf16 qkv and decay,
                # the conv state read and written; the bf16 conv weight once
                "bytes": 2 * state
                + batch * 3 * channels * (2 + 2 * (conv - 1) * 2)
                + batch * channels * 2
                + 3 * channels * conv * 2,
                "flops": batch * heads * 4 * 2 * dim * dim,
                "vllm_s": reference_s,
                "vllm_note": None,
                "baseline": "our PyTorch reference (eager)",
            }
        )
        vllm_s, note = vllm_kda_decode(args, warmup, repeats, cuda)
        yield (
            {
                "kernel": "kda_decode[vs vLLM]",
                "shape": f"B={batch} H={heads} K=V={dim}",
                "s": seconds,
                "bytes": 2 * state,
                "flops": batch * heads * 4 * 2 * dim * dim,
                "vllm_s": vllm_s,
                "vllm_note": note,
                "baseline": "vLLM's K3 fused_recurrent_kda (without its conv step)",
            }
        )


def bench_kda_prefill(device, smoke, warmup, repeats):
    """The chunked KDA prefill of one prompt: our two kernels (chunk terms, state
    pass) against vLLM's ``chunk_kda``; the chunk-terms kernel against the batched
    PyTorch terms; and the chunked form in PyTorch against the per-token definition
    (what the chunking alone wins)."""
    import torch

    from k3_triton_kernels.kda.chunk_state import kda_state_pass
    from k3_triton_kernels.kda.chunk_terms import (
        kda_chunk_terms,
        kda_chunk_terms_reference,
    )
    from vllm_k3_plugin.reference import reference as ref
    from vllm_k3_plugin.reference.kda_chunk import chunk_size_for, kda_chunked

    cuda = device.type == "cuda"
    for tokens, heads, dim in kda_prefill_cases(smoke):
        generator = torch.Generator().manual_seed(0)

        def randn(*shape, generator=generator):
            return torch.randn(*shape, generator=generator).to(device)

        q = ref.l2_normalize(randn(tokens, heads, dim)) / dim**0.5
        k = ref.l2_normalize(randn(tokens, heads, dim))
        v = randn(tokens, heads, dim)
        g = ref.kda_gate(randn(tokens, heads, dim), randn(heads))
        beta = torch.sigmoid(randn(tokens, heads))
        state = randn(heads, dim, dim) / dim**0.5
        inputs = (q, k, v, g, beta)
        # at least: q, k, v, g in bf16, beta, the output, the state in and out
        moved = tokens * heads * (4 * dim * 2 + 4 + dim * 2) + 2 * heads * dim * dim * 4
        flops = tokens * heads * 4 * 2 * dim * dim
        shape = f"T={tokens} H={heads} K=V={dim}"
        ours = timed(
            lambda inputs=inputs, state=state: kda_chunked(
                *inputs,
                state,
                run_chunk_terms=kda_chunk_terms,
                run_state_pass=kda_state_pass,
            ),
            warmup=warmup,
            repeats=repeats,
            cuda=cuda,
        )
        row = {"kernel": "kda_prefill[triton]", "shape": shape}
        row.update(s=ours, bytes=moved, flops=flops)
        row["vllm_s"], row["vllm_note"] = vllm_chunk_kda(
            *inputs, state, warmup, repeats, cuda
        )
        row["baseline"] = "vLLM chunk_kda"
        yield row
        chunk = chunk_size_for(-5.0)
        # fp32 in: q, k, g, v, beta; out: four [T, H, K] terms, the [C, C] readout
        # per chunk (C per token) and the decay (K per chunk)
        terms_bytes = tokens * heads * 4 * (8 * dim + 1 + chunk + dim // chunk)
        yield (
            {
                "kernel": "kda_chunk_terms",
                "shape": shape,
                "s": timed(
                    lambda inputs=inputs, chunk=chunk: kda_chunk_terms(*inputs, chunk),
                    warmup=warmup,
                    repeats=repeats,
                    cuda=cuda,
                ),
                "bytes": terms_bytes,
                # (e^G k)(e^-G k)^T, the readout, and the two products with the inverse
                "flops": tokens * heads * 4 * 2 * chunk * dim,
                "vllm_s": timed(
                    lambda inputs=inputs, chunk=chunk: kda_chunk_terms_reference(
                        *inputs, chunk
                    ),
                    warmup=min(warmup, 1),
                    repeats=max(1, repeats // 10),
                    cuda=cuda,
                ),
                "vllm_note": None,
                "baseline": "batched PyTorch chunk_terms",
            }
        )
        # Both PyTorch forms eagerly, as wall time: thousands of small launches.
        chunked = wall_timed(
            lambda inputs=inputs, state=state: kda_chunked(*inputs, state),
            warmup=min(warmup, 1),
            repeats=max(1, repeats // 10),
            cuda=cuda,
        )
        per_token = wall_timed(
            lambda inputs=inputs, state=state: ref.kda_recurrence(*inputs, state),
            warmup=0,
            repeats=1,
            cuda=cuda,
        )
        yield (
            {
                "kernel": "kda_prefill[PyTorch chunked]",
                "shape": shape,
                "s": chunked,
                "bytes": moved,
                "flops": flops,
                "vllm_s": per_token,
                "vllm_note": None,
                "baseline": "our per-token PyTorch definition (both eager wall time)",
            }
        )


def bench_attn_res_mix(device, smoke, warmup, repeats):
    import torch

    from vllm_k3_plugin.reference.reference import attn_res_mix

    cuda = device.type == "cuda"
    for tokens, sources, hidden in mix_cases(smoke):
        bank = [
            torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            for _ in range(sources)
        ]
        norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        proj = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
        seconds = timed(
            lambda bank=bank, norm=norm, proj=proj: attn_res_mix(
                bank, norm, proj, 1e-5
            ),
            warmup=warmup,
            repeats=repeats,
            cuda=cuda,
        )
        yield (
            {
                "kernel": "attn_res_mix (PyTorch)",
                "shape": f"T={tokens} sources={sources} D={hidden}",
                "s": seconds,
                "bytes": (sources + 1) * tokens * hidden * 2,
                "flops": 4 * sources * tokens * hidden,
                "vllm_s": None,
                "vllm_note": "decision input: the one-pass bytes over PyTorch's time",
            }
        )


def bench_mla(device, smoke, warmup, repeats):
    import torch

    from k3_triton_kernels.mla import decode as k

    heads, dv, dpe, page = 16, 512, 64, 64
    # The FP8 cache (--kv-cache-dtype fp8), and on a GPU the bf16 one (the default
    # without it).
    caches = [k.FP8_DTYPES[0]] if smoke else [k.FP8_DTYPES[0], torch.bfloat16]
    for (batch, context, heads), cache_dtype in itertools.product(
        mla_cases(smoke), caches
    ):
        pages_per_seq = math.ceil(context / page)
        cache = torch.randn(batch * pages_per_seq, page, dv + dpe, device=device).to(
            cache_dtype
        )
        table = torch.arange(batch * pages_per_seq, device=device, dtype=torch.int32)
        table = table.view(batch, pages_per_seq)
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        # bf16 queries, as the model passes them (our bf16 tensor-core path). The
        # interpreter's bf16 tl.dot is wrong, so the smoke run uses fp32 queries,
        # for which both kernels' outputs can be checked against each other.
        q_dtype = torch.float32 if smoke else torch.bfloat16
        q = torch.randn(batch, 1, heads, dv + dpe, device=device, dtype=q_dtype)
        cuda = device.type == "cuda"

        baseline = vllm_mla(q, cache, table, lens, warmup, repeats, cuda)

        def run_ours(q=q, cache=cache, table=table, lens=lens, context=context):
            return k.mla_decode(q, cache, table, lens, max_seq_len=context)

        ours = timed(run_ours, warmup=warmup, repeats=repeats, cuda=cuda)
        moved = (
            batch * context * (dv + dpe) * cache.element_size()
            + q.numel() * q.element_size()
            + batch * heads * dv * 4
        )
        flops = 2 * batch * heads * context * ((dv + dpe) + dv)
        kernel = "mla_decode"
        if cache_dtype == torch.bfloat16:
            kernel += "[bf16 cache]"
        row = {
            "kernel": kernel,
            "shape": f"B={batch} ctx={context} H={heads}",
            "s": ours,
            "eager_s": wall_timed(run_ours, warmup=1, repeats=repeats, cuda=cuda),
            "bytes": moved,
            "flops": flops,
        }
        _side_by_side(row, baseline, run_ours()[0][:, 0])
        row["baseline"] = "vLLM decode_attention_fwd"
        yield row
        del cache


def _side_by_side(row, result, ours) -> None:
    """``row``'s vLLM time, and a note: how far the two outputs are apart (the
    baseline computes the same job), or why the baseline did not run."""
    seconds, theirs = result
    row["vllm_s"] = seconds
    if seconds is None:
        row["vllm_note"] = theirs
        return
    gap = (ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()
    row["vllm_gap"] = float(gap)
    row["vllm_note"] = f"outputs {float(gap):.1e} apart (of the largest)"


def bench_moe(device, smoke, warmup, repeats):
    """Ours on the checkpoint's MXFP4 experts beside vLLM's Triton MoE GEMMs on the
    same experts in FP8 (what vLLM runs for an FP8 checkpoint; it has no W4A8
    MXFP4 Triton MoE): the time ratio compares the two formats' GEMMs. The gap
    noted is vLLM's output from the PyTorch reference on its own FP8 weights."""
    import torch

    from k3_triton_kernels.moe import latent_moe as moe
    from k3_triton_kernels.moe.naive import mxfp4_experts_from

    for tokens, experts, top_k, latent, inner in moe_cases(smoke):
        torch.manual_seed(0)
        w13, w2 = expert_weights(experts, latent, inner, device)
        z, ids, weights = routed_tokens(tokens, experts, top_k, latent, device)
        cuda = device.type == "cuda"
        packed = mxfp4_experts_from(w13, w2)

        def run_ours(packed=packed, z=z, ids=ids, weights=weights):
            return moe.latent_moe(z, ids, weights, packed)

        seconds = timed(run_ours, warmup=warmup, repeats=repeats, cuda=cuda)
        used = len(ids.unique())
        # each used expert's packed weights and scales once; the fp32 latent read
        # and written
        per_weight = 0.5 + 1 / 32
        moved = used * 3 * inner * latent * per_weight + tokens * latent * (4 + 4)
        flops = 2 * tokens * top_k * (latent * 2 * inner + inner * latent)
        row = {
            "kernel": "latent_moe[mxfp4]",
            "shape": f"T={tokens} E={experts} k={top_k} L={latent} I={inner}",
            "s": seconds,
            "eager_s": wall_timed(run_ours, warmup=1, repeats=repeats, cuda=cuda),
            "bytes": moved,
            "flops": flops,
        }
        baseline, reference = vllm_moe(z, ids, weights, w13, w2, warmup, repeats, cuda)
        _side_by_side(row, baseline, reference)
        if "vllm_gap" in row:
            row["vllm_note"] = (
                f"vLLM {row['vllm_gap']:.1e} (of the largest) from the reference "
                "on its FP8 weights"
            )
        row["baseline"] = "vLLM fused_moe_kernel GEMMs alone, FP8 weights"
        yield row
        del w13, w2, packed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU interpreter"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device(
        "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    )
    name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else "CPU (Triton interpreter)"
    )
    peak = roofline(name)
    warmup, repeats = (0, 1) if args.smoke else (args.warmup, args.repeats)
    print(f"{name}\n")
    for block, line in AUTO_BASELINES.items():
        print(f"{block}: {line}")
    print()
    print(
        "| kernel | shape | µs | eager µs | TB/s | TFLOP/s | % HBM roofline "
        "| % FP8 roofline | vs the baseline |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    rows, failed = [], []
    sections = (bench_mla, bench_moe, bench_kda, bench_kda_prefill, bench_attn_res_mix)
    for section in sections:
        # Each row is printed and saved as it is measured; a section that fails is
        # reported, keeps the rows it made, and the others still run.
        try:
            for row in section(device, args.smoke, warmup, repeats):
                if UNCAPTURED:
                    row["uncaptured"] = "; ".join(sorted(set(UNCAPTURED)))
                    UNCAPTURED.clear()
                print(_table_line(row, peak), flush=True)
                rows.append(row)
                _save(args.json, name, rows, failed)
        except Exception as error:
            failed.append(f"{section.__name__}: {type(error).__name__}: {error}")
            print(f"| {section.__name__} failed: {failed[-1][:300]} |", flush=True)
            _save(args.json, name, rows, failed)
    return 1 if failed else 0


def _save(path, device_name, rows, failed) -> None:
    if path:
        with open(path, "w") as out:
            json.dump(
                {"device": device_name, "rows": rows, "failed": failed}, out, indent=2
            )


def _table_line(r: dict, peak) -> str:
    tbs = r["bytes"] / r["s"] / 1e12
    tflops = r["flops"] / r["s"] / 1e12
    bw = f"{100 * tbs * 1e12 / peak[0]:.0f}%" if peak else "-"
    fl = f"{100 * tflops * 1e12 / peak[1]:.1f}%" if peak else "-"
    versus = r["vllm_note"] or ""
    if r["vllm_s"]:
        ratio = f"{r['vllm_s'] / r['s']:.2f}x"
        against = r.get("baseline", "the baseline")
        versus = f"{ratio} ({against}'s time / ours)" + (
            f"; {versus}" if versus else ""
        )
    eager = f"{r['eager_s'] * 1e6:.1f}" if r.get("eager_s") else "-"
    if r.get("uncaptured"):
        versus += f"; some of this row timed uncaptured ({r['uncaptured']})"
    return (
        f"| {r['kernel']} | {r['shape']} | {r['s'] * 1e6:.1f} | {eager} | {tbs:.3f} "
        f"| {tflops:.2f} | {bw} | {fl} | {versus} |"
    )


if __name__ == "__main__":
    sys.exit(main())
