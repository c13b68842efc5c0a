"""Streamed weight loading on a GPU (marked `gpu`: skipped without a CUDA driver).

A bundle loaded on cuda holds on the device the bytes the old path (each buffer assembled on
the host, then uploaded) gives on the cpu backend: bf16 weights, an FP8 checkpoint's e4m3
weights, and FP8 quantized at load by the derive program on the device (the quantize kernel
gives the reference's bits). With staging buffers far smaller than the model every staging
buffer is refilled while copies are in flight, so a buffer reused before its copies landed
shows as wrong bytes. The pinned staging is given back after the load.
"""

from __future__ import annotations

import pytest

from kerncc.runtime import Chain
from kerncc.runtime import loader as loading
from kerncc.runtime.backends import make_backend
from test_loader import bundles, old, resident  # noqa: F401  (module fixtures)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["bf16", "fp8", "quantized"])
@pytest.mark.parametrize("staging", ["default", "small"])
def test_a_cuda_load_puts_the_old_paths_bytes_on_the_device(  # noqa: F811 (fixtures)
        bundles, old, kind, staging, monkeypatch):
    if staging == "small":
        monkeypatch.setattr(loading, "STAGE_BYTES", 64 << 10)
        monkeypatch.setattr(loading, "JOB_BYTES", 5000)
        monkeypatch.setattr(loading, "STAGES", 2)
    backend = make_backend("cuda")
    try:
        pinned = len(backend._pinned_all)
        chain = Chain(bundles[kind], backend=backend)
        assert len(backend._pinned_all) == pinned  # the staging was given back
        assert resident(chain) == old[kind]  # each buffer read back from the device
        session = chain.sessions[0]
        name = next(n for n, b in session.manifest.buffers.items() if b.kind == "weight")
        assert session.device_array(name).ptr == session.memory.buffer(name).ptr
        times = session.load_times
        assert times["load_bytes"] > 0 and times["weights"] > 0
    finally:
        backend.close()
