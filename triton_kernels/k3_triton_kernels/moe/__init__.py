"""The latent fused MoE (FP8 activations, FP8 or MXFP4 experts) and its expert
activation's reference (``naive``)."""
