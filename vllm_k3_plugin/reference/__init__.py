"""The Kimi-K3 text model in plain PyTorch: the reference blocks, the chunked KDA, the
checkpoint format, and the whole model (``torch_model``) that the vLLM model class is
checked against."""
