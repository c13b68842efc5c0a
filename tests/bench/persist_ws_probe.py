"""Where persist_ws_bf16's time goes (kernels/persist.cu, runtime/backends/persist.py): one decode
layer of the `small` example (o_proj; add_rmsnorm + gate_up; silu_mul + down; rmsnorm + qkv:
100.7 MB of weights at m = 1) as one launch of the kernel, and its parts, each launched REPS
times back to back between two events (so a launch's ramp and drain count, as between the
attention launches of a step), side by side in one run:

    python tests/bench/persist_ws_probe.py [--reps 50] [--rounds 3]

Rows: the layer as planned (narrow 8-warp tiles where the GEMV launches use them, so the
launches' bits), the same with every GEMV in 16-warp tiles, the layer with no dependencies
(every x an input: the stream and the launch alone), and each GEMV alone; each as us a launch
and TB/s of its weight bytes.
"""

from __future__ import annotations

import argparse
import statistics

import attrs
import numpy as np

from kerncc.runtime.backends import persist
from kerncc.runtime.backends.cuda import CudaBackend

H, INTER, QKV = 2048, 6144, 4096
EPS = 1e-6


def gemv_phase(kind, a, w, c, n, k, wide=False):
    p = persist.gemm_phase(kind, a, w, c, 1, n, k)
    assert p is not None, (n, k)
    return attrs.evolve(p, warps=16, tasks=n // 16) if wide else p


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    backend = CudaBackend(0)
    backend.persist = persist.WS_ENTRY
    kernel = backend._persistent_kernel()
    assert isinstance(kernel, persist.WsKernel), "no persist cubin"
    rng = np.random.default_rng(0)

    def buffer(elements, fill=True):
        a = backend.allocate(2 * elements)
        if fill:
            data = (rng.standard_normal(elements, np.float32) * 0.05).astype(np.float32)
            backend.upload(a, 0, (data.view(np.uint32) >> 16).astype(np.uint16))
        return a.ptr

    w = {"o": buffer(H * H), "gate_up": buffer(2 * INTER * H), "down": buffer(H * INTER),
         "qkv": buffer(QKV * H), "post": buffer(H), "input": buffer(H)}
    attn, o_out, residual, normed = buffer(H), buffer(H, False), buffer(H), buffer(H, False)
    gate_up, act, qkv = buffer(2 * INTER, False), buffer(INTER, False), buffer(QKV, False)
    inputs = {n: buffer(k) for n, k in (("gate_up", H), ("down", INTER), ("qkv", H))}

    def layer(wide=False, independent=False):
        G, A = persist.GEMV, persist.GEMV_ACC
        norm = dict(threads=256, eps=EPS)
        if independent:  # every x an input of the launch: nothing waits
            return [gemv_phase(G, attn, w["o"], o_out, H, H, wide),
                    gemv_phase(G, inputs["gate_up"], w["gate_up"], gate_up, 2 * INTER, H, wide),
                    gemv_phase(A, inputs["down"], w["down"], residual, H, INTER, wide),
                    gemv_phase(G, inputs["qkv"], w["qkv"], qkv, QKV, H, wide)]
        return [
            gemv_phase(G, attn, w["o"], o_out, H, H, wide),
            persist.Phase(persist.ADD_RMSNORM, 1, 1, H, pointers=(residual, o_out, w["post"],
                                                                   normed), **norm),
            gemv_phase(G, normed, w["gate_up"], gate_up, 2 * INTER, H, wide),
            persist.Phase(persist.SILU_MUL, 48, 1, INTER, k=INTER, threads=256,
                          pointers=(gate_up, act, 0, 0)),
            gemv_phase(A, act, w["down"], residual, H, INTER, wide),
            persist.Phase(persist.RMSNORM, 1, 1, H, pointers=(residual, w["input"], normed, 0),
                          **norm),
            gemv_phase(G, normed, w["qkv"], qkv, QKV, H, wide)]

    def alone(name):
        G = persist.GEMV
        shapes = {"o_proj": (attn, w["o"], o_out, H, H),
                  "gate_up (narrow)": (inputs["gate_up"], w["gate_up"], gate_up, 2 * INTER, H),
                  "down": (inputs["down"], w["down"], residual, H, INTER),
                  "qkv (narrow)": (inputs["qkv"], w["qkv"], qkv, QKV, H)}
        return [gemv_phase(G, *shapes[name])]

    cases = {"layer, as planned": layer(), "layer, 16-warp tiles": layer(wide=True),
             "layer, no dependencies": layer(independent=True),
             "layer, no dependencies, 16-warp tiles": layer(wide=True, independent=True),
             **{f"{n} alone": alone(n) for n in ("o_proj", "gate_up (narrow)", "down",
                                                  "qkv (narrow)")}}
    plans = {}
    for name, phases in cases.items():
        steps = kernel.steps(phases)
        assert len(steps) == 1 and not isinstance(steps[0], int), (name, steps)
        plans[name] = steps[0]
    weights = {name: sum(2 * p.n * p.k for p in ph if p.kind <= persist.GEMV_ACC)
               for name, ph in cases.items()}
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = list(plans) if r % 2 == 0 else list(plans)[::-1]
        for name in order:
            for _ in range(5):
                kernel.launch(*plans[name])
            start = backend.mark()
            for _ in range(args.reps):
                kernel.launch(*plans[name])
            times.setdefault(name, []).append(backend.elapsed_ms(start, backend.mark())
                                              * 1e3 / args.reps)
    print(f"persist_ws_bf16 on {backend.describe()}, {args.reps} launches a round, "
          f"median of {args.rounds}; stages {plans['layer, as planned'][1]}")
    print("| launch | us a launch | TB/s of its weights |\n| --- | ---: | ---: |")
    for name in plans:
        us = statistics.median(times[name])
        print(f"| {name} | {us:.1f} | {weights[name] / us / 1e6:.2f} |")
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
