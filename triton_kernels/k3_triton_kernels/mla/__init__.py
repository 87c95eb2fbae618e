"""Gated MLA decode attention over the paged latent cache (its PyTorch reference
beside the kernel, in ``decode``)."""
