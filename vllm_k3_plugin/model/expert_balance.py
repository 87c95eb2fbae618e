"""Expert-parallel load balancing (``--enable-eplb``): the model class as vLLM's
``MixtureOfExperts``.

vLLM's EPLB (``vllm.distributed.eplb``) counts the tokens each physical expert takes
through the MoE layers' routers, periodically computes a new placement, moves the
experts between the expert-parallel ranks in place (``expert_weights``: every MoE
layer's expert parameters, one row an expert) and updates the logical-to-physical
map the routers read. The layers are vLLM's ``FusedMoE`` runners
(``VLLM_K3_MOE=auto``), built with ``--eplb-config '{"num_redundant_experts": R}'``
spare physical experts; the loader fills each physical expert with the logical one
vLLM's initial placement gives it (``fused_moe.initial_slots``).

vLLM accepts ``--enable-eplb`` on CUDA, ROCm and XPU only (``config/parallel.py``),
with expert parallelism over more than one rank. The MTP draft layers are not
balanced: vLLM balances a drafter only if it is a ``MixtureOfExperts`` itself.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import MixtureOfExperts


def redundant_experts(vllm_config: VllmConfig) -> int | None:
    """``None`` without load balancing, else the spare physical experts a layer
    holds beside its logical ones."""
    parallel = vllm_config.parallel_config
    if not parallel.enable_eplb:
        return None
    return parallel.eplb_config.num_redundant_experts


class K3MixtureOfExperts(MixtureOfExperts):
    """``MixtureOfExperts``'s counts over this pipeline stage's latent-MoE runners
    (``_count_experts``); vLLM's ``set_eplb_state`` registers them."""

    def _count_experts(self, config, runners: list) -> None:
        self.moe_layers = runners
        self.expert_weights = []
        self.num_moe_layers = len(runners)
        self.num_expert_groups = 1
        self.num_logical_experts = config.num_experts
        self.num_routed_experts = config.num_experts
        self.num_shared_experts = config.num_shared_experts
        experts = runners[0].routed_experts if runners else None
        physical = config.num_experts if experts is None else experts.global_num_experts
        local = physical if experts is None else experts.local_num_experts
        self._set_physical_counts(physical, local)

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        """Elastic EP changed the physical expert count: vLLM has updated each
        layer's config; the counts and the layers' expert maps follow."""
        self._set_physical_counts(num_physical_experts, num_local_physical_experts)
        for runner in self.moe_layers:
            runner.update_expert_map()

    def _set_physical_counts(self, physical: int, local: int) -> None:
        self.num_physical_experts = physical
        self.num_local_physical_experts = local
        self.num_redundant_experts = physical - self.num_logical_experts


class FromLanguageModel:
    """A ``MixtureOfExperts`` attribute of a wrapper, read from and written to its
    ``language_model`` (one copy of each count)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        return getattr(wrapper.language_model, self.name)

    def __set__(self, wrapper, value) -> None:
        setattr(wrapper.language_model, self.name, value)
