"""Gated MLA decode attention over the paged latent cache (``decode``) and its PyTorch
reference (``naive``)."""
