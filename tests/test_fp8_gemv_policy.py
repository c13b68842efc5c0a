"""Which FP8 decode GEMV the cuda backend launches (runtime/backends/fp8_gemv.py; no GPU
needed): the tensor-core kernel's needs, the grid that runs each of its jobs once, and that
the entries the policy names are in the fp8 module with a numpy reference."""

from __future__ import annotations

import pytest

from kerncc.kernels import library
from kerncc.kernels.reference import KERNELS
from kerncc.runtime.backends import fp8_gemv


def test_the_tensor_core_entries_are_built_and_have_the_reference():
    entries = library.index()["fp8"]["entries"]
    assert fp8_gemv.ENTRY in entries and fp8_gemv.TC_ENTRY in fp8_gemv.TC_THREADS
    for entry, threads in fp8_gemv.TC_THREADS.items():
        assert entry in entries
        assert KERNELS[entry] is KERNELS[fp8_gemv.ENTRY]  # the same function
        assert threads % 32 == 0 and threads <= 1024


@pytest.mark.parametrize("n, k, a, w, ok", [
    (4096, 4096, 0, 256, True), (17, 16, 16, 32, True), (151936, 4096, 4096, 0, True),
    (4096, 4104, 0, 0, False),  # k % 16 != 0
    (4096, 8, 0, 0, False), (0, 4096, 0, 0, False), (4096, 0, 0, 0, False),
    (4096, 4096, 8, 0, False), (4096, 4096, 0, 4, False),  # A or W not 16-byte aligned
])
def test_usable_takes_the_old_kernels_needs(n, k, a, w, ok):
    assert fp8_gemv.usable(n, k, a, w) is ok


@pytest.mark.parametrize("m, n, blocks", [
    (1, 4096, 256), (8, 4096, 256), (9, 4096, 512), (64, 6144, 3072), (1, 17, 2),
    (1, 151936, 9496), (0, 4096, 1),
])
def test_grid_is_tiles_times_groups_of_eight_rows(m, n, blocks):
    assert fp8_gemv.grid(m, n) == blocks


def test_the_switch_defaults_to_the_tensor_cores():
    assert fp8_gemv.TENSOR_CORES is True
