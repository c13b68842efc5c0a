"""The verifier (spec §2): every semantic rule of kern's `verify()`, every error collected.

`verify(manifest)` returns a `Verified` (the only way to make one) or raises a KernccError headed
`manifest failed verification:` with one diagnostic per problem; the result is cached per
manifest object (kerncc.analysis.cache), so the runner, `cut` and `emit` verify a stage once. The shared state lives in
`checker`; the rule groups in `decls`, `buffers`, `ops` (with `wiring` and `packs`) and `programs`.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.analysis.cache import per_manifest
from kerncc.verify import decls as verify_decls
from kerncc.verify import ops as verify_ops
from kerncc.verify import programs as verify_programs
from kerncc.verify.checker import (
    GRID_LIMITS, HEADLINE, MAX_BLOCK_THREADS, MAX_BLOCK_Z, MAX_CLUSTER_BLOCKS, MAX_SHARED_MEM,
    Checker, Usage, Verified, buffer_ptr,
)

__all__ = [
    "GRID_LIMITS", "HEADLINE", "MAX_BLOCK_THREADS", "MAX_BLOCK_Z", "MAX_CLUSTER_BLOCKS",
    "MAX_SHARED_MEM", "Checker", "Usage", "Verified", "buffer_ptr", "verify",
]


@per_manifest
def verify(manifest: m.Manifest) -> Verified:
    """Run every rule group; raise KernccError with all diagnostics, or return `Verified`.

    Once per manifest object: a second call returns (or raises) what the first one did.
    """
    checker = Checker(manifest)
    verify_decls.check_declarations(checker)      # rule groups 1-6
    verify_ops.check_ops(checker)                 # rule group 7
    verify_programs.check_programs(checker)       # rule group 8
    verify_decls.check_unused(checker)            # rule group 9
    checker.diags.raise_if_any(HEADLINE)
    return Verified(manifest)
