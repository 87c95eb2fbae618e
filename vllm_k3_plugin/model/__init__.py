"""The Kimi-K3 model class for vLLM: one module per block (KDA, gated MLA, latent
MoE) and the model with attention residuals and the checkpoint loader."""
