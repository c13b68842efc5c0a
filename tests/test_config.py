"""kerncc/config.py: the environment, read in one place; a value it does not know is an error
naming the variable, never a traceback and never quietly taken for the default."""

from __future__ import annotations

import pytest

from kerncc import config
from kerncc.diagnostics import KernccError


@pytest.mark.parametrize("name, read, values", [
    ("KERNCC_PDL", config.pdl, {"0": False, "1": True}),
    ("KERNCC_GEMV_MAX_M", config.gemv_max_m, {"0": 0, "3": 3, "8": 8}),
    ("KERNCC_PIPE_ATTENTION", config.pipe_attention, {"0": False, "1": True}),
    ("KERNCC_INVARIANT", config.invariant, {"0": False, "1": True}),
])
def test_the_cuda_backends_variables_read_what_they_say(monkeypatch, name, read, values):
    for text, value in values.items():
        monkeypatch.setenv(name, text)
        assert read() == value
    monkeypatch.delenv(name)
    assert read() == {"KERNCC_PDL": True, "KERNCC_GEMV_MAX_M": 8,
                      "KERNCC_PIPE_ATTENTION": True, "KERNCC_INVARIANT": True}[name]


@pytest.mark.parametrize("name, read, bad", [
    ("KERNCC_PDL", config.pdl, "off"),
    ("KERNCC_GEMV_MAX_M", config.gemv_max_m, "abc"),  # was a ValueError traceback at import
    ("KERNCC_GEMV_MAX_M", config.gemv_max_m, "9"),  # the kernels stop at m = 8
    ("KERNCC_GEMV_MAX_M", config.gemv_max_m, "-1"),
    ("KERNCC_PIPE_ATTENTION", config.pipe_attention, "on"),
    ("KERNCC_INVARIANT", config.invariant, "yes"),
])
def test_a_value_outside_them_is_an_error_naming_the_variable(monkeypatch, name, read, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(KernccError, match=rf"{name}='{bad}': expected (one of|a whole)"):
        read()
