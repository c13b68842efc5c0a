"""Batch invariance on the GPU (marked `gpu`): a row's bits never depend on the other rows of
its call, so a request's logits do not depend on who else is served or how its prompt is cut.

Kernel level, over random bf16 inputs with no zero:
* the decode GEMMs (kerncc's GEMV kernels, batch-invariant entries): at every m from 1 to 64,
  for n below and above 16384 (an lm_head, a gate_up) and n with a ragged last tile, each row of
  C is the bits of the m = 64 launch's row, and a row launched alone (m = 1, pointers moved to
  it) is too; the m = 64 result matches the numpy reference within bf16 rounding;
* the prefill GEMMs (split-free cuBLASLt algorithms, one a bucket of m, each its own): chunks
  of 1, 64, 512, 777 and 2048 rows give each row the 2048-row launch's bits;
* a GEMM site's path is fixed from the site, never from a launch's m.
End to end, on a small-but-wide example (gate_up and lm_head wider than 16384, so the old path
sent them to cuBLAS at every batch): 32 prompts of mixed lengths served together (all at once,
and arriving as others finish) give each prompt's alone tokens and logits bit for bit; prompts
chunked by 64, 512 and 2048 give the same bits; a bundle cut in two gives the whole's; seeded
sampling served together gives the alone draws.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from bundles import close_chains, cuda_chain, same_logits, whole_and_two
from test_gemv_cuda import BF16, close, random_bf16, reference

pytestmark = pytest.mark.gpu

EXTERN_NAMES = ("cublaslt_bf16_tn", "cublaslt_bf16_tn_acc", "cublas_bf16_tn_f32")
MAX_M = 64
# (n, k): the 16-warp kernels (n <= 2048), the 8-warp ones, a ragged tile and k off the fast
# path, and the wide shapes the old path sent to cuBLAS (gate_up, lm_head)
DECODE_SHAPES = [(2048, 2048), (4096, 2048), (100, 72), (16896, 512), (32000, 2048)]
PREFILL_SHAPES = [(4096, 2048), (12288, 2048), (2048, 6144), (16896, 512)]
CHUNKS = (1, 64, 512, 2048)


@pytest.fixture(scope="module")
def backend():
    from kerncc.runtime.backends.cuda import CudaBackend

    made = CudaBackend(0)
    yield made
    made.close()


class Operands:
    """A (rows x k), W (n x k) and C's start (rows x n) on the device for one extern."""

    def __init__(self, backend, name: str, rows: int, n: int, k: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.backend, self.name, self.rows, self.n, self.k = backend, name, rows, n, k
        self.a_host = random_bf16(rng, (rows, k), 1.0)
        self.w_host = random_bf16(rng, (n, k), 1.0 / np.sqrt(k))
        self.width = 4 if name.endswith("f32") else 2
        c0 = np.full(rows * n * self.width, 0xFF, np.uint8)  # NaN: unwritten shows
        if name.endswith("_acc"):
            c0[:] = random_bf16(rng, (rows * n,), 1.0).view(np.uint8)
        self.c0 = c0
        self.a = backend.allocate(self.a_host.nbytes)
        self.w = backend.allocate(self.w_host.nbytes)
        self.c = backend.allocate(c0.nbytes)
        backend.upload(self.a, 0, self.a_host.view(np.uint8).reshape(-1))
        backend.upload(self.w, 0, self.w_host.view(np.uint8).reshape(-1))

    def run(self, launch, m: int, first: int = 0) -> np.ndarray:
        """C's rows first..first + m - 1 after `launch(a, w, c, m)` over those rows alone."""
        b, row_c = self.backend, self.n * self.width
        b.upload(self.c, 0, self.c0)
        launch(self.a.ptr + first * self.k * 2, self.w.ptr, self.c.ptr + first * row_c, m)
        b.sync()
        out = b.download(self.c, 0, self.c0.nbytes).reshape(self.rows, row_c)
        start = self.c0.reshape(self.rows, row_c)
        assert (out[:first] == start[:first]).all() and \
            (out[first + m:] == start[first + m:]).all(), "rows outside the launch were written"
        return out[first:first + m]

    def free(self) -> None:
        for allocation in (self.a, self.w, self.c):
            self.backend.free(allocation)


def decode_launcher(backend, name: str, n: int, k: int):
    from kerncc.runtime.backends import gemv

    site = backend._gemv_site(name, invariant=True)
    assert site is not None, "the GEMV kernels did not load"

    def launch(a, w, c, m):
        assert gemv.invariant_usable(n, k, a, w, c)
        site(a, w, c, m, n, k, backend.stream_handle)
    return launch


@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "n{}k{}".format(*s))
def test_decode_gemm_rows_do_not_depend_on_m(backend, name, shape):
    n, k = shape
    ops = Operands(backend, name, MAX_M, n, k, seed=zlib.crc32(f"{name} {shape}".encode()))
    try:
        launch = decode_launcher(backend, name, n, k)
        full = ops.run(launch, MAX_M)
        want = reference(name, ops.a_host, ops.w_host, ops.c0, MAX_M, n, k)
        close(name, full.reshape(-1), want, MAX_M, n)
        rng = np.random.default_rng(n + k)
        for m in sorted({1, 2, 7, 8, 9, 16, 17, 24, 31, 32, 33, 40, 48, 63,
                         *rng.integers(1, MAX_M + 1, 4).tolist()}):
            got = ops.run(launch, m)
            assert got.tobytes() == full[:m].tobytes(), f"m={m}: rows differ from m={MAX_M}"
        # a row launched alone where its pointers keep the 16-byte alignment the kernels take
        # (a site's operands are arena buffers, aligned; a row offset into them may not be)
        aligned = [r for r in range(MAX_M) if not (r * k * 2) % 16 and not (r * n * ops.width) % 16]
        for row in rng.choice(aligned, 3, replace=False).tolist():
            alone = ops.run(launch, 1, first=row)
            assert alone.tobytes() == full[row:row + 1].tobytes(), f"row {row} alone differs"
    finally:
        ops.free()


@pytest.mark.parametrize("name", EXTERN_NAMES)
def test_the_warps_are_fixed_by_n_alone(name):
    """What fixes a row's bits (the warp count) comes from n; m picks only the blocks."""
    from kerncc.runtime.backends import gemv

    for n in (16, 2048, 2049, 4096, 16896, 151936):
        warps = {gemv.ENTRIES[gemv.invariant_entry(m, n)][0] for m in range(1, 200)}
        assert len(warps) == 1, n


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "n{}k{}".format(*s))
@pytest.mark.parametrize("name", EXTERN_NAMES)
def test_prefill_gemm_rows_do_not_depend_on_the_chunk(backend, name, shape):
    from kerncc.runtime.backends.cuda import _alignment

    n, k = shape
    if name != "cublaslt_bf16_tn" and shape != PREFILL_SHAPES[0]:
        pytest.skip("every extern at one shape, every shape in bf16")
    rows = max(CHUNKS)
    ops = Operands(backend, name, rows, n, k, seed=zlib.crc32(f"p {name} {shape}".encode()))
    try:
        pinned = backend._pinned_gemm(name, n, k, rows, _alignment(ops.a.ptr, ops.w.ptr, ops.c.ptr))
        assert pinned is not None, "cuBLASLt offered no split-free algorithm"
        algorithms = {bytes(pinned.algorithm(m)) for m in (*CHUNKS, 777)}
        assert len(algorithms) > 1, "the chunks ran one algorithm: the buckets went untested"

        def launch(a, w, c, m):
            pinned(a, w, c, m, int(backend.stream_handle))

        full = ops.run(launch, rows)
        assert np.isfinite(full.view(np.float32 if ops.width == 4 else BF16)
                           .astype(np.float32)).all()
        for m in (*CHUNKS[:-1], 777):
            got = ops.run(launch, m)
            assert got.tobytes() == full[:m].tobytes(), f"chunk {m}: rows differ from {rows}"
        head = 64  # against the reference on a slice (numpy time)
        want = reference(name, ops.a_host[:head], ops.w_host, ops.c0[:head * n * ops.width],
                         head, n, k)
        close(name, full[:head].reshape(-1), want, head, n, cublas=True)
    finally:
        ops.free()


def test_a_sites_path_is_fixed_by_the_site(backend):
    """Through the backend's own rewrite: m bounded by 32 takes the GEMV kernels at every m,
    m bounded by 2048 the pinned algorithm at every m (even m = 1); either way the rows of a
    small m are the big m's bits."""
    from kerncc.runtime.launch import Site, VarScalar

    n, k, name = 4096, 2048, "cublaslt_bf16_tn"
    ops = Operands(backend, name, 256, n, k, seed=5)
    try:
        for var, bound, path in (("seqs", 32, "gemv"), ("tokens", 2048, "pinned")):
            site = Site(number=1000 + bound, program="p", call=0, label=None, op="gemm",
                        launch=0, kind="extern", entry=f"extern:{name}", module=None,
                        block=(1, 1, 1), grid=(1, 1, 1), shared_mem=0, when=None,
                        args=(ops.a.ptr, ops.w.ptr, ops.c.ptr, VarScalar("i32", var), n, k))
            launcher = backend._invariant_extern(site, {var: bound})
            assert backend.gemm_paths[site.number] == path

            def launch(a, w, c, m, launcher=launcher):
                assert (a, w, c) == (ops.a.ptr, ops.w.ptr, ops.c.ptr)
                launcher((1, 1, 1), 0, (m,))

            top = min(bound, ops.rows)
            full = ops.run(launch, top)
            for m in (1, 3, top // 2):
                assert ops.run(launch, m).tobytes() == full[:m].tobytes(), (path, m)
    finally:
        ops.free()


def test_a_kernel_captured_after_a_pinned_gemm_overlaps_it_and_reads_its_rows(backend):
    """In a captured graph a kernel of ours right after a pinned cuBLASLt GEMM overlaps it
    (programmatic stream serialization: it waits in-kernel for the GEMM's grid), and still reads
    the rows the GEMM wrote: the graph's result is the one launched one by one, bit for bit."""
    from kerncc.runtime.backends.cuda import _alignment

    name, (n, k), rows, n2 = "cublaslt_bf16_tn", PREFILL_SHAPES[0], 64, 1024
    first = Operands(backend, name, rows, n, k, seed=11)
    second = Operands(backend, name, rows, n2, n, seed=12)  # its A: the first's C
    try:
        pinned = backend._pinned_gemm(name, n, k, rows,
                                      _alignment(first.a.ptr, first.w.ptr, first.c.ptr))
        assert pinned is not None, "cuBLASLt offered no split-free algorithm"
        gemv = backend._gemv_site(name, invariant=True)
        behind = []

        def issue():
            stream = backend._launch_stream
            pinned(first.a.ptr, first.w.ptr, first.c.ptr, rows, int(stream))
            behind.append(backend._one_kernel_behind())
            gemv(first.c.ptr, second.w.ptr, second.c.ptr, rows, n2, n, stream,
                 backend.capturing and behind[-1])

        for c, c0 in ((first.c, first.c0), (second.c, second.c0)):
            backend.upload(c, 0, c0)
        issue()  # one by one: nothing to overlap
        backend.sync()
        want = backend.download(second.c, 0, second.c0.nbytes)
        assert behind == [False]
        backend.upload(first.c, 0, first.c0)  # NaN: a read before the GEMM's write shows
        backend.upload(second.c, 0, second.c0)
        graph = backend.capture(issue)
        assert behind == [False, True], "the GEMM left no single kernel node to overlap"
        for _ in range(3):
            backend.upload(first.c, 0, first.c0)
            backend.replay(graph)
            backend.sync()
            got = backend.download(second.c, 0, second.c0.nbytes)
            assert got.tobytes() == want.tobytes()
        assert np.isfinite(want.view(BF16).astype(np.float32)).all()
    finally:
        first.free()
        second.free()


@pytest.mark.parametrize("shape", ["n", "k"])
@pytest.mark.parametrize("name", EXTERN_NAMES)
def test_a_wide_decode_site_gives_the_prefill_sites_bits(backend, name, shape):
    """A decode site (m bounded by 64) at least gemv.LT_MIN_N wide or gemv.LT_MIN_K deep takes
    the pinned split-free cuBLASLt algorithms at every m, like a prefill site (m bounded by
    2048) of the same shape: each row of any m equals that row launched alone, and the prefill
    site's row, bit for bit (a decode step's GEMM rows there are the prefill chunk's)."""
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.launch import Site, VarScalar

    n, k = (gemv.LT_MIN_N + 256, 2048) if shape == "n" else (1024, gemv.LT_MIN_K)
    assert gemv.takes_lt(n, k)
    ops = Operands(backend, name, 256, n, k, seed=zlib.crc32(f"wide {name} {shape}".encode()))
    try:
        launchers = {}
        for var, bound in (("seqs", gemv.DECODE_MAX_M), ("tokens", 2048)):
            site = Site(number=2000 + bound, program="p", call=0, label=None, op="gemm",
                        launch=0, kind="extern", entry=f"extern:{name}", module=None,
                        block=(1, 1, 1), grid=(1, 1, 1), shared_mem=0, when=None,
                        args=(ops.a.ptr, ops.w.ptr, ops.c.ptr, VarScalar("i32", var), n, k))
            launchers[var] = backend._invariant_extern(site, {var: bound})
            assert backend.gemm_paths[site.number] == "pinned", var

        def run(var, m):
            return ops.run(lambda a, w, c, m: launchers[var]((1, 1, 1), 0, (m,)), m)

        chunk = run("tokens", 256)
        assert np.isfinite(chunk.view(np.float32 if ops.width == 4 else BF16)
                           .astype(np.float32)).all()
        for m in (1, 5, 8, 9, 32, 33, 64):
            got = run("seqs", m)
            assert got.tobytes() == chunk[:m].tobytes(), f"m={m}: decode rows differ from prefill"
        head = 16
        want = reference(name, ops.a_host[:head], ops.w_host, ops.c0[:head * n * ops.width],
                         head, n, k)
        close(name, chunk[:head].reshape(-1), want, head, n, cublas=True)
    finally:
        ops.free()


# ---- end to end ------------------------------------------------------------------------------

# small, but with a gate_up (2 x 8448) and an lm_head (20000) wider than 16384
WIDE = {"layers": 2, "hidden": 512, "heads": 4, "kv_heads": 2, "head_dim": 128,
        "intermediate": 8448, "vocab": 20000, "max_tokens": 2048, "max_seqs": 32,
        "max_context": 1024}
PROMPTS = 32
MAX_NEW = 6


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    return whole_and_two(tmp_path_factory.mktemp("wide"), "tiny", **WIDE)


@pytest.fixture(scope="module")
def chains(bundles):
    made = {name: cuda_chain(path) for name, path in bundles.items()}
    yield made
    close_chains(*made.values())


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, count)
    lengths[:3] = (1, 64, 650)  # one token, one chunk exactly, several chunks
    return [rng.integers(3, WIDE["vocab"], int(n)).tolist() for n in lengths]


def served(chain, batch, chunk: int = 512, max_running: int | None = None, params=None,
           prefix_cache: bool = True):
    """(tokens, stacked logits) of each prompt served together through the engine."""
    from kerncc.serve.engine import serve_prompts
    from kerncc.serve.sampling_hook import Params

    done, _ = serve_prompts(chain, batch, MAX_NEW, chunk=chunk, max_running=max_running,
                            logits=True, params=params or Params(), prefix_cache=prefix_cache)
    return [(r.generated, np.stack(r.logits)) for r in done]


def same(got, want) -> None:
    assert len(got) == len(want)
    for i, ((tokens, logits), (tokens2, logits2)) in enumerate(zip(got, want)):
        assert np.abs(logits).max() > 0
        assert tokens == tokens2, f"prompt {i}: tokens differ"
        same_logits(logits, logits2)


def test_the_wide_example_takes_the_invariant_paths(chains):
    paths = set()
    for session in chains["whole"].sessions:
        paths |= set(session.backend.gemm_paths.values())
    assert paths == {"gemv", "pinned"}, paths


def test_prompts_served_together_equal_each_alone(chains):
    batch = prompts(PROMPTS, seed=1)
    alone = [served(chains["whole"], [p])[0] for p in batch]
    same(served(chains["whole"], batch), alone)  # every prompt at once
    same(served(chains["whole"], batch, max_running=5), alone)  # arriving as others finish


def test_the_chunk_size_does_not_change_the_bits(chains):
    batch = prompts(4, seed=2)
    want = served(chains["whole"], batch, chunk=2048)
    for chunk in (64, 512):
        same(served(chains["whole"], batch, chunk=chunk), want)


def test_cut_equals_whole_served_together(chains):
    batch = prompts(8, seed=3)
    same(served(chains["two"], batch), served(chains["whole"], batch))


def test_seeded_sampling_served_together_equals_alone(chains):
    from kerncc.serve.sampling_hook import Params

    params = Params(0.9, 0, 1.0, 1234)
    batch = prompts(8, seed=4)
    alone = [served(chains["whole"], [p], params=params)[0] for p in batch]
    same(served(chains["whole"], batch, params=params), alone)


def test_the_prefix_cache_does_not_change_the_bits(chains):
    """Prompts sharing a 600-token prefix, arriving as others finish (so later ones find its
    pages cached and prefill only the rest): the bits of the cache off, prompt by prompt."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, WIDE["vocab"], 600).tolist()
    batch = [shared + rng.integers(3, WIDE["vocab"], int(n)).tolist()
             for n in rng.integers(1, 90, 8)]
    from kerncc.serve.engine import serve_prompts

    for cut in ("whole", "two"):
        done, engine = serve_prompts(chains[cut], batch, MAX_NEW, chunk=512, max_running=2,
                                     logits=True)
        assert engine.prefix.hit >= 600 * 5, "later prompts found the shared pages"
        same([(r.generated, np.stack(r.logits)) for r in done],
             served(chains[cut], batch, max_running=2, prefix_cache=False))


def test_past_64_sequences_a_decode_steps_gemms_keep_the_alone_path(tmp_path):
    """A decode_batch bound past gemv.DECODE_MAX_M (`--max-seqs 72`) leaves each of its GEMM
    sites on the batch-1 decode's path (the GEMV kernels, or cuBLASLt where `takes_lt`), so 40
    prompts decoded together give the first four prompts' alone tokens and logits."""
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.launch import VarScalar

    bundle = whole_and_two(tmp_path, "tiny", **{**WIDE, "max_seqs": 72})["whole"]
    chain = cuda_chain(bundle)
    try:
        for session in chain.sessions:
            for program in ("decode", "decode_batch"):
                for site in session.sites.get(program, ()):
                    if site.kind != "extern":
                        continue
                    n, k = site.args[4], site.args[5]
                    assert not isinstance(n, VarScalar) and not isinstance(k, VarScalar)
                    want = "pinned" if gemv.takes_lt(int(n), int(k)) else "gemv"
                    assert session.backend.gemm_paths[site.number] == want, (program, n, k)
        batch = [p[:40] for p in prompts(40, seed=6)]
        alone = [served(chain, [p])[0] for p in batch[:4]]
        same(served(chain, batch)[:4], alone)
    finally:
        close_chains(chain)
