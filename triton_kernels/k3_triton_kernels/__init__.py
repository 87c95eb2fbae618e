"""Triton kernels for Kimi-K3, installed as ``k3_triton_kernels``; they import nothing
of the plugin.

- ``mla.decode``: gated MLA decode attention over the paged (FP8 or BF16) latent cache;
- ``moe.latent_moe``: the latent fused MoE, FP8 activations, MXFP4 experts;
- ``kda.chunk_terms``, ``kda.chunk_state``: the chunked KDA prefill; ``kda.decode``:
  one decode token per sequence;
- ``kda.naive``, ``mla.naive``, ``moe.naive``, ``mxfp4``: the PyTorch references
  beside them;
- ``runtime``: where a kernel applies, and the log of which path a process took.

Each launcher takes its Triton kernel where it applies and otherwise its PyTorch
reference; which one a process uses is logged once per kernel and reason
(``runtime.log_path``), under the ``vllm.k3_plugin.kernels`` logger. The folder this
package sits in is named ``triton_kernels`` (the project's layout); it is not the
package of that name vLLM imports (see its ``__init__.py``).
"""
