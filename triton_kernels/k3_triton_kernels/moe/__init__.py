"""The latent fused MoE (FP8 activations, MXFP4 experts) and its PyTorch reference
(``naive``)."""
