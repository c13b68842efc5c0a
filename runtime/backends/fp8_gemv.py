"""The cuda backend's launch policy for the FP8 decode GEMV (kernels/fp8.cu).

Manifests launch `gemv_fp8_bf16` (kerncc/example/qwen.py: a warp per row of W, ceil(n / 8)
blocks of 256 threads). Its tensor-core form `gemv_fp8_bf16_tc` computes the same function
(the same ABI, the same numpy reference in kernels/reference.py) built like the bf16 decode
GEMV: a block per 16-row tile of W, its warps over k, e4m3 widened to bf16 in registers for
mma.m16n8k16. The backend gives a site of `gemv_fp8_bf16` to it when `TENSOR_CORES` is on and
the site allows it (`usable`); otherwise the site runs as the manifest names it.

The two kernels sum the same f32 products in different fixed orders, so which one a site takes
changes bits (within f32 rounding) but never from one launch to the next: the choice is made
once per site, from its shape and pointers, never from m or timing. Each gives a row of C the
same bits whatever m (a row of A is one column of the tensor-core product, computed from that
row alone), so decode results stay batch-invariant.
"""

from __future__ import annotations

# The switch: True gives `gemv_fp8_bf16` sites to the tensor-core kernel, False launches them as
# the manifest names them (the A/B against the old kernel flips this one line).
TENSOR_CORES = True

ENTRY = "gemv_fp8_bf16"
TC_ENTRY = "gemv_fp8_bf16_tc"
# tensor-core entry: threads a block (32 per warp; the warp count fixes the order of the sums)
TC_THREADS = {"gemv_fp8_bf16_tc": 256}
TILE_ROWS = 16  # rows of W a job (one mma tile)
JOB_COLS = 8  # rows of A a job (one mma "B" operand)


def usable(n: int, k: int, a: int, w: int) -> bool:
    """Whether a site of this shape and these pointers may take the tensor-core kernel: its
    needs are gemv_fp8_bf16's (k % 16 == 0, A and W 16-byte aligned)."""
    return n > 0 and k > 0 and k % 16 == 0 and not (a | w) & 15


def grid(m: int, n: int) -> int:
    """Blocks that run each job once: W's 16-row tiles times A's groups of 8 rows (the kernel
    is correct at any grid; at least one block, so a launch of m = 0 is still a launch)."""
    return max(1, -(-n // TILE_ROWS) * -(-m // JOB_COLS))
