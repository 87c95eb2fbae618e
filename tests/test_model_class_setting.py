"""Which Kimi-K3 model class the plugin registers, by platform and setting."""

from __future__ import annotations

import pytest

from vllm_k3_plugin.vllm_adapter.settings import MODEL_CLASS_ENV, model_class


def test_ours_by_default_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv(MODEL_CLASS_ENV, raising=False)
    assert model_class(on_cpu=True) == "plugin"
    assert model_class(on_cpu=False) == "vllm"


@pytest.mark.parametrize("value", ["plugin", "vllm", " VLLM "])
def test_the_setting_wins_everywhere(monkeypatch, value):
    monkeypatch.setenv(MODEL_CLASS_ENV, value)
    assert (
        model_class(on_cpu=True) == model_class(on_cpu=False) == value.strip().lower()
    )


def test_a_bad_value_names_the_choices(monkeypatch):
    monkeypatch.setenv(MODEL_CLASS_ENV, "mine")
    with pytest.raises(ValueError, match="plugin, vllm"):
        model_class(on_cpu=True)
