import cupy as cp
mod = cp.RawModule(path=".gpu/lat3.cubin")
fn = mod.get_function("lat3")
fn.max_dynamic_shared_size_bytes = 4 * 24 * 272
cyc = cp.zeros(8, cp.int64); out = cp.zeros(128, cp.float32)
for sync in (0, 1):
    for v in range(4):
        for _ in range(2):
            fn((1,), (32,), (cp.int32(256), cp.int32(v), cp.int32(sync), cyc, out), shared_mem=4 * 24 * 272)
cp.cuda.runtime.deviceSynchronize()
c = cyc.get() / (256 * 8)
for sync in (0, 1):
    print(f"sync={sync}: cycles a slice: loads then chain {c[4*sync]:.1f}, interleaved {c[4*sync+1]:.1f}, "
          f"chain only {c[4*sync+2]:.1f}, chain then loads {c[4*sync+3]:.1f}", flush=True)
