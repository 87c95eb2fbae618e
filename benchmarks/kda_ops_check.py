"""What vLLM's in-tree K3 KDA ops compute, against the project's KDA reference, on a
GPU: whether ``VLLM_K3_KDA=auto`` (the GPU default) runs the class's KDA layers
right on them.

    benchmarks/gpu_check.sh kda                      # on the GPU, one TP8 rank
    python benchmarks/kda_ops_check.py --smoke       # on the CPU: the plumbing only

(``gpu_check.sh`` puts ``triton_kernels/`` on ``PYTHONPATH`` and points ``VLLM_SRC``
at the sources ``gpu_check.sh prepare`` copied.)

The ops are vLLM's (``vllm/models/kimi_k3/{nvidia,amd}/ops/third_party/kda``), from
an installed vLLM or loaded from its source files (``vllm_baselines.k3_kda_ops``:
none can be installed on the lent GPU machine). Two jobs, on K3's gate (lower bound
-5), q and k L2-normalized in the kernels, from raw gate and beta projections as
the in-tree layer hands them over:

- ``prefill``: ``chunk_kda_with_fused_gate`` over three sequences in one varlen
  batch (one new, two carrying a state), against ``kda_recurrence`` token by token.
- ``windows``: ``fused_recurrent_kda`` over speculative rows (vLLM's layout: a
  slot per window position, the state after window token ``t`` into slot
  ``s_t``, starting from ``s_{a-1}`` of ``a`` accepted tokens), against the same
  recurrence.
- ``layer windows``: the model class's own calls for ``VLLM_K3_KDA=auto``
  (``k3_triton_kernels.kda.vllm_ops_args``) against its PyTorch path, with the rows
  vLLM stages: short ones, one starting past its window, a padded one.

For each it reports the largest gap of the outputs and of the states written, with
vLLM's states read as ``[V, K]`` per head and as ``[K, V]`` (ours): the layout that
matches is the one the layer must keep. ``--smoke`` runs the references and the
plumbing on tiny shapes with ``k3_triton_kernels.kda.vllm_ops_naive`` (the ops'
contract in PyTorch, states ``[V, K]``, outputs in q's bf16) in their place: vLLM's
kernels need a GPU (the Triton interpreter cannot run flash-linear-attention's), and
the report says they did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

LOWER_BOUND = -5.0
TOLERANCE = 2e-2  # bf16 q/k/v in, fp32 state: vLLM's kernels keep bf16 products


def cases(smoke: bool) -> dict:
    if smoke:
        return {"heads": 2, "dim": 16, "lengths": [1, 5, 20], "drafts": 2}
    # One rank of 96 heads at TP8; a prompt crossing several 64-token chunks.
    return {"heads": 12, "dim": 128, "lengths": [1, 70, 300], "drafts": 3}


def inputs(tokens: int, heads: int, dim: int, device, generator):
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    return {
        "q": randn(tokens, heads, dim).to(torch.bfloat16),
        "k": randn(tokens, heads, dim).to(torch.bfloat16),
        "v": randn(tokens, heads, dim).to(torch.bfloat16),
        "raw_g": randn(tokens, heads, dim).to(torch.bfloat16),
        "raw_beta": randn(tokens, heads).to(torch.bfloat16),
        "a_log": randn(heads) * 0.5,
        "dt_bias": randn(heads * dim) * 0.5,
    }


def reference(x: dict, span: slice, state):
    """Our recurrence over tokens ``span`` from ``state`` ``[H, K, V]`` (or new)."""
    import torch

    from k3_triton_kernels.kda.naive import delta_rule_inputs, kda_recurrence

    tokens = x["q"][span].shape[0]
    mixed = torch.cat([x[n][span].reshape(tokens, -1) for n in "qkv"], dim=-1)
    q, k, v, g = delta_rule_inputs(
        mixed.float(), x["raw_g"][span].reshape(tokens, -1), x["dt_bias"],
        x["a_log"], LOWER_BOUND,
    )  # fmt: skip
    beta = torch.sigmoid(x["raw_beta"][span].float())
    return kda_recurrence(q, k, v, g, beta, state)


def _gap(got, want) -> float:
    scale = want.abs().max().clamp(min=1e-6)
    return float((got.float() - want.float()).abs().max() / scale)


def _layouts(got_states, want_states) -> dict:
    """Largest gaps of vLLM's states against ours read both ways."""
    pairs = list(zip(got_states, want_states, strict=True))
    return {
        "[V, K]": max(_gap(got.transpose(-1, -2), want) for got, want in pairs),
        "[K, V]": max(_gap(got, want) for got, want in pairs),
    }


def check_prefill(ops, shape: dict, device) -> dict:
    import torch

    heads, dim, lengths = shape["heads"], shape["dim"], shape["lengths"]
    generator = torch.Generator().manual_seed(0)
    x = inputs(sum(lengths), heads, dim, device, generator)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    ours = [None] + [
        torch.randn(heads, dim, dim, generator=generator).to(device) / dim**0.5
        for _ in lengths[1:]
    ]
    outputs, states = [], []
    for index, state in enumerate(ours):
        o, s = reference(x, slice(starts[index], starts[index + 1]), state)
        outputs.append(o)
        states.append(s)
    row = {"job": "prefill", "lengths": lengths, "heads": heads, "dim": dim}
    if ops is None:
        return row
    initial = torch.stack(
        [torch.zeros(heads, dim, dim, device=device) if s is None else s for s in ours]
    )
    # vLLM's layer hands over its cache's states; offered as [V, K] (the model
    # documentation's layout) — the other reading is reported too.
    o, final = ops.chunk_kda_with_fused_gate(
        q=x["q"][None], k=x["k"][None], v=x["v"][None], raw_g=x["raw_g"][None],
        raw_beta=x["raw_beta"][None], A_log=x["a_log"], g_bias=x["dt_bias"],
        lower_bound=LOWER_BOUND, initial_state=initial.transpose(-1, -2).contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
    )  # fmt: skip
    row["output_gap"] = _gap(o[0], torch.cat(outputs))
    row["state_gaps"] = _layouts(list(final), states)
    return row


def check_windows(ops, shape: dict, device) -> dict:
    """Rows of ``drafts + 1`` tokens, accepted counts 1 .. drafts + 1 last step."""
    import torch

    heads, dim, drafts = shape["heads"], shape["dim"], shape["drafts"]
    width = drafts + 1
    rows = width
    generator = torch.Generator().manual_seed(1)
    x = inputs(rows * width, heads, dim, device, generator)
    slots = torch.arange(1, 1 + rows * width, device=device).view(rows, width)
    cache = torch.randn(1 + rows * width, heads, dim, dim, generator=generator)
    cache = (cache / dim**0.5).to(device)  # ours, [K, V]
    accepted = torch.arange(1, rows + 1, device=device)
    outputs, states = [], []
    for r in range(rows):
        start = cache[slots[r, accepted[r] - 1]]
        span = slice(r * width, (r + 1) * width)
        q_row = {key: value for key, value in x.items()}
        o, _ = reference(q_row, span, start)
        outputs.append(o)
        s = start
        for t in range(width):
            _, s = reference(q_row, slice(r * width + t, r * width + t + 1), s)
            states.append(s)
    row = {"job": "windows", "rows": rows, "width": width, "heads": heads, "dim": dim}
    if ops is None:
        return row
    theirs = cache.transpose(-1, -2).contiguous()
    o, _ = ops.fused_recurrent_kda(
        q=x["q"][None], k=x["k"][None], v=x["v"][None], raw_g=x["raw_g"][None],
        raw_beta=x["raw_beta"][None], A_log=x["a_log"], dt_bias=x["dt_bias"],
        lower_bound=LOWER_BOUND, initial_state=theirs,
        cu_seqlens=torch.arange(0, rows * width + 1, width, dtype=torch.int32,
                                device=device),
        ssm_state_indices=slots.to(torch.int32),
        num_accepted_tokens=accepted.to(torch.int32),
    )  # fmt: skip
    row["output_gap"] = _gap(o[0], torch.cat(outputs))
    row["state_gaps"] = _layouts(list(theirs[slots.reshape(-1)]), states)
    return row


def check_layer_windows(ops, shape: dict, device) -> dict:
    """The model class's own calls (``VLLM_K3_KDA=auto``: ``window_conv``, then
    ``vllm_window_args`` into ``fused_recurrent_kda``, outputs placed back) against
    its PyTorch path (``kda_windows``) on the same caches, rows as vLLM stages them:
    a full window after one accepted token, one token after a full window accepted
    (the start past the window), two after two, and a padded row on the null
    block. States compared ``[V, K]`` against ours transposed."""
    import torch

    from k3_triton_kernels.kda.vllm_ops_args import vllm_window_args
    from k3_triton_kernels.kda.windows import kda_windows, place_outputs, window_conv

    heads, dim, drafts = shape["heads"], shape["dim"], shape["drafts"]
    width, conv, channels = drafts + 1, 4, heads * dim
    lengths, accepted = [width, 1, 2, 0], [1, width, 2, 1]
    rows = len(lengths)
    generator = torch.Generator().manual_seed(2)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(device)

    tokens_count = sum(lengths)
    qkv = randn(tokens_count, 3 * channels).to(torch.bfloat16)
    decay = randn(tokens_count, channels).to(torch.bfloat16)
    beta_logits = randn(tokens_count, heads).to(torch.bfloat16)
    conv_weight = randn(3 * channels, conv, scale=0.5).to(torch.bfloat16)
    a_log, dt_bias = randn(heads, scale=0.5), randn(channels, scale=0.5)
    slots = torch.arange(1, 1 + rows * width, device=device).view(rows, width)
    slots[lengths.index(0)] = 0  # the padded row: vLLM's null block
    cache_slots = 1 + rows * width
    conv_cache = randn(cache_slots, 3 * channels, conv - 1 + drafts).to(torch.bfloat16)
    ours = randn(cache_slots, heads, dim, dim, scale=dim**-0.5)
    offsets = torch.arange(width, device=device)
    starts = torch.tensor([0, *lengths], device=device).cumsum(0)
    tokens = (starts[:-1, None] + offsets).clamp(max=tokens_count - 1)
    valid = offsets < torch.tensor(lengths, device=device)[:, None]
    skip = torch.tensor(accepted, device=device) - 1
    windows = (tokens, valid, slots, skip)
    theirs = ours.transpose(-1, -2).contiguous()
    their_conv = conv_cache.clone()

    want = torch.zeros(tokens_count, heads, dim, device=device)
    kda_windows(qkv, conv_weight, conv_cache, decay, dt_bias, a_log,
                torch.sigmoid(beta_logits.float()), ours, *windows,
                lower_bound=LOWER_BOUND, out=want)  # fmt: skip
    row = {"job": "layer windows", "lengths": lengths, "accepted": accepted}
    if ops is None:
        return row
    got = torch.zeros_like(want)
    mixed = window_conv(qkv, conv_weight, their_conv, tokens, slots, skip)
    args, at = vllm_window_args(mixed, decay, beta_logits, *windows, heads)
    o, _ = ops.fused_recurrent_kda(
        **args, A_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND,
        initial_state=theirs,
    )  # fmt: skip
    place_outputs(got, o[0].float()[at], tokens, valid)
    real = slots[slots > 0]
    row["output_gap"] = _gap(got, want)
    row["state_gaps"] = _layouts(list(theirs[real]), list(ours[real]))
    row["conv_gap"] = _gap(their_conv.float(), conv_cache.float())
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/k3-kda-ops"))
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    from k3_triton_kernels.kda import vllm_ops_naive

    ops, failed = vllm_ops_naive, False
    note = "stand-ins in PyTorch (vLLM's KDA kernels need a GPU): not vLLM's"
    if device.type == "cuda":
        from vllm_kernel_runs import vllm_kda_op

        ops = None
        try:
            chunk, note = vllm_kda_op("chunk_kda_with_fused_gate")
            recurrent, _ = vllm_kda_op("fused_recurrent_kda")
            ops = SimpleNamespace(
                chunk_kda_with_fused_gate=chunk, fused_recurrent_kda=recurrent
            )
        except Exception as error:  # no baseline: say so, check the references
            note, failed = f"not loaded: {type(error).__name__}: {error}"[:300], True
    print(f"vLLM's ops: {note}", flush=True)
    shape = cases(args.smoke)
    rows = []
    with torch.no_grad():
        for check in (check_prefill, check_windows, check_layer_windows):
            try:
                row = check(ops, shape, device)
            except Exception as error:  # report it and go on
                row = {"job": check.__name__, "error": f"{type(error).__name__}: "
                       f"{error}"[:300]}  # fmt: skip
                failed = True
            rows.append(row)
            print(_line(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"ops": note, "tolerance": TOLERANCE, "rows": rows}
    (out / "kda_ops_check.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['job']}: failed: {row['error']}"
    if "output_gap" not in row:
        return f"{row['job']}: references built; vLLM's ops not run"
    layout = min(row["state_gaps"], key=row["state_gaps"].get)
    gaps = [row["output_gap"], row["state_gaps"][layout], row.get("conv_gap", 0.0)]
    verdict = "ok" if max(gaps) <= TOLERANCE else "differs"
    states = ", ".join(f"{k} {v:.1e}" for k, v in row["state_gaps"].items())
    conv = f"; conv gap {row['conv_gap']:.1e}" if "conv_gap" in row else ""
    return (
        f"{row['job']}: {verdict}, output gap {row['output_gap']:.1e}; "
        f"states as {states}: vLLM's layout is {layout}{conv}"
    )


if __name__ == "__main__":
    sys.exit(main())
