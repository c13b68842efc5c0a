"""Building the Numba-CUDA modules (docs/adding-a-kernel.md, "Writing the kernel in Python").

The walkthrough's build step, `python -m kerncc.kernels.build --check --only numba`, runs when
numba-cuda (kerncc[build]) and ptxas are installed, and is skipped with the reason otherwise
(CI installs only kerncc[test]: the build extra is ~600 MB of numba, llvmlite, NVVM and NVRTC).
What needs neither runs everywhere: the PTX post-processing that makes the cubins
reproducible (entry renamed, numba's globals in a fixed order), the index selection of
`--only`, and that running a bundle never imports numba.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from kerncc.kernels import build, library

PTX = """//
.version 9.0
.target sm_90
.address_size 64

\t// .globl\t_ZN6kerncc3fooB2v1E
.common .global .align 8 .u64 _ZN08NumbaEnv6kerncc3barE;
.common .global .align 8 .u64 _ZN08NumbaEnv6kerncc3fooE;

.visible .entry _ZN6kerncc3fooB2v1E(
\t.param .u64 _ZN6kerncc3fooB2v1E_param_0
)
{
\tret;
}
"""


def test_entry_is_renamed_with_its_params():
    out = build.rename_entry(PTX, "foo_nb", "x.py")
    assert ".visible .entry foo_nb(" in out and ".param .u64 foo_nb_param_0" in out
    assert "_ZN6kerncc3fooB2v1E" not in out
    assert "_ZN08NumbaEnv6kerncc3fooE" in out  # the env global is another symbol
    with pytest.raises(SystemExit, match="one .entry"):
        build.rename_entry(PTX.replace(".entry", ".func"), "foo_nb", "x.py")


def test_globals_order_does_not_matter():
    lines = PTX.splitlines(keepends=True)
    swapped = lines[:6] + [lines[7], lines[6]] + lines[8:]
    assert "".join(swapped) != PTX
    assert build.canonical_ptx("".join(swapped)) == build.canonical_ptx(PTX)
    assert build.canonical_ptx(PTX) == PTX  # already sorted: unchanged


def test_every_numba_module_is_indexed():
    stems = {p.stem for p in build.numba_sources()}
    assert stems == {"activation_nb", "embed_nb", "sampling_nb"}
    index = library.index()
    assert set(build.selected(index, ("numba",))) == stems
    assert not set(build.selected(index, ("cuda",))) & stems
    assert library.module_of("sample_f32") == "sampling_nb"


def test_running_never_imports_numba():
    code = ("import sys, kerncc.runtime, kerncc.runtime.sampling, kerncc.runtime.model_runner, "
            "kerncc.serve.engine, kerncc.kernels.reference, kerncc.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def _why_not_buildable() -> str | None:
    if importlib.util.find_spec("numba") is None or importlib.util.find_spec(
            "numba.cuda") is None:
        return "numba-cuda is not installed (pip install 'kerncc[build]')"
    if build.default_ptxas(shutil.which("nvcc") or "nvcc") == "ptxas" and not shutil.which(
            "ptxas"):
        return "ptxas (CUDA 13.0) is not on PATH"
    return None


@pytest.mark.skipif(_why_not_buildable() is not None, reason=str(_why_not_buildable()))
def test_numba_modules_rebuild_to_the_pinned_bytes(capsys):
    assert build.main(["--check", "--only", "numba"]) == 0, capsys.readouterr().out
    assert "3 modules reproduce" in capsys.readouterr().out
