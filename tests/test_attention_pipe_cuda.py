"""The pipelined split attention on the GPU (marked `gpu`: skipped without a CUDA driver).

kernels/attention.cu `attn_decode_split_pipe_tc_bf16` must write the partials of
`attn_decode_split_tc_bf16` bit for bit, and only those (runtime/backends/attention_pipe.py
launches it in the split kernel's place). Kernel level: every head dim (32, 64, 96, 128) and
group (1, 2, 4, 8) the kernel takes, sequences of 0, 1, 127, 128, 129, 300, 515 and 1000 keys in
one batch over a shuffled page table (entries past a sequence point far outside the KV, so a
read of one faults), random q and KV with no zero, and Z = 1, 2, 3 and max_splits blocks a
(sequence, kv head): the partials buffer, filled first with a NaN pattern so that entries left
unwritten compare too, equals the split kernel's, word for word; long sequences (36 splits at
Z = 1) make a block loop over many more splits than its ring has slots and refill its
page-table register. Whole models: the batched decode (`decode_batch`, through the serving
engine) with the switch on and off gives the same tokens and logits bit for bit, eagerly and in
CUDA graphs, whole and in 2 stages, for the `small` example's attention shape (16 q / 8 kv
heads of 128) and a smaller one.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from bundles import close_chains, cuda_chain, same_generations, same_served, whole_and_two
from gpu_driver import Gpu

from kerncc.runtime.backends import attention_pipe as pipe

pytestmark = pytest.mark.gpu

MODULE, SPLIT, PIPE = pipe.MODULE, pipe.SPLIT, pipe.ENTRY
PAGE, KEYS = 16, 128  # kv slots a page-table entry; keys a split (DC_SPLIT)
NAN = 0x7FBADBAD  # the partials' fill: a NaN no kernel writes
LENS = [0, 1, 127, 128, 129, 300, 515, 1000]
LONG_LENS = [4500, 1, 2100, 129]  # 36 splits: more than the 32 page entries a register holds


@pytest.fixture(scope="module")
def gpu():
    made = Gpu()
    made.allow_shared(MODULE, PIPE, pipe.MAX_SHARED)
    yield made
    made.close()


def bf16_nonzero(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0):
    """Random bf16 bit patterns (round to nearest even) with no zero of either sign."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    bits[(bits & 0x7FFF) == 0] = 0x3F80  # 1.0
    return bits


def make_case(hd: int, nq: int, nk: int, lens: list[int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + 31 * hd + 7 * nq + nk + sum(lens))
    seqs = len(lens)
    max_splits = -(-max(lens) // KEYS) + 1
    width = max_splits * KEYS // PAGE
    used = [-(-n // PAGE) for n in lens]
    pages = sum(used) + 5
    table = np.full((seqs, width), 1 << 29, np.int32)  # past a sequence: far outside the KV
    perm = rng.permutation(pages)
    for b, n in enumerate(used):
        table[b, :n] = perm[sum(used[:b]): sum(used[:b]) + n]
    return {"hd": hd, "nq": nq, "nk": nk, "seqs": seqs, "width": width, "splits": max_splits,
            "qkv": bf16_nonzero(rng, (seqs, (nq + 2 * nk) * hd), 2.0),
            "kv": bf16_nonzero(rng, (pages * PAGE, 2 * nk * hd)), "table": table,
            "lens": np.array(lens, np.int32), "scale": 1 / math.sqrt(hd)}


def launch(gpu: Gpu, entry: str, grid: tuple[int, int, int], args: list, shared: int) -> None:
    slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
    table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
    gpu.check(gpu.cu.cuLaunchKernel(gpu.function(MODULE, entry), *grid, 256, 1, 1, shared, 0,
                                    ctypes.addressof(table), 0))


def partials(gpu: Gpu, c: dict, entry: str, z: int, repeats: int = 1) -> list[np.ndarray]:
    """The partials buffer (as u32 words) after each of `repeats` launches of `entry` with grid
    (seqs, nk, z), over a buffer filled with NAN once."""
    i32 = ctypes.c_int32
    fill = np.full((c["seqs"], c["nq"], c["splits"], c["hd"] + 2), NAN, np.uint32)
    ptrs = [gpu.upload(c[k]) for k in ("qkv", "kv", "table", "lens")]
    part = gpu.upload(fill)
    args = ptrs + [part, i32(c["seqs"]), i32(c["nq"]), i32(c["nk"]), i32(c["hd"]),
                   i32(c["width"]), i32(c["splits"]), ctypes.c_float(c["scale"])]
    shared = pipe.shared_bytes(c["hd"], c["nq"] // c["nk"]) if entry == PIPE else 0
    out = []
    for _ in range(repeats):
        launch(gpu, entry, (c["seqs"], c["nk"], z), args, shared)
        out.append(gpu.download(part, fill))
    for ptr in (*ptrs, part):
        gpu.check(gpu.cu.cuMemFree(gpu.cu.CUdeviceptr(ptr)))
        gpu.ptrs.remove(ptr)
    return out


def check_same(gpu: Gpu, c: dict, zs) -> None:
    (want,) = partials(gpu, c, SPLIT, c["splits"])  # a block per split
    written = want != NAN
    for b, n in enumerate(c["lens"]):  # exactly the entries of each sequence's splits
        splits = min(-(-int(n) // KEYS), c["splits"]) if n > 0 else 0
        assert written[b, :, :splits].all() and not written[b, :, splits:].any(), (b, n)
    assert written.any()
    for z in zs:
        first, second = partials(gpu, c, PIPE, z, repeats=2)
        np.testing.assert_array_equal(first, want, err_msg=f"Z = {z}")
        np.testing.assert_array_equal(second, want, err_msg=f"Z = {z}, a second launch")


@pytest.mark.parametrize("hd", [32, 64, 96, 128])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_the_pipelined_kernel_writes_the_split_kernels_partials(gpu, hd, g):
    c = make_case(hd, 2 * g, 2, LENS)
    assert c["splits"] == 9
    check_same(gpu, c, (1, 2, 3, c["splits"]))


@pytest.mark.parametrize("hd,nq,nk", [(128, 16, 8), (64, 16, 2), (96, 8, 8), (128, 32, 4)])
def test_blocks_that_loop_over_more_splits_than_their_ring(gpu, hd, nq, nk):
    """36 splits at Z = 1: 72 tiles through a ring of 3 to 6 slots, the page-table register
    refilled past 32 splits; Z = 2 and 5 loop too."""
    c = make_case(hd, nq, nk, LONG_LENS)
    assert c["splits"] == 37
    check_same(gpu, c, (1, 2, 5, c["splits"]))


def test_the_benchmarks_shape(gpu):
    """The `small` model's decode_batch at 32 sequences of 512 keys: Z = 1 (what the backend
    takes on 132 multiprocessors), 2 and the manifest's 8."""
    c = make_case(128, 16, 8, [512] * 31 + [509])
    check_same(gpu, c, (1, 2, 8))


# ---- whole models ---------------------------------------------------------------------------

MODELS = {
    # the small example's attention (16 q / 8 kv heads of 128: G 2, 32 splits) on 2 layers
    "small": ("small", {"layers": 2}),
    "tensor-cores": ("tiny", {"hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 128,
                              "intermediate": 512, "max_context": 2048, "max_seqs": 8}),
}
LONG = [(i * 29) % 250 + 1 for i in range(1100)]  # 9 splits: past decode_batch's 8 blocks


_BUILT: dict[str, dict] = {}


def built(name: str, tmp_path_factory) -> dict:
    """MODELS[name] lowered whole and in 2 stages, once per test session."""
    if name not in _BUILT:
        size, overrides = MODELS[name]
        _BUILT[name] = whole_and_two(tmp_path_factory.mktemp(name), size, **overrides)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(MODELS))
def bundles(request, tmp_path_factory) -> dict:
    return built(request.param, tmp_path_factory)


def prompts_for(running: int) -> list[list[int]]:
    prompts = [[(i * (13 + s)) % 251 + 1 for i in range(9 + 37 * s)] for s in range(running - 1)]
    return prompts + [LONG]


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("bundle", ["whole", "two"])
@pytest.mark.parametrize("running", [3, 8])
def test_the_batched_decode_gives_the_split_kernels_bits(bundles, bundle, graphs, running):
    on, off = (cuda_chain(bundles[bundle], graphs, pipe_attention=flag, pipe_columns=1)
               for flag in (True, False))
    try:
        same_served(on, off, prompts_for(running))
        assert on.backend.piped > 0, "the batched decode's split went out pipelined"
        assert off.backend.piped == 0
    finally:
        close_chains(on, off)


def test_the_decode_program_keeps_the_split_kernel(bundles):
    """`decode` (a block per split) has nothing to pipeline: it goes out as prepared."""
    on, off = (cuda_chain(bundles["whole"], pipe_attention=flag, pipe_columns=1)
               for flag in (True, False))
    try:
        same_generations(on, off, [[7], LONG])
        assert on.backend.piped == 0
    finally:
        close_chains(on, off)


def test_32_sequences_walk_all_their_splits_in_one_block(tmp_path_factory):
    """The benchmark's case: 32 prompts of about 520 tokens served together in the small
    model's shape. As they join and leave the batch the batched steps run every Z from 8 down
    to 1 (one block a (sequence, kv head) walking its 5 splits from 17 sequences on); the
    threshold is lowered because the engine's batch is rarely above 17 sequences for long."""
    bundle = built("small", tmp_path_factory)["whole"]
    prompts = [[(i * (7 + s)) % 31000 + 1 for i in range(500 + s)] for s in range(32)]
    on, off = (cuda_chain(bundle, pipe_attention=flag, pipe_columns=1)
               for flag in (True, False))
    try:
        same_served(on, off, prompts, max_new=4, chunk=512)
        assert on.backend.piped > 0
    finally:
        close_chains(on, off)


# ---- kernel times (python tests/test_attention_pipe_cuda.py) --------------------------------


def kernel_us(gpu: Gpu, entry: str, seqs: int, keys: int, z: int, copies: int = 4,
              repeats: int = 40) -> float:
    """Microseconds a launch of `entry` takes at the `small` model's shape (16 q / 8 kv heads
    of 128, max_splits 32) for `seqs` sequences of `keys` keys, with grid z `z`: events around
    back-to-back launches that rotate over `copies` copies of the KV (so the L2 does not
    hold it)."""
    cu = gpu.cu
    c = make_case(128, 16, 8, [keys] * seqs)
    c["splits"] = 32
    i32 = ctypes.c_int32
    kvs = [gpu.upload(c["kv"]) for _ in range(copies)]
    qkv, table, lens = (gpu.upload(c[k]) for k in ("qkv", "table", "lens"))
    part = gpu.upload(np.zeros((seqs, 16, 32, 130), np.float32))
    shared = pipe.shared_bytes(128, 2) if entry == PIPE else 0
    argsets = [[qkv, kv, table, lens, part, i32(seqs), i32(16), i32(8), i32(128),
                i32(c["width"]), i32(32), ctypes.c_float(c["scale"])] for kv in kvs]
    for args in argsets:
        launch(gpu, entry, (seqs, 8, z), args, shared)
    a, b = gpu.check(cu.cuEventCreate(0)), gpu.check(cu.cuEventCreate(0))
    gpu.check(cu.cuEventRecord(a, 0))
    for r in range(repeats):
        launch(gpu, entry, (seqs, 8, z), argsets[r % copies], shared)
    gpu.check(cu.cuEventRecord(b, 0))
    gpu.check(cu.cuEventSynchronize(b))
    ms = gpu.check(cu.cuEventElapsedTime(a, b))
    for ptr in (*kvs, qkv, table, lens, part):
        gpu.check(cu.cuMemFree(cu.CUdeviceptr(ptr)))
        gpu.ptrs.remove(ptr)
    return ms * 1e3 / repeats


if __name__ == "__main__":
    g = Gpu()
    g.allow_shared(MODULE, PIPE, pipe.MAX_SHARED)
    attribute = g.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    sms = g.check(g.cu.cuDeviceGetAttribute(attribute, g.check(g.cu.cuDeviceGet(0))))
    for seqs, keys in ((32, 512), (8, 512), (1, 512), (8, 2048), (1, 4096)):
        kv_bytes = seqs * keys * 2 * 8 * 128 * 2
        rule = pipe.blocks((seqs, 8, 8), sms)
        times = {"split Z=8": kernel_us(g, SPLIT, seqs, keys, 8)}
        for z in sorted({rule, 1, 2, 4, 8}):
            times[f"pipe Z={z}{' (rule)' if z == rule else ''}"] = kernel_us(g, PIPE, seqs,
                                                                          keys, z)
        print(f"{seqs} x {keys} keys ({kv_bytes / 1e6:.1f} MB of KV): " + ", ".join(
            f"{k} {us:.1f} us ({kv_bytes / us / 1e6:.2f} TB/s)" for k, us in times.items()),
            flush=True)
    g.close()
