"""Whether this machine can run the cuda backend, asked without touching a GPU in-process.

`cuda.core.Device()` in a process without a working driver raises, and was once seen to hang,
so the question goes to a short-lived child process: it imports cuda.core and counts the
devices. The answer is cached for the life of the process. Nothing here imports cuda: the
tests' gpu marker and `kerncc run --backend cuda` ask it first.
"""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import subprocess
import sys

PROBE = "from cuda.core import Device; print(len(Device.get_all_devices()))"


@functools.cache
def cuda_devices() -> tuple[int, str]:
    """(number of usable CUDA devices, why none when 0)."""
    if ctypes.util.find_library("cuda") is None:
        return 0, "no CUDA driver (libcuda) on this machine"
    for module in ("cuda.core", "cuda.bindings"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return 0, f"`{module}` is not installed (pip install 'kerncc[cuda]')"
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 0, f"probing the CUDA driver failed: {err}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].isdigit():
        reason = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        return 0, f"the CUDA driver cannot list devices: {reason}"
    count = int(lines[-1])
    return count, "" if count else "the CUDA driver sees no device"
