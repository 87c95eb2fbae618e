"""Test-only: a node that builds another Kimi-K3 class than the head's.

vLLM's in-tree Kimi-K3 class is built for GPUs and does not start on the CPU (it
asks for the checkpoint's image processor, then its GPU kernels), so a node
"without the plugin" cannot be shown here with vLLM's own class: such a node fails
before it joins the server. This stands in for it: where ``OTHER_CLASS_ENV`` is
set, the process registers, for the K3 architecture, a class that builds what
ours builds but never announces itself to the other ranks (``model.one_class``),
as a class that is not the plugin's would not. Loaded as a vLLM general plugin
from ``collectives_plugin/``; nothing of the
plugin ships or imports this.
"""

from __future__ import annotations

import os

OTHER_CLASS_ENV = "K3_TEST_OTHER_CLASS"
PLUGIN_NAME = "k3_test_other_class"
OTHER_CLASS = "OtherK3Class"


def __getattr__(name: str):
    """``OtherK3Class``, built when vLLM resolves it (only where
    ``OTHER_CLASS_ENV`` is set): the model module is not imported otherwise."""
    if name != OTHER_CLASS:
        raise AttributeError(name)
    import torch.distributed as dist

    from vllm_k3_plugin.model import one_class
    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    class OtherK3Class(KimiK3ForConditionalGeneration):
        """Ours, less its entry in the world's store."""

        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            store = dist.distributed_c10d._get_default_store()
            store.delete_key(one_class.KEY.format(rank=dist.get_rank()))
            delattr(self, one_class._ENTRY)

    OtherK3Class.__qualname__ = OTHER_CLASS
    globals()[name] = OtherK3Class
    return OtherK3Class


def register() -> None:
    """Register ``OtherK3Class`` for the K3 architecture, now and again after the
    plugin registers its classes (vLLM loads this entry point before the
    plugin's: test folders precede site-packages on the path)."""
    if not os.environ.get(OTHER_CLASS_ENV):
        return
    from vllm import ModelRegistry

    from vllm_k3_plugin import registration
    from vllm_k3_plugin.reference.checkpoint_format import K3_WRAPPER

    def register_other() -> None:
        ModelRegistry.register_model(K3_WRAPPER[1], f"{__name__}:{OTHER_CLASS}")

    plugin_classes = registration._register_model_classes

    def then_the_other() -> None:
        plugin_classes()
        register_other()

    registration._register_model_classes = then_the_other
    register_other()
