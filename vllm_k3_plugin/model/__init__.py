"""The Kimi-K3 text model: PyTorch reference blocks (``reference``), and, later, the
vLLM model class built from them."""
