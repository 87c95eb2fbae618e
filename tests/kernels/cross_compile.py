"""Compile every kernel as its launcher launches it, for a real GPU target, on a
machine without a GPU.

The interpreter runs a kernel's Python, not its compilation: code Triton cannot
compile for a GPU (a constexpr branch the interpreter never enters, a cast the
backend refuses) passes every interpreter test. Here each launcher runs on CPU
tensors with its backend check bypassed, and at every launch the kernel is compiled
by ``triton.compile`` for the target (sm90: the H200 and H100; gfx942: MI300, FP8 as
e4m3fnuz; gfx950: MI355X) with the launch's argument types and constexprs, instead of
running. Nothing runs; what the launcher computes after a launch is garbage and
unread.

    python -m tests.kernels.cross_compile sm90   # one JSON line per launch

Each line also counts the launch's instructions (static: PTX for sm90, AMDGCN for
gfx9xx), and on sm90 the classes that show how tiles reach the dots, the
registers, shared memory and programs a multiprocessor, and the SASS of the
longest loop.

Run it without ``TRITON_INTERPRET`` (interpreted kernels do not compile).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGETS = {
    "sm90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}


class CompileInstead:
    """What ``kernel[grid]`` returns here: a call that compiles the kernel."""

    def __init__(self, kernel, case: str, target: GPUTarget, results: list) -> None:
        self.kernel, self.case, self.target, self.results = (
            kernel,
            case,
            target,
            results,
        )

    def compile(self, *args, **kwargs) -> None:
        # Bind and specialize the arguments as Triton's launcher does (an int
        # argument equal to 1 becomes a constant, pointers and ints get alignment
        # hints), so the variant compiled is the one a launch would build.
        backend = make_backend(self.target)
        binder = create_function_from_signature(
            self.kernel.signature, self.kernel.params, backend
        )
        bound, specialization, launch_options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self.kernel._pack_args(
            backend, kwargs, bound, specialization, launch_options
        )
        launch = f"{self.case}: {self.kernel.fn.__name__}"
        try:
            compiled = triton.compile(
                ASTSource(self.kernel, signature, constexprs, attrs),
                target=self.target,
                options=options.__dict__,
            )
            self.results.append(
                {
                    "launch": launch,
                    "error": None,
                    "spilled": spilled_bytes(compiled),
                    "instructions": instruction_counts(compiled),
                    **machine_code_counts(compiled),
                }
            )
        except Exception as error:
            cause = error.__cause__ or error
            message = f"{type(cause).__name__}: {cause}"[-2000:]
            self.results.append({"launch": launch, "error": message, "spilled": None})


# Instruction classes worth counting in a kernel's PTX: how tiles reach the dots.
PTX_CLASSES = {
    "shared byte loads": r"ld\.shared(?:\.v\d)?\.[bsu]8\b",
    "cp.async": r"cp\.async\.c[ag]\.shared\.global",
    "ldmatrix": r"ldmatrix\.",
    "mma": r"\b(?:mma|wgmma)\.",
}
# And in AMDGCN: matrix instructions, and those that take MX scales (gfx950).
AMDGCN_CLASSES = {
    "mfma": r"\bv_mfma_",
    "scaled mfma": r"\bv_mfma_scale_",
}


def instruction_counts(compiled) -> dict[str, int]:
    """The kernel's instructions (static, not executed): the total, and each of
    ``PTX_CLASSES`` (NVIDIA) or ``AMDGCN_CLASSES`` (AMD)."""
    if "ptx" in compiled.asm:
        text, comment = compiled.asm["ptx"], "//"
    else:
        text, comment = compiled.asm.get("amdgcn", ""), ";"
    lines = [line.strip() for line in text.splitlines()]
    body = [
        line
        for line in lines
        if line
        and not line.startswith((comment, ".", "$", "{", "}"))
        and not line.endswith(":")
    ]
    counts = {"total": len(body)}
    classes = PTX_CLASSES if "ptx" in compiled.asm else AMDGCN_CLASSES
    for name, pattern in classes.items():
        counts[name] = len(re.findall(pattern, text))
    return counts


def _cuobjdump(compiled, *flags: str) -> str:
    return _cuobjdump_cubin(compiled.asm["cubin"], *flags)


@functools.lru_cache(maxsize=8)
def _cuobjdump_cubin(cubin_bytes: bytes, *flags: str) -> str:
    """What the cuobjdump Triton ships prints for a cubin; cached, as both the spill
    and the register counts read its resource report."""
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(cubin_bytes)
        cubin.flush()
        return subprocess.run(
            [str(cuobjdump), *flags, cubin.name], capture_output=True, text=True
        ).stdout


def machine_code_counts(compiled) -> dict:
    """NVIDIA only (else nothing): the registers a thread, and the SASS of the
    kernel's longest loop (the widest backward branch): its instructions, and by
    opcode those ``SASS_CLASSES`` name. A loop's instructions bound how fast a
    tile can go when the issue slots, not memory, are the limit."""
    if "cubin" not in compiled.asm:
        return {}
    registers = re.search(r"REG:(\d+)", _cuobjdump(compiled, "--dump-resource-usage"))
    lines = re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(compiled, "-sass")
    )
    code = [(int(address, 16), text.strip()) for address, text in lines]
    back_edges = [
        (int(target.group(1), 16), address)
        for address, text in code
        if (target := re.search(r"\bBRA (0x[0-9a-f]+)", text))
        and int(target.group(1), 16) < address
    ]
    counts: dict = {"registers": int(registers.group(1)) if registers else None}
    counts["shared bytes"] = compiled.metadata.shared
    if registers:
        counts["programs a multiprocessor"] = sm90_programs_per_multiprocessor(
            counts["registers"], compiled.metadata.shared, compiled.metadata.num_warps
        )
    if back_edges:
        first, last = max(back_edges, key=lambda edge: edge[1] - edge[0])
        body = [text for address, text in code if first <= address <= last]
        opcodes = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in body]
        counts["loop"] = {"total": len(body)} | {
            name: sum(1 for op in opcodes if re.match(pattern, op))
            for name, pattern in SASS_CLASSES.items()
        }
    return counts


def sm90_programs_per_multiprocessor(registers: int, shared: int, warps: int) -> int:
    """How many programs of a kernel an H100/H200 multiprocessor holds at once: 64K
    registers (allocated a warp at a time, in steps of 8 a thread), 228 KiB of
    shared memory (1 KiB of it reserved a program), 64 warps."""
    by_registers = 65536 // (warps * 32 * (-(-registers // 8) * 8))
    by_shared = 228 * 1024 // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps)


# SASS opcodes worth counting in a loop: tensor-core ops, conversions, shared-memory
# traffic and spills.
SASS_CLASSES = {
    "mma": r"(?:HMMA|HGMMA|QGMMA|IMMA)\b",
    "fp8 conversions": r"F2FP\.F16\.E4M3",
    "shared byte loads": r"LDS\.[US]8\b",
    "ldmatrix": r"LDSM\b",
    "spill traffic": r"(?:LDL|STL)\b",
}


def spilled_bytes(compiled) -> int | None:
    """Bytes of registers spilled to memory per thread (NVIDIA: the cubin's stack
    frame, by the cuobjdump Triton ships; AMD: VGPR spills x 4), ``None`` if it
    cannot be read."""
    if "cubin" in compiled.asm:
        found = re.search(r"STACK:(\d+)", _cuobjdump(compiled, "--dump-resource-usage"))
        return int(found.group(1)) if found else None
    found = re.search(r"\.vgpr_spill_count:\s*(\d+)", compiled.asm.get("amdgcn", ""))
    return 4 * int(found.group(1)) if found else None


def _cases(fp8: torch.dtype):
    """(name, module, call) for every launcher, at K3's kernel configs."""
    from k3_triton_kernels.kda import chunk_state as kda_chunk_state
    from k3_triton_kernels.kda import chunk_terms as kda_chunk_terms
    from k3_triton_kernels.kda import decode as kda_decode
    from k3_triton_kernels.mla import decode as mla_decode
    from k3_triton_kernels.moe import latent_moe
    from k3_triton_kernels.moe.naive import mxfp4_experts_from
    from vllm_k3_plugin.reference import reference as ref
    from vllm_k3_plugin.reference.kda_chunk import chunk_terms

    def mla(q_dtype, cache_dtype, **options):
        def call():
            q = torch.randn(2, 2, 16, 576).to(q_dtype)
            # 64-token pages: the tile is the default 32 tokens, within a page.
            cache = torch.zeros(4, 64, 576).to(cache_dtype)
            table = torch.arange(4, dtype=torch.int32).view(2, 2)
            lens = torch.tensor([20, 100], dtype=torch.int32)
            mla_decode.mla_decode(
                q,
                cache,
                table,
                lens,
                max_seq_len=100,
                num_splits=2,
                **options,
            )

        return call

    def moe(tokens=3, latent=256, inner=128):
        def call():
            z = torch.randn(tokens, latent)
            w13 = torch.randn(8, 2 * inner, latent)
            w2 = torch.randn(8, latent, inner)
            experts = mxfp4_experts_from(w13, w2)
            weights, ids = ref.route(torch.randn(tokens, 8), torch.zeros(8), 2)
            latent_moe.latent_moe(z, ids, weights, experts, fp8_dtype=fp8)

        return call

    def grouping():
        latent_moe.group_by_expert(torch.randint(0, 8, (3, 2)), 8, 16)

    def kda_step():
        heads, dim, channels = 2, 128, 256
        kda_decode.kda_decode(
            torch.randn(3, 3 * channels),
            torch.randn(3 * channels, 4),
            torch.zeros(5, 3 * channels, 3, dtype=torch.bfloat16),
            torch.randn(3, channels),
            torch.randn(channels),
            torch.randn(heads),
            torch.rand(3, heads),
            torch.zeros(5, heads, dim, dim),
            torch.tensor([0, 2, 4]),
        )

    def prefill_inputs(chunk_dtype=torch.float32):
        q, k, v, g = (torch.randn(40, 2, 128) for _ in range(4))
        return (q.to(chunk_dtype), k.to(chunk_dtype), v, g, torch.rand(40, 2))

    def terms(chunk, dtype):
        return lambda: kda_chunk_terms.kda_chunk_terms(*prefill_inputs(dtype), chunk)

    def state_pass():
        kda_chunk_state.kda_state_pass(
            chunk_terms(*prefill_inputs(), 16), torch.zeros(2, 128, 128)
        )

    return [
        ("mla fp8 cache, bf16 q", mla_decode, mla(torch.bfloat16, fp8)),
        ("mla bf16 cache, bf16 q", mla_decode, mla(torch.bfloat16, torch.bfloat16)),
        ("mla fp8 cache, fp32 q", mla_decode, mla(torch.float32, fp8)),
        ("latent moe mxfp4", latent_moe, moe()),
        # From 256 tokens the MoE takes 64-row blocks and 64-wide K tiles.
        ("latent moe mxfp4, 300 tokens", latent_moe, moe(300)),
        # Past 1,024 pairs a launch of its own places them.
        ("latent moe mxfp4, 1100 tokens", latent_moe, moe(1100)),
        # K3's widths: its rows are quantized from one read (the whole row in
        # registers), a block of 4,096.
        ("latent moe mxfp4, K3 widths", latent_moe, moe(1, 3584, 3072)),
        # The grouping alone (no latent: the quantizing programs' code is left
        # out), as the sweeps and tests launch it.
        ("moe grouping", latent_moe, grouping),
        ("kda decode", kda_decode, kda_step),
        ("kda chunk terms", kda_chunk_terms, terms(16, torch.float32)),
        ("kda chunk terms bf16", kda_chunk_terms, terms(16, torch.bfloat16)),
        ("kda state pass", kda_chunk_state, state_pass),
    ]


def cross_compile(target_name: str) -> list[dict]:
    from triton.runtime.jit import JITFunction

    from k3_triton_kernels import runtime

    runtime.on_rocm = lambda: target_name.startswith("gfx")
    target = TARGETS[target_name]
    fp8 = torch.float8_e4m3fnuz if target_name == "gfx942" else torch.float8_e4m3fn
    results: list[dict] = []
    launch = JITFunction.__getitem__
    for case, module, call in _cases(fp8):
        saved = module.triton_blocker, module.log_path
        module.triton_blocker = lambda device: None
        module.log_path = lambda kernel, reason: None
        JITFunction.__getitem__ = lambda kernel, grid, case=case: (
            CompileInstead(kernel, case, target, results).compile
        )
        try:
            call()
        finally:
            JITFunction.__getitem__ = launch
            module.triton_blocker, module.log_path = saved
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(
            "cross_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)"
        )
    for result in cross_compile(sys.argv[1]):
        print(json.dumps(result))
