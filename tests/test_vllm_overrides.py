"""Every plugin class that extends a vLLM class still fits the installed vLLM, and so
does every test-support class the test servers load into vLLM (the forcing logits
processor, the stand-in executor).

vLLM calls our overrides with its own signatures, and those drift between releases
(0.33's ``MLAAttention.update_kv_cache`` passes ``do_kv_cache_update`` a seventh
argument that 0.32 never did). For each override this checks, against the vLLM
installed, that any call the base signature allows binds to ours: every positional
parameter at its position, every keyword, every default the caller may leave out.
It runs in each test environment, so each supported vLLM is audited.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import vllm_k3_plugin
from tests import support


def _plugin_classes() -> list[type]:
    """Every class of the package with a vLLM class among its bases, found by
    importing each module, and the GPU MLA backend's classes, which are built on
    first use."""
    from vllm_k3_plugin.model.mla_backend import gpu_mla_backend

    classes = {}
    modules = [
        module.name
        for package in (vllm_k3_plugin, support)
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        if not module.name.endswith(".__main__")  # runs the command line
    ]
    for name in modules:
        for value in vars(importlib.import_module(name)).values():
            if (
                isinstance(value, type)
                and value.__module__.startswith(("vllm_k3_plugin", "tests.support"))
                and any(_from_vllm(base) for base in value.__mro__[1:])
            ):
                classes[value.__qualname__] = value
    backend = gpu_mla_backend()
    for cls in (backend, backend.get_impl_cls()):
        classes[cls.__qualname__] = cls
    return sorted(classes.values(), key=lambda cls: cls.__qualname__)


def _from_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


def _overrides(cls: type):
    """``(name, ours, vLLM's, the vLLM class)`` for each method we override, each
    as the class attribute it is called through (a classmethod bound, so both sides
    drop ``cls``). Members vLLM's classes inherit from outside vLLM (a Protocol's
    generated ``__init__``) are not vLLM's signatures and are left out."""
    for name in vars(cls):
        if name.startswith("__") and name != "__init__":
            continue
        for base in cls.__mro__[1:]:
            if not _from_vllm(base) or name not in vars(base):
                continue
            ours, theirs = getattr(cls, name), getattr(base, name)
            defined_in = getattr(inspect.unwrap(theirs), "__module__", None) or ""
            if callable(ours) and callable(theirs) and defined_in.startswith("vllm"):
                yield name, ours, theirs, base
            break


def incompatibilities(ours, theirs) -> list[str]:
    """How a call that ``theirs`` accepts could fail to bind to ``ours``."""
    try:
        mine, base = inspect.signature(ours), inspect.signature(theirs)
    except (TypeError, ValueError):
        return []
    kinds = inspect.Parameter
    my_params = list(mine.parameters.values())
    takes_args = any(p.kind is kinds.VAR_POSITIONAL for p in my_params)
    takes_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in my_params)
    my_positional = [
        p
        for p in my_params
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    problems = []
    position = 0
    for param in base.parameters.values():
        if param.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
            wanted = "*args" if param.kind is kinds.VAR_POSITIONAL else "**kwargs"
            has = takes_args if param.kind is kinds.VAR_POSITIONAL else takes_kwargs
            if not has:
                problems.append(f"vLLM's takes {wanted}; ours does not")
            continue
        if param.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
            if position < len(my_positional):
                mine_here = my_positional[position]
                # A method's own first parameter is never passed by name.
                by_name = param.kind is kinds.POSITIONAL_OR_KEYWORD and not (
                    position == 0 and param.name in ("self", "cls")
                )
                # Passed by vLLM's name, it would leave ours unbound (**kwargs
                # would take it) unless ours may be left out.
                if (
                    by_name
                    and mine_here.name != param.name
                    and mine_here.default is kinds.empty
                ):
                    problems.append(
                        f"argument {position} is {param.name!r} in vLLM's, "
                        f"{mine_here.name!r} in ours"
                    )
                if (
                    param.default is not kinds.empty
                    and mine_here.default is kinds.empty
                ):
                    problems.append(f"{param.name!r} may be left out; ours needs it")
            elif not takes_args:
                problems.append(f"vLLM's passes {param.name!r}; ours has no room")
            position += 1
            continue
        # keyword-only
        match = mine.parameters.get(param.name)
        if match is None and not takes_kwargs:
            problems.append(f"vLLM's takes keyword {param.name!r}; ours does not")
        elif (
            match is not None
            and param.default is not kinds.empty
            and match.default is kinds.empty
        ):
            problems.append(f"{param.name!r} may be left out; ours needs it")
    for extra in my_positional[position:]:
        if extra.default is kinds.empty:
            problems.append(f"ours needs {extra.name!r}, which vLLM's never passes")
    return problems


OVERRIDES = [
    pytest.param(ours, theirs, id=f"{cls.__name__}.{name}<{base.__name__}>")
    for cls in _plugin_classes()
    for name, ours, theirs, base in _overrides(cls)
]


def test_the_audit_sees_the_overrides():
    names = {param.id for param in OVERRIDES}
    assert "K3CpuMlaImpl.do_kv_cache_update<CPUMLAImpl>" in names
    assert any(name.startswith("K3Parser.parse_delta<") for name in names)
    assert "ForcedTokenExecutor.execute_model<Executor>" in names
    from vllm.reasoning import ReasoningParser

    # vLLM 0.34's structured-output hook, where the installed vLLM has it (its two
    # properties are no calls to audit).
    if "find_reasoning_end" in vars(ReasoningParser):
        assert "K3ReasoningParser.find_reasoning_end<ReasoningParser>" in names
    # The forcing processor on the interface the installed vLLM loads: V1's
    # ``update_state`` (0.32, 0.33) or Model Runner V2's ``add_request`` (0.34).
    assert {"ForceTokens.update_state<LogitsProcessor>",
            "ForceTokens.add_request<LogitsProcessor>"} & names  # fmt: skip


@pytest.mark.parametrize(("ours", "theirs"), OVERRIDES)
def test_override_accepts_every_call_vllm_makes(ours, theirs):
    assert incompatibilities(ours, theirs) == []


@pytest.mark.parametrize("cls", _plugin_classes(), ids=lambda cls: cls.__name__)
def test_no_abstract_method_left(cls):
    assert not getattr(cls, "__abstractmethods__", frozenset())


def test_the_check_finds_a_missing_argument():
    def vllms(self, a, b, c, skip_scale: bool = False): ...

    def six(self, a, b, c): ...

    def seven(self, a, b, c, skip_scale=False): ...

    assert incompatibilities(six, vllms) == [
        "vLLM's passes 'skip_scale'; ours has no room"
    ]
    assert incompatibilities(seven, vllms) == []
