"""The kernel library's contract with the cuda backend's overlapping launches (no GPU needed).

The backend launches a kernel with programmatic stream serialization only when its module is
one `kernels/cubins.json` marks `"waits"`; the build marks a CUDA C module so only when every
entry begins with `pdl_begin();`, and refuses one that does
not. A kernel that read its inputs before waiting could see the previous kernel's half-written
output, so these checks guard correctness, not speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kerncc.kernels import build, library

GOOD = '''extern "C" __global__ void __launch_bounds__(256) ok(const float* x, float* y) {
  pdl_begin();
  y[threadIdx.x] = x[threadIdx.x];
}
extern "C" __global__ void commented(const float* x, float* y, int n) {
  // a comment before the wait is fine
  pdl_begin();
  y[0] = x[0];
}
'''


def write(tmp_path: Path, text: str) -> Path:
    source = tmp_path / "k.cu"
    source.write_text(text)
    return source


def test_entries_that_wait_first_pass(tmp_path):
    build.check_waits(write(tmp_path, GOOD))
    bodies = build.entry_bodies(GOOD)
    assert list(bodies) == ["ok", "commented"]
    assert "y[0] = x[0];" in bodies["commented"]


@pytest.mark.parametrize("body", [
    "  y[0] = x[0];\n  pdl_begin();\n",  # reads before it waits
    "  y[0] = x[0];\n",  # never waits
    "  if (threadIdx.x) { pdl_begin(); }\n  y[0] = x[0];\n",  # waits on one path only
    "  pdl_wait();\n  y[0] = x[0];\n",  # waits but never lets the next kernel start
    "  prefetch(x);\n  pdl_begin();\n",  # anything before the wait
])
def test_an_entry_that_reads_before_it_waits_is_refused(tmp_path, body):
    text = GOOD + f'extern "C" __global__ void bad(const float* x, float* y) {{\n{body}}}\n'
    with pytest.raises(SystemExit, match="kernel `bad` must begin with `pdl_begin\\(\\);`"):
        build.check_waits(write(tmp_path, text))


def test_every_cuda_c_module_waits_and_no_numba_module_claims_to():
    index = library.index()
    for name, info in index.items():
        assert info["waits"] is (not build.is_numba(name)), name
    for source in sorted(build.KERNELS_DIR.glob("*.cu")):
        build.check_waits(source)  # the committed sources keep the shape the index claims
        assert index[source.stem]["waits"]


def test_only_sm90a_sources_build_for_sm90a():
    """wgmma and setmaxnreg exist only on the architecture-specific target, whose cubins load
    only on compute capability 9.0; every other module stays plain sm_90."""
    assert build.nvcc_flags(Path("attention_sm90a.cu")) == build.SM90A_FLAGS
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.SM90A_FLAGS
    for name in ("attention.cu", "sm90a_helpers.cu", "gemv.cu"):
        assert build.nvcc_flags(Path(name)) == build.NVCC_FLAGS
    assert "-arch=sm_90" in build.NVCC_FLAGS
    sm90a = {n for n in library.index() if n.endswith(build.SM90A_SUFFIX)}
    assert sm90a == {"attention_sm90a"}
