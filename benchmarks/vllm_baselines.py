"""vLLM's own Triton kernels for the benchmark's side-by-side, run without importing
the ``vllm`` package.

The kernels the benchmark compares against (``decode_attention_fwd`` for MLA decode,
``fused_moe_kernel`` for the MoE GEMMs) are plain Triton; ``import vllm`` pulls in the
whole engine and its compiled extension, which a GPU machine with only PyTorch and
Triton does not have. So their source files are read from vLLM's package folder (an
installed vLLM, found without importing it, or a copy of its source tree named by
``VLLM_SRC``) and run in a namespace that provides the few vLLM names they use:
``current_platform`` (ROCm or CUDA, the device capability), ``triton`` / ``tl``,
``envs.VLLM_BATCH_INVARIANT`` (off) and ``next_power_of_2``. The kernels' code and
vLLM's default MoE tile configs are vLLM's, unchanged.

The MoE job around the two GEMMs is done here in PyTorch, as our kernel does it
(routing sort into vLLM's ``sorted_token_ids`` layout, per-token FP8 activations,
SiTU-GLU between the GEMMs, the weighted sum over the top-k): vLLM's versions of
those steps are C++ ops of its compiled extension. They are timed with the GEMMs.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
import types
from functools import cache
from pathlib import Path

import torch

DECODE_ATTENTION = "v1/attention/ops/triton_decode_attention.py"
FUSED_MOE = "model_executor/layers/fused_moe/fused_moe.py"
FUSED_MOE_UTILS = "model_executor/layers/fused_moe/utils.py"
TRITON_MLA = "v1/attention/backends/mla/triton_mla.py"
BREAKABLE_CUDAGRAPH = "compilation/breakable_cudagraph.py"
# vLLM's KDA ops (0.32 to 0.34): flash-linear-attention's port, and the in-tree
# K3's own chunk and recurrent kernels built on it, one copy per vendor.
FLA_OPS = "third_party/flash_linear_attention/ops"
K3_KDA_OPS = {
    "nvidia": "models/kimi_k3/nvidia/ops/third_party/kda",
    "amd": "models/kimi_k3/amd/ops/third_party/kda",
}
# vLLM 0.34's FLA ops launch some kernels through its JIT-warmup dispatcher
# (plain Python over Triton); 0.32 and 0.33 have neither file.
JIT_WARMUP = "model_executor/warmup/jit_warmup.py"
JIT_WARMUP_TRITON = "model_executor/warmup/jit_warmup_triton_helper.py"
SOURCE_FILES = (
    DECODE_ATTENTION,
    FUSED_MOE,
    FUSED_MOE_UTILS,
    TRITON_MLA,
    BREAKABLE_CUDAGRAPH,
)
OPTIONAL_SOURCE_FILES = (JIT_WARMUP, JIT_WARMUP_TRITON)
SOURCE_FOLDERS = (FLA_OPS, *K3_KDA_OPS.values())


class BaselineUnavailable(RuntimeError):
    pass


def vllm_source_root() -> Path:
    """``VLLM_SRC`` (a folder holding ``SOURCE_FILES`` under vLLM's layout), else the
    installed vLLM's package folder."""
    explicit = os.environ.get("VLLM_SRC")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise BaselineUnavailable("no vLLM installed and VLLM_SRC not set")
    return Path(next(iter(spec.submodule_search_locations)))


class _Platform:
    """The parts of ``vllm.platforms.current_platform`` these kernels read."""

    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def has_device_capability(self, capability: int) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= capability

    def is_arch_support_pdl(self) -> bool:
        # Programmatic dependent launch is an optional overlap; off is always valid.
        return False

    def is_device_capability(self, capability) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        if isinstance(capability, int):
            return major * 10 + minor == capability
        return (major, minor) == tuple(capability)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _namespace() -> dict:
    import triton
    import triton.language as tl

    return {
        "functools": functools,
        "torch": torch,
        "triton": triton,
        "tl": tl,
        "current_platform": _Platform(),
        "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "next_power_of_2": _next_power_of_2,
    }


def _read(relative: str) -> str:
    path = vllm_source_root() / relative
    if not path.is_file():
        raise BaselineUnavailable(f"{path} not found")
    return path.read_text()


@cache
def decode_attention_fwd():
    """vLLM's ``decode_attention_fwd``, its module loaded whole with the
    ``vllm.platforms`` and ``vllm.triton_utils`` it imports stood in for."""
    names = _namespace()
    path = vllm_source_root() / DECODE_ATTENTION
    source = _read(DECODE_ATTENTION)
    stand_ins = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.SimpleNamespace(
            current_platform=names["current_platform"]
        ),
        "vllm.triton_utils": types.SimpleNamespace(
            triton=names["triton"], tl=names["tl"]
        ),
    }
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        module = types.ModuleType("vllm_baseline_decode_attention")
        module.__file__ = str(path)
        # Triton reads a jitted function's source from its file: keep it reachable.
        sys.modules[module.__name__] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module.decode_attention_fwd


def _functions(relative: str, wanted: tuple[str, ...], namespace: dict) -> dict:
    """The top-level functions, classes and constants ``wanted`` of a vLLM file
    (decorators included), defined in ``namespace``."""
    source = _read(relative)
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found[node.name] = (first, "".join(lines[first - 1 : node.end_lineno]))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in wanted:
                text = "".join(lines[node.lineno - 1 : node.end_lineno])
                found[target.id] = (node.lineno, text)
    missing = set(wanted) - set(found)
    if missing:
        raise BaselineUnavailable(f"{relative}: no {sorted(missing)}")
    path = str(vllm_source_root() / relative)
    for name in wanted:
        # Keep each definition's line numbers, so Triton's source lookups line up.
        first, text = found[name]
        exec(compile("\n" * (first - 1) + text, path, "exec"), namespace)
    return namespace


@cache
def mla_num_kv_splits():
    """vLLM's Triton MLA backend's rule for the KV splits of a decode batch,
    ``(max_seq_len, sm_count) -> splits``."""
    namespace = _functions(
        TRITON_MLA,
        (
            "_MIN_WORK_PER_SPLIT",
            "_SPLIT_OCCUPANCY_MULTIPLIER",
            "_compute_num_kv_splits",
        ),
        _namespace(),
    )
    return namespace["_compute_num_kv_splits"]


def _device_properties(device, names, init_cuda=False):
    """vLLM's ``cuda_get_device_properties`` (0.34's FLA ops read the shared memory
    size with it) without its subprocess: a benchmark initializes CUDA anyway."""
    properties = torch.cuda.get_device_properties(device)
    return tuple(getattr(properties, name) for name in names)


@cache
def fused_moe_parts():
    """``(fused_moe_kernel, get_default_config, enable_swap_ab)`` from vLLM."""
    namespace = _namespace()
    module = types.ModuleType("vllm_baseline_fused_moe")
    module.__dict__.update(namespace)
    module.__file__ = str(vllm_source_root() / FUSED_MOE)
    sys.modules[module.__name__] = module
    _functions(
        FUSED_MOE,
        ("write_zeros_to_output", "fused_moe_kernel", "get_default_config"),
        module.__dict__,
    )
    _functions(FUSED_MOE_UTILS, ("enable_swap_ab",), module.__dict__)
    return module.fused_moe_kernel, module.get_default_config, module.enable_swap_ab


def _gemm(a, a_scale, w, w_scale, sorted_ids, block_expert, used, config, top_k,
          routing=None):  # fmt: skip
    """One of vLLM's MoE GEMMs, launched as ``invoke_fused_moe_triton_kernel`` does:
    ``[pairs, N]`` bf16 rows, one per routed (token, slot) pair. The gate/up GEMM
    reads token rows (``top_k`` pairs each); the down GEMM (``routing`` given) reads
    pair rows and scales each by its routing weight. FP8 weights with a scale per
    output channel, activations with a scale per row."""
    import triton.language as tl

    kernel, _, enable_swap_ab = fused_moe_parts()
    rows_per_a = 1 if routing is not None else top_k
    pairs = a.shape[0] * rows_per_a
    out = torch.empty(pairs, 1, w.shape[1], dtype=torch.bfloat16, device=a.device)
    rows = sorted_ids.shape[0]
    if a.shape[0] < config["BLOCK_SIZE_M"]:
        rows = min(rows, a.shape[0] * rows_per_a * config["BLOCK_SIZE_M"])
    config = dict(config)
    block_k = config.pop("BLOCK_SIZE_K")
    config.pop("SPLIT_K", None)
    grid = (
        -(-rows // config["BLOCK_SIZE_M"]) * -(-w.shape[1] // config["BLOCK_SIZE_N"]),
    )
    # By name: vLLM 0.34's kernel takes tensor descriptors among the pointers
    # (``b_desc``, ``a_desc``; none here, its pointer path), 0.32 and 0.33's not.
    descriptors = {
        name: None for name in ("b_desc", "a_desc") if name in kernel.arg_names
    }
    kernel[grid](
        a_ptr=a, b_ptr=w, c_ptr=out, b_bias_ptr=None, a_scale_ptr=a_scale,
        b_scale_ptr=w_scale, topk_weights_ptr=routing, sorted_token_ids_ptr=sorted_ids,
        expert_ids_ptr=block_expert, num_tokens_post_padded_ptr=used,
        N=w.shape[1], K=w.shape[2], EM=rows, num_valid_tokens=pairs,
        stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=w.stride(0), stride_bk=w.stride(2), stride_bn=w.stride(1),
        stride_cm=out.stride(0), stride_cn=out.stride(2),
        stride_asm=a_scale.stride(0), stride_ask=a_scale.stride(1),
        stride_bse=w_scale.stride(0), stride_bsk=w_scale.stride(2),
        stride_bsn=w_scale.stride(1), stride_bbe=0, stride_bbn=0,
        group_n=0,
        group_k=0,
        naive_block_assignment=False,
        BLOCK_SIZE_K=block_k,
        SPLIT_K=1,
        MUL_ROUTED_WEIGHT=routing is not None,
        top_k=rows_per_a,
        compute_type=tl.bfloat16,
        use_fp8_w8a8=True,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        per_channel_quant=True,
        HAS_BIAS=False,
        SWAP_AB=enable_swap_ab(config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]),
        USE_TD=False,
        **descriptors,
        **config,
    )  # fmt: skip
    return out[:, 0]


class VllmLatentMoe:
    """The latent MoE on vLLM's ``fused_moe_kernel`` GEMMs with vLLM's default tile
    config (one for both GEMMs, as vLLM's ``fused_experts`` takes it), on the fp32
    experts ``w13`` ``[E, 2I, L]`` and ``w2`` ``[E, L, I]`` quantized to FP8 with a
    scale per output channel (per-token activations): what vLLM's Triton MoE runs
    for an FP8 checkpoint.

    Built once on its inputs: ``output`` is the MoE's result ``[T, L]`` fp32,
    ``reference`` the same job in PyTorch on the same FP8 weights, and ``gemms()``
    runs the two GEMMs again on the inputs prepared here (the sort, the FP8
    activations, the SiTU between them), which is what the benchmark times: those
    steps are C++ ops in vLLM and PyTorch here, and would not be fair to count."""

    def __init__(self, z, ids, weights, w13, w2, *, beta=4.0, linear_beta=25.0):
        from k3_triton_kernels.moe.naive import (
            FP8,
            quantize_per_row,
            routed_experts_reference,
            situ_glu,
            sort_by_expert,
        )

        _, get_default_config, _ = fused_moe_parts()
        tokens, latent = z.shape
        top_k = ids.shape[1]
        num_experts, double_inner, _ = w13.shape
        config = get_default_config(
            tokens, num_experts, double_inner, latent, top_k, "fp8_w8a8", None
        )
        rows, block_expert, used = sort_by_expert(
            ids, num_experts, config["BLOCK_SIZE_M"]
        )
        routing = (
            torch.where(rows >= 0, rows, ids.numel()).to(torch.int32),
            block_expert.to(torch.int32),
            used.to(torch.int32),
        )
        w13_q, w13_scale = quantize_per_row(w13, FP8)
        w2_q, w2_scale = quantize_per_row(w2, FP8)

        def activations(x):
            values, scale = quantize_per_row(x, FP8)
            return values, scale[:, None]

        a, a_scale = activations(z)
        self._gate_up = (
            a, a_scale, w13_q, w13_scale[..., None], *routing, config, top_k,
        )  # fmt: skip
        gate_up = _gemm(*self._gate_up)
        inner = double_inner // 2
        h = situ_glu(
            gate_up[:, :inner].float(),
            gate_up[:, inner:].float(),
            beta=beta,
            linear_beta=linear_beta,
        )
        h_q, h_scale = activations(h)
        self._down = (
            h_q, h_scale, w2_q, w2_scale[..., None], *routing, config, top_k,
            weights.float().contiguous(),
        )  # fmt: skip
        down = _gemm(*self._down)
        self.output = down.float().view(tokens, top_k, latent).sum(dim=1)
        self.reference = routed_experts_reference(
            z, ids, weights,
            w13_q.float() * w13_scale[..., None], w2_q.float() * w2_scale[..., None],
            beta=beta, linear_beta=linear_beta,
        )  # fmt: skip

    def gemms(self) -> None:
        _gemm(*self._gate_up)
        _gemm(*self._down)


__all__ = [
    "SOURCE_FILES",
    "BaselineUnavailable",
    "VllmLatentMoe",
    "decode_attention_fwd",
    "fused_moe_parts",
    "mla_num_kv_splits",
    "vllm_source_root",
]


@cache
def breakable_capture():
    """``(BreakableCUDAGraphCapture, eager_break_during_capture)``: vLLM's stream
    capture with eager breaks and the decorator that makes a function a break, with
    the vLLM names they read stood in for: no forward context (so a decorated
    function breaks whenever a capture is on), breakable graphs enabled (0.32's
    decorator asks), ``weak_ref_tensor`` as the identity (vLLM's is a C op; a
    strong reference keeps the same tensor alive) and no quantized activations."""
    import threading
    from collections.abc import Callable, Hashable
    from typing import Any, TypeVar

    namespace = {
        "__name__": "vllm_baseline_breakable_cudagraph",
        "functools": functools,
        "threading": threading,
        "torch": torch,
        "Any": Any,
        "Callable": Callable,
        "Hashable": Hashable,
        "F": TypeVar("F", bound=Callable[..., Any]),
        "is_forward_context_available": lambda: False,
        "is_breakable_cudagraph_enabled": lambda: True,
        "weak_ref_tensor": lambda tensor: tensor,
        "QuantizedActivation": type("QuantizedActivation", (), {}),
    }
    _functions(
        BREAKABLE_CUDAGRAPH,
        (
            "_weak_ref_capture_arg",
            "eager_break_during_capture",
            "BreakableCUDAGraphCapture",
        ),
        namespace,
    )
    return namespace["BreakableCUDAGraphCapture"], namespace[
        "eager_break_during_capture"
    ]


@cache
def k3_kda_ops():
    """vLLM's in-tree K3 KDA ops package (``chunk_kda``,
    ``chunk_kda_with_fused_gate``, ``fused_recurrent_kda``; the ``amd`` copy on
    ROCm, else ``nvidia``), loaded from source with the flash-linear-attention
    modules it imports, under their own ``vllm.*`` names, the few other vLLM names
    they read stood in for (``vllm.triton_utils``, ``vllm.platforms``,
    ``vllm.utils.*``). Only where the real ``vllm`` is not importable: the stand-in
    modules stay installed for the kernels' lazy imports."""
    import contextlib
    import logging
    import math

    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    if importlib.util.find_spec("vllm") is not None and "VLLM_SRC" not in os.environ:
        raise BaselineUnavailable("a vLLM is installed: import its ops instead")
    root = vllm_source_root()
    flavor = "amd" if torch.version.hip is not None else "nvidia"
    folders = {"vllm.third_party.flash_linear_attention.ops": root / FLA_OPS}
    kda = f"vllm.models.kimi_k3.{flavor}.ops.third_party.kda"
    folders[kda] = root / K3_KDA_OPS[flavor]
    for folder in folders.values():
        if not folder.is_dir():
            raise BaselineUnavailable(f"{folder} not found")

    def module(name: str, **attrs) -> types.ModuleType:
        made = types.ModuleType(name)
        made.__dict__.update(attrs)
        return made

    warmup = root / JIT_WARMUP_TRITON
    if warmup.is_file():
        folders["vllm.model_executor.warmup"] = warmup.parent
    stand_ins = [
        module(
            "vllm.triton_utils",
            triton=triton,
            tl=tl,
            tldevice=tldevice,
            HAS_TRITON=True,
        ),
        # What 0.34's warmup dispatcher reads: warming up runs at engine start,
        # never here, so one thread.
        module("vllm.envs", VLLM_TRITON_JIT_WARMUP_NUM_THREADS=1),
        module("vllm.platforms", current_platform=_Platform()),
        module(
            "vllm.utils.math_utils",
            cdiv=lambda a, b: -(a // -b),
            next_power_of_2=_next_power_of_2,
            RCP_LN2=1 / math.log(2),
        ),
        module(
            "vllm.utils.platform_utils",
            cuda_get_device_properties=_device_properties,
        ),
        module(
            "vllm.utils.gpu_sync_debug",
            gpu_sync_allowed=lambda *a, **k: contextlib.nullcontext(),
        ),
        module(
            "vllm.utils.torch_utils",
            async_tensor_h2d=lambda data, dtype, device, pin_memory=False: torch.tensor(
                data, dtype=dtype, device=device
            ),
        ),
        module("vllm.logger", init_logger=logging.getLogger),
    ]
    for made in stand_ins:
        sys.modules.setdefault(made.__name__, made)
    # The packages above the source folders, empty: their real __init__ files
    # import the engine.
    for name, folder in folders.items():
        parts = name.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            sys.modules.setdefault(parent, module(parent, __path__=[]))
        package = module(name, __path__=[str(folder)])
        package.__file__ = str(folder / "__init__.py")
        sys.modules[name] = package
    ops = importlib.import_module(f"{kda}.chunk")
    recurrent = importlib.import_module(f"{kda}.fused_recurrent")
    return types.SimpleNamespace(
        source=f"{flavor} copy at {folders[kda]}",
        chunk_kda=ops.chunk_kda,
        chunk_kda_with_fused_gate=ops.chunk_kda_with_fused_gate,
        fused_recurrent_kda=recurrent.fused_recurrent_kda,
    )
