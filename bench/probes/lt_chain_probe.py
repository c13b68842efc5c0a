import sys
import cupy as cp
import torch
from kerncc.runtime.backends import cublas

mod = cp.RawModule(path=".gpu/seqprobe.cubin")
fn = mod.get_function("seq_probe")
ws = torch.empty(cublas.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
lt = cublas.Lt(ws.data_ptr())
stream = torch.cuda.current_stream()
h = int(stream.cuda_stream)
for (n, k) in [(4096, 2048), (2048, 2048), (2048, 6144), (12288, 2048), (6144, 4096), (4096, 12288)]:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    a = torch.randn(128, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    for max_m in (128, 2048):
        for name, dt in (("cublas_bf16_tn_f32", torch.float32), ("cublaslt_bf16_tn", torch.bfloat16)):
            pinned = lt.pinned(name, n, k, max_m)
            line = [f"n={n} k={k} max_m={max_m} {name}:"]
            for m in (1, 8, 64, 128):
                ref = torch.zeros(m, n, device="cuda", dtype=dt)
                pinned(a.data_ptr(), w.data_ptr(), ref.data_ptr(), m, h)
                torch.cuda.synchronize()
                for variant in (0, 1, 2, 3):
                    out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
                    fn((n // 16, (m + 7) // 8), (32,), (cp.uint64(a.data_ptr()), cp.uint64(w.data_ptr()),
                        cp.uint64(out.data_ptr()), cp.int32(m), cp.int32(n), cp.int32(k), cp.int32(variant)))
                    cp.cuda.runtime.deviceSynchronize()
                    got = out.to(dt)
                    same = (got == ref).float().mean().item()
                    diff = (got.float() - ref.float()).abs().max().item()
                    line.append(f"m{m}v{variant}={same:.4f}/{diff:.1e}")
            print(" ".join(line), flush=True)
