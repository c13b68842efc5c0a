"""Module `activation_nb`: SiLU-and-multiply in Numba-CUDA, the twin of activation.cu.

`silu_mul_bf16_nb` has the ABI, the grid contract and the bits of `silu_mul_bf16`
(kernels/activation.cu): act[r, i] = bf16(bf16(silu(g)) * u) over gate_up rows that hold gate
and up interleaved in `block`-wide pieces; grid-stride over the outputs, 8 at a time (16-byte
loads and stores) when inter and block are multiples of 8 and both buffers 16-byte aligned,
else one at a time. Compiled ahead of time by kernels/build.py; never imported at run time.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda.extending import register_jitable

from kerncc.kernels.nb import (I32, P_U16, Entries, address, bf16_to_f32, bits_f32,
                               f32_to_bf16, kernel, load16_nc, store16, udiv32)

ENTRIES: Entries = {}
ONE = np.float32(1.0)
HI = np.uint32(0xFFFF0000)
S16 = np.uint32(16)


@register_jitable
def silu_mul(g, u):
    s = bf16_to_f32(f32_to_bf16(g / (ONE + math.exp(-g))))
    return s * u


@register_jitable
def silu_mul_word(gw, uw):
    """Two outputs from one word of gate and one of up (bf16 pairs, low half first)."""
    lo = silu_mul(bits_f32(gw << S16), bits_f32(uw << S16))
    hi = silu_mul(bits_f32(gw & HI), bits_f32(uw & HI))
    return np.uint32(f32_to_bf16(lo)) | (np.uint32(f32_to_bf16(hi)) << S16)


@kernel(ENTRIES, "silu_mul_bf16_nb", P_U16, P_U16, I32, I32, I32)
def silu_mul_bf16_nb(gate_up, act, rows, inter, block):
    # Unsigned 64-bit indices and one 32-bit division for the piece (numba's `//` on ints
    # is a signed 64-bit division with a floor correction: 1.3x the CUDA C's time).
    n = np.uint64(rows) * np.uint64(inter)
    stride = np.uint64(cuda.gridDim.x) * np.uint64(cuda.blockDim.x)
    first = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(cuda.threadIdx.x)
    wide = np.uint64(inter)
    piece = np.uint64(block)
    bases = address(gate_up) | address(act)
    if inter % 8 == 0 and block % 8 == 0 and bases % np.uint64(16) == np.uint64(0):
        v = first
        while v < n // np.uint64(8):
            idx = v * np.uint64(8)
            row = idx // wide
            i = idx - row * wide  # 8 outputs inside one `block`-wide piece
            q = np.uint64(udiv32(i, block))
            src = row * np.uint64(2) * wide + q * np.uint64(2) * piece + (i - q * piece)
            g0, g1, g2, g3 = load16_nc(gate_up, src)
            u0, u1, u2, u3 = load16_nc(gate_up, src + piece)
            store16(act, idx, silu_mul_word(g0, u0), silu_mul_word(g1, u1),
                    silu_mul_word(g2, u2), silu_mul_word(g3, u3))
            v += stride
        return
    idx = first
    while idx < n:
        row = idx // wide
        i = idx - row * wide
        q = np.uint64(udiv32(i, block))
        src = row * np.uint64(2) * wide + q * np.uint64(2) * piece + (i - q * piece)
        act[idx] = f32_to_bf16(silu_mul(bf16_to_f32(gate_up[src]),
                                        bf16_to_f32(gate_up[src + piece])))
        idx += stride
