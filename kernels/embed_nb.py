"""Module `embed_nb`: token embedding gather in Numba-CUDA, the twin of embed.cu.

`embedding_gather_bf16_nb` has the ABI and grid of `embedding_gather_bf16`: out[r, :] =
table[ids[r], :] for r < rows, one block per row, 16-byte copies (hidden % 8 == 0, buffers
16-byte aligned). Compiled ahead of time by kernels/build.py; never imported at run time.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from kerncc.kernels.nb import I32, P_I32, P_U16, Entries, kernel, load16, store16

ENTRIES: Entries = {}


@kernel(ENTRIES, "embedding_gather_bf16_nb", P_I32, P_U16, P_U16, I32, I32)
def embedding_gather_bf16_nb(ids, table, out, rows, hidden):
    row = cuda.blockIdx.x
    if row >= rows:
        return
    src = np.int64(ids[row]) * np.int64(hidden)
    dst = np.int64(row) * np.int64(hidden)
    i = cuda.threadIdx.x
    while i < hidden // 8:
        w0, w1, w2, w3 = load16(table, src + np.int64(i) * 8)
        store16(out, dst + np.int64(i) * 8, w0, w1, w2, w3)
        i += cuda.blockDim.x
