"""The plugin's version, here only: the package metadata reads it (pyproject.toml's
dynamic version), and the registration line, the vLLM version check and the rank
check name it."""

__version__ = "0.1.0"
