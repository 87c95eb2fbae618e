"""The GPU scripts' plumbing, each run whole on tiny shapes under the CPU
interpreter (``--smoke``): a device session has minutes, and a script that breaks
on the way spends them. Their figures come from a GPU run; here every variant,
configuration and baseline must run and be reported, none ``failed``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def run_smoke(script: str, *extra: str) -> str:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    failures = [line for line in run.stdout.splitlines() if "failed" in line]
    assert run.returncode == 0, run.stderr[-2000:]
    assert not failures, failures
    return run.stdout


def test_gpu_benchmark_script_runs_its_smoke_shapes(tmp_path):
    """``bench_kernels.py``, vLLM's baselines included: loaded from vLLM's source
    files without importing vLLM, they compute the same jobs as ours. MLA: fp32
    queries over the same cache, so the outputs agree to fp32 summation order
    (1e-4). MoE: both within e4m3 rounding of exact math (under 10% each), so
    within 20% of each other (vLLM's GEMMs write bf16 and quantize 1 x 128 groups
    for block weights)."""
    report = tmp_path / "smoke.json"
    out = run_smoke("bench_kernels.py", "--json", str(report))
    assert out.count("| mla_decode |") == 1
    assert out.count("| latent_moe[") == 3
    assert out.count("| kda_decode |") == 1
    assert out.count("| kda_prefill[") == 2
    assert out.count("| kda_chunk_terms |") == 1
    assert out.count("| attn_res_mix (PyTorch) |") == 1
    rows = {row["kernel"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows["mla_decode"]["vllm_gap"] <= 1e-4
    for fmt in ("fp8", "fp8-block"):
        assert rows[f"latent_moe[{fmt}]"]["vllm_gap"] <= 0.2


def timings(line: str) -> dict[str, float]:
    """A comparison line's timed cells, ``label 12.3us ...``, by label."""
    _, _, rest = line.partition(": ")
    return {
        label: float(us)
        for label, us in re.findall(r"(?:^|; )([\w -]+?) ([\d.]+)us", rest)
    }


def test_variant_comparison_runs_its_smoke_shapes():
    """``compare_variants.py``: every MoE and MLA variant timed, vLLM's kernels
    beside them, and each variant's output gap to the reference variant. Under the
    interpreter the sums are exact whatever the accumulation option, so an
    accumulation variant's gap must be exactly 0, and the MLA variants (the same
    math in another order or layout) within fp32 rounding, or bf16's where the
    split count changes."""
    out = run_smoke("compare_variants.py")
    lines = out.splitlines()
    moe = [timings(line) for line in lines if re.match(r"MoE T=\d+: ", line)]
    common = {"exact", "default", "rows-first", "never", "mxfp4", "vLLM GEMMs"}
    large = {"bm128 w8", "bm128 w8 never", "bk256"}
    assert [row.keys() for row in moe] == [common | {"s2"}, common | large]
    gaps = re.findall(r"(\S+) gap ([\d.e+-]+), gate/up ([\d.e+-]+)", out)
    assert len(gaps) == 4 + 6
    assert all(float(whole) == 0 and float(gemm) == 0 for _, whole, gemm in gaps)
    mla = [
        timings(line)
        for line in lines
        if re.match(r"MLA \w+ cache B=\d+ ctx=\d+: ", line)
    ]
    assert [row.keys() for row in mla] == [
        {"default", "w8", "prefetch", "prefetch w4", "vLLM"},
        {"default", "w8", "prefetch", "splits x2", "vLLM"},
    ]
    mla_gaps = re.findall(r"; ([\w -]+) gap ([\d.e+-]+)(?=;|$)", out, re.MULTILINE)
    assert len(mla_gaps) == 3 + 3
    # Another split count rounds the bf16 path's probabilities (bf16 for the
    # PV dot) at another running max: within bf16's 2^-8, not fp32 rounding.
    bounds = {"splits x2": 2**-8}
    assert all(float(gap) <= bounds.get(label, 1e-4) for label, gap in mla_gaps)
    assert out.count(", by kernel: ") == 2 * 2 + 2 * 2


def test_mla_sweep_runs_its_smoke_shape():
    """``sweep_mla.py``: all 12 configurations timed, then the split counts of the
    fastest."""
    out = run_smoke("sweep_mla.py")
    configs = re.findall(r"^bn\d+ stages\d warps\d [\w-]+: B=", out, re.MULTILINE)
    assert len(configs) == 3 * 2 * 2
    assert re.search(r"^fastest: bn\d+", out, re.MULTILINE)
    assert re.search(r"^B=2 ctx=100: default \d+ splits \d+us; fastest", out, re.M)


def test_moe_tile_sweep_runs_its_smoke_shapes():
    """``sweep_moe_tiles.py``: both formats at both token counts, with the launch
    before the GEMMs and vLLM's GEMMs beside FP8."""
    out = run_smoke("sweep_moe_tiles.py")
    for tokens in (1, 16):
        assert re.search(
            rf"^T={tokens} fp8 default=[\d.]+us best: \['[\d.]+ bm.*; "
            r"preparation [\d.]+us; vLLM GEMMs [\d.]+us$",
            out,
            re.MULTILINE,
        )
        assert re.search(rf"^T={tokens} mxfp4 default=[\d.]+us best: \[", out, re.M)
