"""`system_fingerprint`: a short name for everything that fixes a response's bits.

OpenAI's responses carry a `system_fingerprint` that changes when the serving system changes.
kerncc's names what decides the bits of a batch-invariant response (docs/serving.md): the
bundle (its bundle.json, which records the sha256 of every stage file and cubin), the kernel
library's index (kernels/cubins.json: the GEMV kernels the cuda backend launches beside the
bundle's own) and each stage's device kind (`Backend.kind`: for a GPU its name, its
architecture and its cuBLASLt version; not its index). The same fingerprint and the same
request give the same bits, whatever else is being served.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kerncc.kernels import library


def system_fingerprint(bundle_index: Mapping[str, Any], devices: Sequence[str]) -> str:
    """`fp_` and 16 hex digits of the sha256 over the three, each in a canonical form."""
    digest = hashlib.sha256()
    digest.update(json.dumps(bundle_index, sort_keys=True, separators=(",", ":")).encode())
    digest.update(b"\0" + json.dumps(library.index(), sort_keys=True).encode())
    digest.update(b"\0" + "\n".join(devices).encode())
    return "fp_" + digest.hexdigest()[:16]


def of_runner(runner: Any) -> str:
    """The fingerprint of a Session or a Chain (of any placement): its bundle and the device
    kind of each stage (`unknown` where a stage's backend lives in another process)."""
    sessions = getattr(runner, "sessions", None) or [runner]
    devices = []
    for session in sessions:
        backend = getattr(session, "backend", None)
        devices.append(backend.kind() if hasattr(backend, "kind") else "unknown")
    return system_fingerprint(runner.bundle.index, devices)
