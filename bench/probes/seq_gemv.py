"""The seq entries (pinned cuBLASLt bits) against LT, the split-K family and cuBLAS."""
import sys

import torch

from bench.gemv import SHAPES, graph_us
from kerncc.runtime.backends import cublas, gemv
from kerncc.runtime.backends.cuda import check

torch.zeros(1, device="cuda")
G = gemv.Gemv(check)
sites = {name: G.site(name, invariant=True) for name in gemv.MODES}
ws = torch.empty(cublas.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
lt = cublas.Lt(ws.data_ptr())
stream = torch.cuda.Stream()
h = int(stream.cuda_stream)
SEQ = list(gemv.SEQ_SLOTS)
ROWS = (1,)
DT = {"cublaslt_bf16_tn": torch.bfloat16, "cublaslt_bf16_tn_acc": torch.bfloat16,
      "cublas_bf16_tn_f32": torch.float32}
bad = 0
for label, (n, k) in SHAPES.items():
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    wsx = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(4)]
    a = torch.randn(128, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    for name in ["cublaslt_bf16_tn_acc"]:  # bitwise, every entry, every mode, m = 1, 5, 8, 13, 32, 64
        pinned = lt.pinned(name, n, k, 128)
        c0 = torch.randn(128, n, device="cuda", generator=gen).to(DT[name])
        for m in (1, 5, 8, 13):
            ref = c0.clone()
            with torch.cuda.stream(stream):
                pinned(a.data_ptr(), wsx[0].data_ptr(), ref.data_ptr(), m, h)
            torch.cuda.synchronize()
            for entry in SEQ:
                got = c0.clone()
                with torch.cuda.stream(stream):
                    sites[name].launch(entry, a.data_ptr(), wsx[0].data_ptr(), got.data_ptr(), m, n, k, h)
                torch.cuda.synchronize()
                if not torch.equal(got, ref):
                    bad += 1
                    print(f"DIFFER {label} {name} m={m} {entry}: "
                          f"{(got != ref).float().mean().item():.4f}", flush=True)
    site = sites["cublaslt_bf16_tn"]
    pinned = lt.pinned("cublaslt_bf16_tn", n, k, 128)
    c = torch.empty(128, n, device="cuda", dtype=torch.bfloat16)
    for m in ROWS:
        cells = []
        for entry in SEQ:
            us = graph_us(torch, stream, lambda i: site.launch(entry, a.data_ptr(), wsx[i % 4].data_ptr(), c.data_ptr(), m, n, k, h))
            cells.append(f"{entry.removeprefix('gemv_bf16_tn_seq_')}={us:.1f}")
            if m == 1 and entry in ("gemv_bf16_tn_seq_mb1_w4_s8", "gemv_bf16_tn_seq_mb1_w8_s8"):
                for flag, what in ((4, "copy-only"), (8, "chain-only")):
                    fsite = G.site("cublaslt_bf16_tn", invariant=True)
                    fsite.mode = flag
                    us = graph_us(torch, stream, lambda i: fsite.launch(entry, a.data_ptr(), wsx[i % 4].data_ptr(), c.data_ptr(), m, n, k, h))
                    cells.append(f"{what}={us:.1f}")
        lt_us = graph_us(torch, stream, lambda i: pinned(a.data_ptr(), wsx[i % 4].data_ptr(), c.data_ptr(), m, h))
        old = gemv.invariant_entry(m, n)
        old_us = graph_us(torch, stream, lambda i: site.launch(old, a.data_ptr(), wsx[i % 4].data_ptr(), c.data_ptr(), m, n, k, h))
        cb = graph_us(torch, stream, lambda i: torch.matmul(a[:m], wsx[i % 4].T, out=c[:m]))
        print(f"[{label}] m={m}: lt={lt_us:.1f} splitk({old.removeprefix('gemv_bf16_tn_')})={old_us:.1f} "
              f"cublas={cb:.1f} | " + " ".join(cells), flush=True)
    del wsx
    torch.cuda.empty_cache()
print("bitwise failures:", bad)
