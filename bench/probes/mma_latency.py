import cupy as cp
mod = cp.RawModule(path=".gpu/lat.cubin")
fn = mod.get_function("lat")
for threads in (32, 128):
    for iters in (256, 1024):
        out = cp.zeros(128, cp.float32); cyc = cp.zeros(8, cp.int64)
        for _ in range(2):
            fn((1,), (threads,), (cp.int32(iters), out, cyc, cp.uint32(12345)))
        cp.cuda.runtime.deviceSynchronize()
        c = cyc.get()
        print(f"threads={threads} iters={iters}: mma chain {c[0]/iters:.1f} cyc/step, two chains {c[1]/iters:.1f} /pair, "
              f"lds+mma {c[2]/iters:.1f}, wgmma n8 chain {c[3]/iters:.1f}, wgmma wait-each {c[4]/iters:.1f}")
