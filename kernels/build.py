"""Build the kernel library's cubins: one module per `kernels/*.cu` file.

Runs `nvcc -cubin -arch=sm_90 -O3` on every source, writes `kernels/cubins/<name>.cubin`
and the index `kernels/cubins.json` = {module name: {"file", "sha256", "entries"}}, where
`file` is relative to `kernels/` and `entries` are the extern "C" kernels the source defines
(each checked to be a symbol of the cubin). Manifests pin modules by these sha256s, so the
committed cubins are the ones that count; `--check` rebuilds into a temporary directory and
fails if any hash differs from the index (same nvcc version expected: 13.0).

Usage: python kernels/build.py [--check] [--nvcc PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
NVCC_FLAGS = ["-cubin", "-arch=sm_90", "-O3"]
_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\('
)


def entries_of(source: Path) -> list[str]:
    """The extern "C" kernel names a .cu file defines, in source order."""
    return _ENTRY.findall(source.read_text())


def compile_module(nvcc: str, source: Path, out: Path) -> None:
    cmd = [nvcc, *NVCC_FLAGS, "-o", str(out), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed for {source.name} (repro: {' '.join(cmd)}):\n{done.stderr}")


def check_entries(cubin: Path, entries: list[str]) -> None:
    # An ELF string table holds every kernel symbol NUL-terminated on both sides.
    image = cubin.read_bytes()
    missing = [e for e in entries if b"\0" + e.encode() + b"\0" not in image]
    if missing:
        raise SystemExit(f"{cubin.name}: entries {missing} are not symbols of the cubin")


def build(nvcc: str, out_dir: Path) -> dict[str, dict]:
    """Compile every source into out_dir; return the index (files relative to out_dir's parent)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, dict] = {}
    for source in sorted(KERNELS_DIR.glob("*.cu")):
        name = source.stem
        cubin = out_dir / f"{name}.cubin"
        compile_module(nvcc, source, cubin)
        entries = entries_of(source)
        check_entries(cubin, entries)
        index[name] = {
            "file": f"cubins/{cubin.name}",
            "sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
            "entries": entries,
        }
    return index


def check(nvcc: str) -> int:
    committed = json.loads((KERNELS_DIR / "cubins.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt = build(nvcc, Path(tmp) / "cubins")
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
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.nvcc)
    index = build(args.nvcc, KERNELS_DIR / "cubins")
    (KERNELS_DIR / "cubins.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    print(f"built {len(index)} modules into {KERNELS_DIR / 'cubins'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
