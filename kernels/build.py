"""Build the kernel library's cubins: one module per `kernels/*.cu` and `kernels/*_nb.py` file.

CUDA C: `nvcc -cubin -arch=sm_90 -O3` on every `.cu` source; a source named `*_sm90a.cu` uses
Hopper's architecture-specific instructions (wgmma) and is built for sm_90a instead
(`-gencode=arch=compute_90a,code=sm_90a`), a cubin only H100/H200-class GPUs load. Numba-CUDA (kerncc[build]): every
entry a `<name>_nb.py` module registers in its `ENTRIES` is compiled to PTX with
`numba.cuda.compile(..., output="ptx", cc=(9, 0))` (no GPU needed), its mangled entry name
replaced by the registered one (so manifests name it like an extern "C" kernel), and the PTX
assembled with `ptxas -arch=sm_90`. Writes `kernels/cubins/<name>.cubin` and the index
`kernels/cubins.json` = {module name: {"file", "sha256", "entries", "waits"}}, where `file` is
relative to `kernels/`, `entries` are the kernels the source defines (each checked to be a
symbol of the cubin) and `waits` says that every entry begins by waiting for the kernel before
it (CUDA C entries must: `check_waits`; Numba kernels do not), which lets the cuda backend
launch them with programmatic dependent launch. Manifests pin modules by these sha256s, so the committed cubins are the ones that
count; `--check` rebuilds into a temporary directory and exits 1 if any module's bytes differ
from the index (same tools expected: nvcc and ptxas 13.0, numba-cuda 0.30.4, NVVM 13.0).

Usage: python -m kerncc.kernels.build [--check] [--only cuda|numba] [--nvcc PATH] [--ptxas PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
NVCC_FLAGS = ["-cubin", "-arch=sm_90", "-O3"]
SM90A_SUFFIX = "_sm90a"
SM90A_FLAGS = ["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3"]
PTXAS_FLAGS = ["-arch=sm_90", "-O3"]
NUMBA_SUFFIX = "_nb"
KINDS = ("cuda", "numba")
_PTX_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\(")
_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+'
    r'(?:(?:__launch_bounds__|__cluster_dims__)\([^)]*\)\s*)*(\w+)\s*\('
)
_COMMENT = re.compile(r"//[^\n]*")


def entries_of(source: Path) -> list[str]:
    """The extern "C" kernel names a .cu file defines, in source order."""
    return _ENTRY.findall(source.read_text())


def entry_bodies(text: str) -> dict[str, str]:
    """{entry: the text between its body's braces} of a .cu source."""
    bodies = {}
    for match in _ENTRY.finditer(text):
        start = text.index("{", match.end())
        depth, at = 0, start
        for at in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[at], 0)
            if depth == 0:
                break
        bodies[match.group(1)] = text[start + 1:at]
    return bodies


def check_waits(source: Path) -> None:
    """Every entry of a CUDA C module begins with `pdl_begin();` (common.cuh): the cuda backend
    launches kerncc's own kernels with programmatic dependent launch, which is right only for
    kernels that wait for the one before them before they touch memory."""
    for entry, body in entry_bodies(source.read_text()).items():
        first = _COMMENT.sub("", body).strip().split(";", 1)[0].strip()
        if first != "pdl_begin()":
            raise SystemExit(f"{source.name}: kernel `{entry}` must begin with `pdl_begin();`: "
                             "the cuda backend launches it with programmatic dependent launch "
                             "(kernels/common.cuh)")


def nvcc_flags(source: Path) -> list[str]:
    """sm_90a for `*_sm90a.cu` sources (wgmma needs the architecture-specific target), else
    sm_90."""
    return SM90A_FLAGS if source.stem.endswith(SM90A_SUFFIX) else NVCC_FLAGS


def compile_module(nvcc: str, source: Path, out: Path) -> None:
    cmd = [nvcc, *nvcc_flags(source), "-o", str(out), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed for {source.name} (repro: {' '.join(cmd)}):\n{done.stderr}")


def check_entries(cubin: Path, entries: list[str]) -> None:
    # An ELF string table holds every kernel symbol NUL-terminated on both sides.
    image = cubin.read_bytes()
    missing = [e for e in entries if b"\0" + e.encode() + b"\0" not in image]
    if missing:
        raise SystemExit(f"{cubin.name}: entries {missing} are not symbols of the cubin")


def numba_sources() -> list[Path]:
    """The Numba-CUDA modules: `kernels/<name>_nb.py`."""
    return sorted(KERNELS_DIR.glob(f"*{NUMBA_SUFFIX}.py"))


def default_ptxas(nvcc: str) -> str:
    """ptxas on PATH, else the one beside nvcc."""
    found = shutil.which("ptxas")
    if found:
        return found
    beside = Path(shutil.which(nvcc) or nvcc).resolve().parent / "ptxas"
    return str(beside) if beside.exists() else "ptxas"


def numba_entries(source: Path) -> dict[str, str]:
    """{entry: PTX} of a Numba module, compiled in a child process under PYTHONHASHSEED=0
    (numba orders some declarations by set iteration: a fixed seed makes its PTX repeat)."""
    try:
        import numba.cuda  # noqa: F401 - only to say what is missing
    except ImportError as err:
        raise SystemExit(f"building {source.name} needs numba-cuda ({err}): "
                         "pip install 'kerncc[build]'") from None
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "kerncc.kernels.nb_ptx", source.stem]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise SystemExit(f"numba failed for {source.name} (repro: PYTHONHASHSEED=0 "
                         f"{' '.join(cmd)}):\n{tail}")
    entries = json.loads(done.stdout)
    if not entries:
        raise SystemExit(f"{source.name} registers no kernels (an ENTRIES dict filled by "
                         "kerncc.kernels.nb.kernel)")
    return entries


def rename_entry(ptx: str, name: str, where: str) -> str:
    """The PTX with its one kernel's mangled name replaced by `name` (params follow it)."""
    found = _PTX_ENTRY.findall(ptx)
    if len(found) != 1:
        raise SystemExit(f"{where}: expected one .entry in numba's PTX, found {len(found)}")
    return ptx.replace(found[0], name)


def canonical_ptx(ptx: str) -> str:
    """The PTX with each run of `.common .global` declarations in sorted order.

    numba declares one (unused on CUDA) `NumbaEnv` global per compiled function, in an order
    that varies from run to run even under a fixed hash seed; the order of declarations means
    nothing to ptxas, so sorting them is what makes numba -> ptxas give the same bytes twice.
    """
    out: list[str] = []
    run: list[str] = []
    for line in ptx.splitlines(keepends=True):
        if line.startswith(".common .global"):
            run.append(line)
            continue
        out += sorted(run)
        run = []
        out.append(line)
    return "".join(out + sorted(run))


def numba_ptx(source: Path, compile_ptx=None) -> tuple[str, list[str]]:
    """One module's PTX (its entry renamed) and its entry names. `compile_ptx(stem)` ->
    {entry: PTX} stands in for numba (tests)."""
    entries = compile_ptx(source.stem) if compile_ptx else numba_entries(source)
    if len(entries) != 1:  # one numba kernel is one PTX module; linking several is not done
        raise SystemExit(f"{source.name}: a Numba module defines one kernel, it registers "
                         f"{len(entries)} ({', '.join(entries)}); split it")
    (name, ptx), = entries.items()
    return canonical_ptx(rename_entry(ptx, name, f"{source.name}: {name}")), [name]


def assemble(ptxas: str, ptx: str, out: Path) -> None:
    source = out.with_suffix(".ptx")
    source.write_text(ptx)
    cmd = [ptxas, *PTXAS_FLAGS, "-o", str(out), str(source)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise SystemExit(f"cannot run ptxas ({err}); give --ptxas PATH") from None
    finally:
        source.unlink()
    if done.returncode != 0:
        raise SystemExit(f"ptxas failed for {out.stem} (repro: {' '.join(cmd)} on numba's "
                         f"PTX):\n{done.stderr}")


def _record(cubin: Path, entries: list[str], waits: bool) -> dict:
    """An index entry; `waits`: every entry begins by waiting for the kernel before it
    (`check_waits`), so the cuda backend may launch it with programmatic stream
    serialization."""
    check_entries(cubin, entries)
    return {
        "file": f"cubins/{cubin.name}",
        "sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
        "entries": entries,
        "waits": waits,
    }


def build(nvcc: str, out_dir: Path, ptxas: str | None = None,
          kinds: tuple[str, ...] = KINDS, compile_ptx=None) -> dict[str, dict]:
    """Compile every source of `kinds` into out_dir; return the index (files relative to
    out_dir's parent). `compile_ptx(stem)` -> {entry: PTX} stands in for numba (tests)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, dict] = {}
    if "cuda" in kinds:
        for source in sorted(KERNELS_DIR.glob("*.cu")):
            cubin = out_dir / f"{source.stem}.cubin"
            check_waits(source)
            compile_module(nvcc, source, cubin)
            index[source.stem] = _record(cubin, entries_of(source), waits=True)
    if "numba" in kinds:
        for source in numba_sources():
            ptx, entries = numba_ptx(source, compile_ptx)
            cubin = out_dir / f"{source.stem}.cubin"
            assemble(ptxas or default_ptxas(nvcc), ptx, cubin)
            index[source.stem] = _record(cubin, entries, waits=False)
    return index


def is_numba(name: str) -> bool:
    return name.endswith(NUMBA_SUFFIX)


def selected(index: dict[str, dict], kinds: tuple[str, ...]) -> dict[str, dict]:
    """The modules of `kinds` in an index."""
    return {n: v for n, v in index.items() if ("numba" if is_numba(n) else "cuda") in kinds}


def check(nvcc: str, ptxas: str | None = None, kinds: tuple[str, ...] = KINDS,
          compile_ptx=None) -> int:
    """0 when a rebuild gives the committed bytes of every module of `kinds`, else 1."""
    committed = selected(json.loads((KERNELS_DIR / "cubins.json").read_text()), kinds)
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt = build(nvcc, Path(tmp) / "cubins", ptxas, kinds, compile_ptx)
    if rebuilt == committed:
        print(f"{len(rebuilt)} modules reproduce kernels/cubins.json")
        return 0
    for name in sorted(set(rebuilt) | set(committed)):
        if rebuilt.get(name) != committed.get(name):
            print(f"module `{name}` differs: rebuilt {rebuilt.get(name)} vs {committed.get(name)}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rebuild and compare with the index")
    parser.add_argument("--only", choices=KINDS, help="only the CUDA C or only the Numba modules")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    parser.add_argument("--ptxas", help="ptxas for the Numba modules (default: PATH, or "
                        "beside nvcc)")
    args = parser.parse_args(argv)
    kinds = (args.only,) if args.only else KINDS
    if args.check:
        return check(args.nvcc, args.ptxas, kinds)
    path = KERNELS_DIR / "cubins.json"
    index = json.loads(path.read_text()) if args.only else {}
    index = {n: v for n, v in index.items() if n not in selected(index, kinds)}
    index.update(build(args.nvcc, KERNELS_DIR / "cubins", args.ptxas, kinds))
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    print(f"built {len(selected(index, kinds))} modules into {KERNELS_DIR / 'cubins'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
