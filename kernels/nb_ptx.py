"""`python -m kerncc.kernels.nb_ptx MODULE`: the PTX of a Numba kernel module, for the build.

Apart from kerncc.kernels.nb because it imports the kernel module by name, and every kernel
module imports nb: kept there, the two would import each other. Nothing imports this module;
kernels/build.py runs it in a child process.
"""

from __future__ import annotations

from kerncc.kernels.nb import compile_ptx


def module_ptx(module: str, cc: tuple[int, int] = (9, 0)) -> dict[str, str]:
    """{entry: PTX} of every kernel Numba module `module` (kerncc.kernels.<module>) registers."""
    import importlib

    entries = getattr(importlib.import_module(f"kerncc.kernels.{module}"), "ENTRIES", None)
    if not isinstance(entries, dict):
        raise SystemExit(f"kernels/{module}.py has no ENTRIES dict (see kerncc.kernels.nb.kernel)")
    return {name: compile_ptx(fn, signature, cc) for name, (fn, signature) in entries.items()}


def main(argv: list[str] | None = None) -> int:
    """`python -m kerncc.kernels.nb_ptx MODULE`: the module's {entry: PTX} as JSON on stdout.

    kernels/build.py runs this in a child process with PYTHONHASHSEED=0: numba emits some
    declarations in set order, so the same source gives the same PTX only under a fixed hash
    seed.
    """
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m kerncc.kernels.nb_ptx MODULE")
    json.dump(module_ptx(args[0]), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
