"""The kernels' runtime helpers: the interpreter compatibility patch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from k3_triton_kernels import runtime


class _Scope:
    """Stands in for the interpreter's per-launch patch scope: sets attributes."""

    def set_attr(self, owner, name, value):
        setattr(owner, name, value)


class _Handle:
    def __init__(self, data):
        self.data = data


def test_a_one_element_scalar_indexes_without_numpy_s_deprecated_conversion():
    """A scalar the interpreter holds as a one-element array gives ``range()`` its
    element, with NumPy's array-to-scalar deprecation (an error from NumPy 2.4)
    turned into an error here: Triton 3.6's interpreter raised it on every loop
    over loaded bounds."""
    from triton.runtime import interpreter

    runtime._interpreter_scalars_index_under_any_numpy()

    class Tensor:
        pass

    interpreter._patch_lang_tensor(Tensor, _Scope())
    scalar = Tensor()
    scalar.handle = _Handle(np.array([7], dtype=np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert list(range(scalar, 10)) == [7, 8, 9]
    scalar.handle = _Handle(np.array(4, dtype=np.int64))  # 0-d, as Triton 3.7 on
    assert list(range(scalar)) == [0, 1, 2, 3]
    scalar.handle = _Handle(np.array([1, 2]))  # not a scalar: refused, not read
    with pytest.raises(ValueError):
        range(scalar)
