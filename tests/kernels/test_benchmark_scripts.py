"""The GPU scripts' plumbing, each run whole on tiny shapes under the CPU
interpreter (``--smoke``): a device session has minutes, and a script that breaks
on the way spends them. Their figures come from a GPU run; here every variant,
configuration and baseline must run and be reported, none ``failed``."""

from __future__ import annotations

import json
import os
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
    (1e-4). MoE: vLLM's GEMMs on FP8 weights against the PyTorch reference on the
    same FP8 weights, within 2^-4 of the largest (vLLM's GEMMs write bf16, so its
    intermediate can requantize an e4m3 step apart)."""
    report = tmp_path / "smoke.json"
    out = run_smoke("bench_kernels.py", "--json", str(report))
    assert out.count("| mla_decode |") == 1
    assert out.count("| latent_moe[mxfp4] |") == 1
    assert out.count("| kda_decode |") == 1
    assert out.count("| kda_decode[vs vLLM] |") == 1
    assert out.count("| kda_prefill[") == 2
    assert out.count("| kda_chunk_terms |") == 1
    assert out.count("| attn_res_mix (PyTorch) |") == 1
    rows = {row["kernel"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows["mla_decode"]["vllm_gap"] <= 1e-4
    assert rows["latent_moe[mxfp4]"]["vllm_gap"] <= 2**-4


def test_vllms_k3_kda_ops_load_from_source_without_vllm():
    """``vllm_baselines.k3_kda_ops``: the in-tree K3's KDA ops and the
    flash-linear-attention modules they import, loaded from vLLM's source files
    (here the installed package's folder, as ``VLLM_SRC``) with the engine never
    imported, as on the GPU machine (which has no vLLM). Their kernels need a GPU:
    the interpreter cannot run flash-linear-attention's (docs/model_class.md)."""
    import importlib.util

    source = importlib.util.find_spec("vllm").submodule_search_locations[0]
    check = (
        "import sys; from vllm_baselines import k3_kda_ops; ops = k3_kda_ops(); "
        "assert not hasattr(sys.modules['vllm'], '__file__'), 'the engine loaded'; "
        "print(ops.source, ops.chunk_kda.__module__, "
        "ops.chunk_kda_with_fused_gate.__name__, ops.fused_recurrent_kda.__module__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS,
        env={**os.environ, "VLLM_SRC": source, "PYTHONPATH": str(BENCHMARKS)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [
        "nvidia",
        "copy",
        "at",
        f"{source}/models/kimi_k3/nvidia/ops/third_party/kda",
        "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk",
        "chunk_kda_with_fused_gate",
        "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent",
    ]


def test_kda_ops_check_runs_on_its_stand_ins(tmp_path):
    """``kda_ops_check.py``: both jobs against the references, on
    ``vllm_ops_naive`` in place of vLLM's ops (states ``[V, K]``, outputs in
    bf16); the verdict names that layout (a layout check that cannot tell the two
    apart would say nothing)."""
    out = run_smoke("kda_ops_check.py", "--out", str(tmp_path))
    assert "stand-ins in PyTorch" in out
    for job in ("prefill", "windows"):
        assert re.search(
            rf"^{job}: ok, output gap \d\.\de-0[2-9]; states as \[V, K\] 0\.0e\+00, "
            r"\[K, V\] [1-9]\.\de\+00: vLLM's layout is \[V, K\]$",
            out,
            re.MULTILINE,
        ), out
    # The model class's own calls, rows as vLLM stages them, against its PyTorch
    # path: bf16 q, k, v into the ops against fp32 ones (1e-3s), conv exact.
    assert re.search(
        r"^layer windows: ok, output gap \d\.\de-0[2-9]; states as \[V, K\] "
        r"\d\.\de-0[2-9], \[K, V\] [1-9]\.\de\+00: vLLM's layout is \[V, K\]; "
        r"conv gap 0\.0e\+00$",
        out,
        re.MULTILINE,
    ), out


def test_mla_sweep_runs_its_smoke_shape():
    """``sweep_mla.py``: all 6 configurations timed, then the split counts of the
    fastest."""
    out = run_smoke("sweep_mla.py")
    configs = re.findall(r"^bn\d+ stages\d warps\d: B=", out, re.MULTILINE)
    assert len(configs) == 3 * 2
    assert re.search(r"^fastest: bn\d+", out, re.MULTILINE)
    assert re.search(r"^B=2 ctx=100: default \d+ splits \d+us; fastest", out, re.M)


def test_moe_tile_sweep_runs_its_smoke_shapes():
    """``sweep_moe_tiles.py``: both token counts, with the launch before the
    GEMMs."""
    out = run_smoke("sweep_moe_tiles.py")
    for tokens in (1, 16):
        assert re.search(
            rf"^T={tokens} default=[\d.]+us best: \['[\d.]+ bm.*; "
            r"preparation [\d.]+us$",
            out,
            re.MULTILINE,
        )


def test_graph_check_runs_both_forms_on_its_smoke_shapes(tmp_path):
    """``graph_check.py``: vLLM's breakable capture loaded from its source, each
    decode step (single tokens and draft windows) built on the kernels and run in
    both forms against eager; the breakable one breaks at the KDA delta rule and
    the MLA decode only (3 segments, 2 breaks). Nothing is captured on the CPU."""
    out = run_smoke("graph_check.py", "--out", str(tmp_path))
    report = json.loads((tmp_path / "graph_check.json").read_text())
    forms = [(row["form"], row["drafts"]) for row in report["rows"]]
    assert forms == [("full", 0), ("breakable", 0), ("full", 2), ("breakable", 2)]
    assert all(row["ok"] and not row["replayed"] for row in report["rows"])
    for row in report["rows"]:
        if row["form"] == "breakable":
            assert (row["graphs"], row["breaks"]) == (3, 2)
    for kernel in ("KDA decode", "MLA decode", "Latent MoE"):
        assert f"{kernel}: Triton kernel" in report["paths"], out
