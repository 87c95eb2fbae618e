"""Kimi Delta Attention: the prefill chunk terms and state pass, the decode step,
and their PyTorch references (``naive``)."""
