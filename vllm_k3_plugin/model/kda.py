"""Kimi Delta Attention as a vLLM mamba-style layer.

vLLM keeps each request's KDA state in its hybrid cache: a conv state (the last
``kernel - 1`` projected inputs of the q, k and v channels, packed in that order) and
the recurrent state ``[heads, K, V]`` in fp32. The GDN metadata backend tells the layer,
per scheduled sequence, which tokens are its own, which cache slot holds its state and
whether that state is already initialized (a continued prefill or a decode) or not (a
new request). This layer reads and writes those slots. Prefill chunks run one
sequence at a time, in windows of bounded memory: the reference conv and gate in
PyTorch, and the delta rule in its chunked form (``reference.kda_chunk``).
With ``VLLM_K3_KDA=triton`` the chunk terms run
``k3_triton_kernels.kda.chunk_terms``, the chunks' state pass
``k3_triton_kernels.kda.chunk_state``, and the batch's decode tokens (one new token of
an initialized sequence) ``k3_triton_kernels.kda.decode`` in one launch; with
``VLLM_K3_KDA=auto`` the delta rule runs vLLM's in-tree K3 KDA ops (CUDA and ROCm;
``_sequences_on_vllm``, ``_windows_on_vllm``); else all three stay in PyTorch.

With speculative decoding every decode is a speculative row: it verifies its window
from the state its last step accepted and keeps the state after each window token
(``KdaAttention._windows``, PyTorch, with or without the kernels). Decode-only steps
(windows, and single tokens) read nothing back from the device, so a full CUDA
graph holds them; steps with prefills read the batch's layout once on the host.

Heads shard over tensor parallelism; every rank keeps the state of its own heads.

Where the states live and how a step's batch lays them out (state shapes, slots,
windows) is ``kda_cache.py``.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from k3_triton_kernels.kda.chunk_state import kda_state_pass
from k3_triton_kernels.kda.chunk_terms import kda_chunk_terms
from k3_triton_kernels.kda.decode import kda_decode
from k3_triton_kernels.kda.naive import delta_rule_inputs
from k3_triton_kernels.kda.vllm_ops_args import vllm_chunk_args, vllm_window_args
from k3_triton_kernels.kda.windows import kda_windows, place_outputs, window_conv
from k3_triton_kernels.runtime import CHUNKED_KDA_MAX_CHUNK, log_path
from vllm_k3_plugin.model.kda_cache import (
    Windows,
    decode_windows,
    host_batch,
    kda_state_dtypes,
    kda_state_shapes,
    speculative_windows,
)
from vllm_k3_plugin.model.kernel_choice import kda_backend, kda_setting
from vllm_k3_plugin.model.logs import say_once
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import gate_lower_bound
from vllm_k3_plugin.reference.kda_chunk import (
    chunk_size_for,
    chunk_terms,
    kda_chunked,
    state_pass,
    window_tokens_for,
)

# vLLM's in-tree K3 KDA ops (0.32 to 0.34), one copy per vendor; vLLM also ships
# flash-linear-attention's port (``vllm/third_party/flash_linear_attention/ops/kda.py``)
# whose ops take beta after its sigmoid.
VLLM_KDA_OPS = {
    "nvidia": "vllm.models.kimi_k3.nvidia.ops.third_party.kda",
    "amd": "vllm.models.kimi_k3.amd.ops.third_party.kda",
}


def resolve_vllm_kda_ops(prefix: str):
    """The installed vLLM's KDA ops for this platform (``VLLM_K3_KDA=auto``), or
    ``None`` where this vLLM has none (the layer then runs the project's kernels
    and says so). Refused on the CPU, naming the setting and the platform."""
    if not current_platform.is_cuda_alike():
        raise ValueError(
            f"{prefix}: VLLM_K3_KDA=auto runs vLLM's KDA ops, Triton kernels for "
            f"CUDA and ROCm, not this platform ({current_platform.device_type}); "
            "choose torch or triton"
        )
    flavor = "amd" if current_platform.is_rocm() else "nvidia"
    try:
        return importlib.import_module(VLLM_KDA_OPS[flavor])
    except ImportError:
        return None


class KdaAttention(nn.Module, MambaBase):
    """``self_attn`` of a KDA layer: checkpoint names ``q_proj k_proj v_proj g_proj
    b_proj f_a_proj f_b_proj q_conv1d k_conv1d v_conv1d A_log dt_bias o_norm
    o_proj``."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        kda = config.linear_attn_config
        hidden = config.hidden_size
        self.linear_attn_config = kda
        self.prefix = prefix
        self.vllm_config = vllm_config
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_heads, self.head_dim = kda["num_heads"], kda["head_dim"]
        if self.num_heads % self.tp_size:
            raise ValueError(
                f"{prefix}: {self.num_heads} KDA heads do not split over "
                f"tensor parallel size {self.tp_size}"
            )
        self.local_heads = self.num_heads // self.tp_size
        self.lower_bound = gate_lower_bound(kda, prefix)
        self.kernel = kda["short_conv_kernel_size"]
        self.num_spec = vllm_config.num_speculative_tokens
        # The decode kernel reads a conv state of ``kernel - 1`` inputs; with draft
        # tokens it is wider, and every decode is a speculative row (``_windows``).
        backend = kda_backend()
        # vLLM's ops keep each state [V, K] (value channel first), ours [K, V]:
        # every step of a layer runs on one of the two.
        self.vllm_ops = resolve_vllm_kda_ops(prefix) if backend == "auto" else None
        if backend == "auto":
            say_once(
                f"Kimi-K3 KDA delta rule ({kda_setting()}): "
                + (
                    f"vLLM's ops {self.vllm_ops.__name__}"
                    if self.vllm_ops
                    else "this vLLM has no KDA ops for K3; the project's kernels"
                )
            )
        self.use_kernels = backend != "torch" and self.vllm_ops is None
        if self.use_kernels and self.num_spec:
            log_path("KDA speculative verification", "PyTorch only")
        if backend == "torch":
            setting = kda_setting()
            log_path("KDA prefill chunk terms", setting)
            log_path("KDA prefill state pass", setting)
            log_path("KDA decode", setting)
        self.chunk = chunk_size_for(self.lower_bound)
        if self.use_kernels:
            self.chunk = min(self.chunk, CHUNKED_KDA_MAX_CHUNK)
        # A prefill is taken a window at a time: its fp32 intermediates grow with
        # the window, and vLLM's memory profile does not run this path.
        self.prefill_window = window_tokens_for(
            self.local_heads, self.head_dim, self.head_dim, self.chunk
        )
        self.run_chunk_terms = kda_chunk_terms if self.use_kernels else chunk_terms
        self.run_state_pass = kda_state_pass if self.use_kernels else state_pass
        width = self.num_heads * self.head_dim
        self.local_width = width // self.tp_size

        def column(name: str, inputs: int, outputs: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                inputs, outputs, bias=False, prefix=f"{prefix}.{name}"
            )

        self.q_proj = column("q_proj", hidden, width)
        self.k_proj = column("k_proj", hidden, width)
        self.v_proj = column("v_proj", hidden, width)
        self.g_proj = column("g_proj", hidden, width)
        self.b_proj = column("b_proj", hidden, self.num_heads)
        self.f_a_proj = ReplicatedLinear(
            hidden, self.head_dim, bias=False, prefix=f"{prefix}.f_a_proj"
        )
        self.f_b_proj = column("f_b_proj", self.head_dim, width)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = nn.Module()
            conv.weight = nn.Parameter(
                torch.empty(self.local_width, 1, self.kernel), requires_grad=False
            )
            set_weight_attrs(conv.weight, {"weight_loader": sharded_weight_loader(0)})
            setattr(self, name, conv)
        # ``_conv_weight``'s join of the three, with the weights' versions it is of.
        self._conv_weight_cache: tuple[tuple, torch.Tensor] | None = None
        self.A_log = nn.Parameter(
            torch.empty(self.local_heads, dtype=torch.float32), requires_grad=False
        )
        set_weight_attrs(self.A_log, {"weight_loader": sharded_weight_loader(0)})
        self.dt_bias = nn.Parameter(
            torch.empty(self.local_width, dtype=torch.float32), requires_grad=False
        )
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        self.o_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = RowParallelLinear(
            width, hidden, bias=False, prefix=f"{prefix}.o_proj"
        )

        # The delta rule of a step with prefills reads the batch's layout on the
        # host (``host_batch``): where vLLM's breakable CUDA graphs break, running
        # it eagerly into the captured ``out`` on replay. In a FULL capture (vLLM
        # captures uniform decode batches only) the decorator runs it in place, and
        # a decode-only step reads nothing back (``_decode_only``, ``_windows``).
        # vLLM 0.32 decides from VLLM_USE_BREAKABLE_CUDAGRAPH, set while it builds
        # its config: read when the model is built, not when this module is
        # imported.
        self._recurrence = eager_break_during_capture(self._recur)
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    # -- vLLM's hybrid cache ----------------------------------------------------------

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return kda_state_shapes(self.linear_attn_config, self.tp_size, self.num_spec)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtypes(self.vllm_config)

    # -- compute ----------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states)[0]
        k = self.k_proj(hidden_states)[0]
        v = self.v_proj(hidden_states)[0]
        decay = self.f_b_proj(self.f_a_proj(hidden_states)[0])[0]
        beta_logits = self.b_proj(hidden_states)[0]
        core = torch.zeros(
            tokens,
            self.local_heads,
            self.head_dim,
            dtype=torch.float32,
            device=hidden_states.device,
        )
        self._recurrence(torch.cat([q, k, v], dim=-1), decay, beta_logits, core)
        gate = torch.sigmoid(self.g_proj(hidden_states)[0].float())
        normed = ref.rms_norm(core, self.o_norm.weight, self.o_norm.variance_epsilon)
        out = normed * gate.reshape(tokens, self.local_heads, self.head_dim)
        return self.o_proj(out.reshape(tokens, -1).to(hidden_states.dtype))[0]

    def _recur(
        self,
        qkv: torch.Tensor,
        decay: torch.Tensor,
        beta_logits: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Fill ``out`` with the delta-rule outputs, sequence by sequence, carrying each
        sequence's state through its cache slot."""
        attn_metadata = get_forward_context().attn_metadata
        metadata = (
            attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        )
        if metadata is None:
            # vLLM's profiling and warm-up runs carry no state; their output is unused.
            return
        conv_weight = self._conv_weight()
        # vLLM's ops take beta before its sigmoid, as the projection gives it.
        beta = beta_logits if self.vllm_ops else torch.sigmoid(beta_logits.float())
        if metadata.spec_sequence_masks is not None:
            windows = speculative_windows(metadata, qkv.shape[0], self.num_spec + 1)
            self._windows(qkv, conv_weight, decay, beta, out, windows)
            rest = metadata.non_spec_token_indx
            if rest is None or rest.numel() == 0:
                return
            # The other rows' tokens, gathered in their order, and back.
            rest = rest.long()
            gathered = out.new_zeros(rest.shape[0], *out.shape[1:])
            self._sequences(
                qkv[rest], conv_weight, decay[rest], beta[rest], gathered, metadata
            )
            out[rest] = gathered
            return
        if metadata.num_prefills == 0:
            self._decode_only(qkv, conv_weight, decay, beta, out, metadata)
            return
        self._sequences(qkv, conv_weight, decay, beta, out, metadata)

    def _sequences(self, qkv, conv_weight, decay, beta, out, metadata) -> None:
        """The batch's prefills (and, without draft tokens, decodes), one sequence at
        a time; with the kernels, the decodes in one launch."""
        if self.vllm_ops:
            self._sequences_on_vllm(qkv, conv_weight, decay, beta, out, metadata)
            return
        conv_cache, recurrent_cache = self._caches()
        history = self.kernel - 1
        starts, slots, initialized = host_batch(metadata)
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        for index in range(len(starts) - 1):
            begin, end = starts[index], starts[index + 1]
            if begin == end:
                continue
            slot = slots[index]
            had_state = initialized[index]
            if (
                self.use_kernels
                and not self.num_spec
                and had_state
                and end - begin == 1
            ):
                decode_rows.append(begin)
                decode_slots.append(slot)
                continue
            conv_state = conv_cache[slot, :, :history].float() if had_state else None
            state = recurrent_cache[slot] if had_state else None
            for lo in range(begin, end, self.prefill_window):
                hi = min(lo + self.prefill_window, end)
                out[lo:hi], conv_state, state = self._prefill(
                    qkv[lo:hi],
                    decay[lo:hi],
                    beta[lo:hi],
                    conv_weight,
                    conv_state,
                    state,
                )
            # A speculative step after this one reads its history from the start.
            conv_cache[slot, :, :history] = conv_state.to(conv_cache.dtype)
            recurrent_cache[slot] = state.to(recurrent_cache.dtype)
        if decode_rows:
            rows = torch.tensor(decode_rows, device=qkv.device)
            out[rows] = self._decode(
                qkv[rows],
                conv_weight,
                decay[rows],
                beta[rows],
                torch.tensor(decode_slots, device=qkv.device),
            )

    def _windows(self, qkv, conv_weight, decay, beta, out, windows: Windows) -> None:
        """Rows of windows (a speculative row verifies the last sampled token and
        its drafts; a decode is a window of one token) from the state each row's
        last step accepted, keeping the state after every window token in vLLM's
        layout (``k3_triton_kernels.kda.windows``). Shapes are fixed by the windows
        and nothing is read back."""
        if not windows.tokens.shape[0]:
            return
        if self.vllm_ops:
            self._windows_on_vllm(qkv, conv_weight, decay, beta, out, windows)
            return
        kda_windows(
            *self._step_args(qkv, conv_weight, decay, beta),
            *windows,
            lower_bound=self.lower_bound,
            out=out,
        )

    # -- on vLLM's ops (VLLM_K3_KDA=auto) ---------------------------------------------

    def _sequences_on_vllm(self, qkv, conv_weight, decay, beta, out, metadata):
        """The batch's sequences (prefills, and decodes among them) in one varlen
        call of vLLM's ``chunk_kda_with_fused_gate``: the conv here, a sequence at
        a time, each from its cached history; the states in and out in vLLM's
        layout."""
        conv_cache, recurrent_cache = self._caches()
        history = self.kernel - 1
        starts, slots, initialized = host_batch(metadata)
        mixed = torch.empty(qkv.shape, dtype=torch.float32, device=qkv.device)
        bounds, used, initial = [starts[0]], [], []
        for index in range(len(starts) - 1):
            begin, end, slot = starts[index], starts[index + 1], slots[index]
            if begin == end:
                continue
            had_state = initialized[index]
            conv_state = conv_cache[slot, :, :history].float() if had_state else None
            mixed[begin:end], conv_state = ref.causal_conv_silu(
                qkv[begin:end].float(), conv_weight.float(), conv_state
            )
            conv_cache[slot, :, :history] = conv_state.to(conv_cache.dtype)
            state = recurrent_cache[slot].float()
            initial.append(state if had_state else torch.zeros_like(state))
            bounds.append(end)
            used.append(slot)
        if not used:
            return
        span = slice(bounds[0], bounds[-1])
        starts = torch.tensor(bounds, dtype=torch.int32, device=qkv.device)
        args = vllm_chunk_args(mixed[span], decay[span], beta[span], self.local_heads)
        o, final = self.vllm_ops.chunk_kda_with_fused_gate(
            **args, A_log=self.A_log, g_bias=self.dt_bias,
            lower_bound=self.lower_bound, initial_state=torch.stack(initial),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=starts - bounds[0],
        )  # fmt: skip
        out[span] = o[0].float()
        slots_used = torch.tensor(used, device=qkv.device)
        recurrent_cache[slots_used] = final.to(recurrent_cache.dtype)

    def _windows_on_vllm(self, qkv, conv_weight, decay, beta, out, windows):
        """Windows through vLLM's ``fused_recurrent_kda`` in vLLM's speculative
        layout (a slot per window position, the start at ``skip``), the conv here
        from device tensors: fixed shapes, nothing read back."""
        conv_cache, recurrent_cache = self._caches()
        tokens, valid, slots, skip = windows
        mixed = window_conv(qkv, conv_weight[:, 0, :], conv_cache, tokens, slots, skip)
        args, at = vllm_window_args(mixed, decay, beta, *windows, self.local_heads)
        o, _ = self.vllm_ops.fused_recurrent_kda(
            **args, A_log=self.A_log, dt_bias=self.dt_bias,
            lower_bound=self.lower_bound, initial_state=recurrent_cache,
        )  # fmt: skip
        place_outputs(out, o[0].float()[at], tokens, valid)

    def _conv_weight(self) -> torch.Tensor:
        """The q, k and v conv weights as one ``[3 * width, 1, kernel]`` tensor, made
        once and again only after a weight changes (loading writes in place)."""
        parts = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        key = tuple((part.data_ptr(), part._version) for part in parts)
        cached = self._conv_weight_cache
        if cached is None or cached[0] != key:
            cached = (key, torch.cat(parts))
            self._conv_weight_cache = cached
        return cached[1]

    def _prefill(self, qkv, decay, beta, conv_weight, conv_state, state):
        """A window of one sequence's prefill: ``(o, conv state, state)`` after it,
        from those before it (``None``: a new sequence)."""
        mixed, conv_state = ref.causal_conv_silu(
            qkv.float(), conv_weight.float(), conv_state
        )
        q, k, v, g = delta_rule_inputs(
            mixed, decay, self.dt_bias, self.A_log, self.lower_bound
        )
        o, state = kda_chunked(
            q,
            k,
            v,
            g,
            beta,
            state,
            lower_bound=self.lower_bound,
            chunk=self.chunk,
            run_chunk_terms=self.run_chunk_terms,
            run_state_pass=self.run_state_pass,
        )
        return o, conv_state, state

    def _decode_only(self, qkv, conv_weight, decay, beta, out, metadata) -> None:
        """A batch of decodes only (vLLM classes a request's first chunk as a
        prefill, so each token is the next one of a sequence with state), token
        ``i`` in state slot ``i``, on the kernel (one launch) or as windows of one
        token. Nothing is read back from the device: the step does not sync, and a
        CUDA graph can hold it (padded rows point at vLLM's null block)."""
        if not self.use_kernels or self.num_spec:
            # The kernel reads a conv buffer of ``kernel - 1`` inputs only; vLLM's
            # ops take every decode as a window of one token.
            windows = decode_windows(metadata, qkv.shape[0])
            self._windows(qkv, conv_weight, decay, beta, out, windows)
            return
        slots = metadata.non_spec_state_indices_tensor
        rows = min(qkv.shape[0], slots.shape[0])
        if rows:
            out[:rows] = self._decode(
                qkv[:rows], conv_weight, decay[:rows], beta[:rows], slots[:rows]
            )

    def _caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state ``[slot, channels, kernel - 1]``, recurrent state)."""
        conv_cache, recurrent_cache = self.kv_cache
        if not is_conv_state_dim_first():
            conv_cache = conv_cache.transpose(-1, -2)
        return conv_cache, recurrent_cache

    def _step_args(self, qkv, conv_weight, decay, beta) -> tuple:
        """The leading arguments of ``kda_decode`` and ``kda_windows``: the inputs,
        the layer's weights and its caches."""
        conv_cache, recurrent_cache = self._caches()
        return (qkv, conv_weight[:, 0, :], conv_cache, decay, self.dt_bias,
                self.A_log, beta, recurrent_cache)  # fmt: skip

    def _decode(self, qkv, conv_weight, decay, beta, slots) -> torch.Tensor:
        return kda_decode(
            *self._step_args(qkv, conv_weight, decay, beta),
            slots,
            lower_bound=self.lower_bound,
        )
