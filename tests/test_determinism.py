"""Batch invariance, what can be checked without a GPU: the cuda backend's GEMM policy fixes what
decides a row's bits from the site alone, and every response names the system that computed it.

(The cpu backend's served-together == alone, under random arrivals, chunk sizes and packing, is
tests/test_serve_engine_properties.py; the GPU's is tests/test_determinism_cuda.py.)
"""

from __future__ import annotations

import httpx
import pytest
from serving import serving

from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.runtime.backends import gemv
from kerncc.runtime.backends.fingerprint import of_runner, system_fingerprint


@pytest.mark.parametrize("n", [16, 2000, 2048, 2049, 4096, 16384, 16896, 151936])
def test_the_warps_of_a_decode_gemm_come_from_n_alone(n):
    """The warp count (which fixes the chunks a warp sums and the order of the warps' sum) is
    the same at every m; m picks only the blocks' shape, which does not change a row's bits."""
    entries = {gemv.invariant_entry(m, n) for m in range(1, 129)}
    assert len({gemv.ENTRIES[e][0] for e in entries}) == 1
    assert all(e in gemv.ENTRIES for e in entries)


@pytest.mark.parametrize("name, n, k, lt", [
    ("small qkv", 4096, 2048, False), ("small o", 2048, 2048, False),
    ("small gate_up", 12288, 2048, True), ("small down", 2048, 6144, False),
    ("small lm_head", 32000, 2048, True), ("8b qkv", 6144, 4096, False),
    ("8b o", 4096, 4096, False), ("8b gate_up", 24576, 4096, True),
    ("8b down", 4096, 12288, True), ("8b lm_head", 151936, 4096, True)])
def test_the_wide_decode_sites_take_cublaslt_and_the_narrow_ones_the_gemv(name, n, k, lt):
    """The decode sites' path by shape at the models' shapes (bench.gemv's): the gate_up and
    lm_head (wide) and the 8B down (deep) on the pinned split-free cuBLASLt algorithms, the
    rest on the GEMV kernels."""
    assert gemv.takes_lt(n, k) is lt, name


@pytest.mark.parametrize("m, n", [(1, 16), (8, 4096), (9, 4096), (32, 2048), (33, 2048),
                                  (64, 16896), (65, 151936), (200, 100)])
def test_every_row_and_every_w_row_is_covered_once(m, n):
    entry = gemv.invariant_entry(m, n)
    _, mb, t = gemv.ENTRIES[entry]
    groups = -(-m // (8 * mb))
    blocks = gemv.grid_for(entry, m, n)
    assert blocks == groups * -(-n // (16 * t))
    assert groups * 8 * mb >= m > (groups - 1) * 8 * mb  # the last group is not empty
    assert blocks * 16 * t // groups >= n


@pytest.mark.parametrize("n", [2064, 4096, 6144, 12288, 16384, 24576, 151936])
def test_past_16_rows_the_8_warp_shapes_take_the_shared_memory_entries(n):
    """Where W has more tiles than the 16-warp entries take, 33 to 64 rows go to the entries
    that read A once for 4 W tiles (64 rows of A a block from SMEM_N up, 32 below); 17 to 32
    rows to mb4_t4_smem from SMEM_N up; every one keeps the 8-warp bits."""
    wide = n >= gemv.SMEM_N
    for m in range(33, gemv.DECODE_MAX_M + 1):
        assert gemv.invariant_entry(m, n) == ("gemv_bf16_tn_mb8_t4_smem" if wide
                                              else "gemv_bf16_tn_mb4_t4_smem")
    for m in range(17, 33):
        entry = gemv.invariant_entry(m, n)
        assert (entry == "gemv_bf16_tn_mb4_t4_smem") == wide, (m, entry)
    for m in range(1, 17):
        assert gemv.invariant_entry(m, n) not in gemv.SHARED
    assert gemv.invariant_entry(64, 2048) not in gemv.SHARED  # the 16-warp shapes keep theirs


@pytest.mark.parametrize("n", [2064, 4096, 4104, 6144, 12288])
def test_past_64_rows_the_narrower_8_warp_shapes_take_the_64_row_entry_where_it_fills_a_wave(n):
    """65 to 128 rows (the decode steps past 64 sequences) on the 8-warp shapes below SMEM_N:
    the 64-row shared-memory entry up to ONE_WAVE_N (two row groups of n / 64 blocks), the
    32-row one above; both keep the 8-warp bits."""
    want = ("gemv_bf16_tn_mb8_t4_smem" if n <= gemv.ONE_WAVE_N
            else "gemv_bf16_tn_mb4_t4_smem")
    for m in (65, 96, 128):
        assert gemv.invariant_entry(m, n) == want, (m, n)
    assert gemv.invariant_entry(64, n) == "gemv_bf16_tn_mb4_t4_smem"


def test_the_shared_memory_entries_say_how_much_they_need():
    """gemv.SHARED is what gemv_smem_tile<MB, T, 8 warps, 3 slots> takes: 8 * 3 * (8 MB + 16 T)
    rows of 64 bytes, more than a launch gets unasked and within an sm_90 block's 227 KB."""
    for entry, nbytes in gemv.SHARED.items():
        threads, mb, t = gemv.ENTRIES[entry]
        if entry == gemv.SEQ_ENTRY:  # gemv_seq_tile<1, 8 slots, 4 warps>: 24 rows of 272 bytes
            assert (threads, mb, t, nbytes) == (128, 1, 1, 8 * 24 * 272)
            continue
        assert threads == gemv.ENTRIES[gemv.NARROW_ENTRY][0] == 256
        assert nbytes == (threads // 32) * 3 * (8 * mb + 16 * t) * 64
        assert 48 * 1024 < nbytes <= 227 * 1024


def test_a_launch_asks_for_its_entrys_shared_memory(monkeypatch):
    """GemvSite.launch sets the grid, threads and dynamic shared memory of the entry it is
    given (no driver: cuLaunchKernelEx is recorded)."""
    pytest.importorskip("cuda.bindings")
    seen = []
    monkeypatch.setattr(gemv.cu, "cuLaunchKernelEx", lambda config, fn, params, extra: seen.append(
        (fn, config.gridDimX, config.blockDimX, config.sharedMemBytes)))

    class Fake:
        functions = {name: name for name in gemv.ENTRIES}

        @staticmethod
        def _check(result, what):
            return result

    site = gemv.GemvSite(Fake(), mode=0, invariant=True)
    site(0, 0, 0, 64, 4096, 4096, None)
    site(0, 0, 0, 8, 4096, 4096, None)
    site.launch("gemv_bf16_tn_mb8_t4_smem", 0, 0, 0, 40, 1000, 64, None)
    assert seen == [("gemv_bf16_tn_mb4_t4_smem", 128, 256, gemv.SHARED["gemv_bf16_tn_mb4_t4_smem"]),
                    (gemv.NARROW_ENTRY, 256, 256, 0),
                    ("gemv_bf16_tn_mb8_t4_smem", 16, 256, gemv.SHARED["gemv_bf16_tn_mb8_t4_smem"])]


def test_a_sites_path_is_a_property_of_the_site():
    """The shape test behind the GEMV path reads no m."""
    assert gemv.invariant_usable(16896, 512, 0, 256, 512)
    assert not gemv.invariant_usable(64, 60, 0, 0, 0)  # k % 8
    assert not gemv.invariant_usable(64, 64, 8, 0, 0)  # A not 16-byte aligned


def test_the_largest_m_of_a_site_comes_from_the_vars_bounds():
    pytest.importorskip("cuda.bindings")
    from kerncc.runtime.backends.cuda import _alignment, _max_value
    from kerncc.runtime.launch import VarScalar

    assert _max_value(7, {}) == 7
    assert _max_value(VarScalar("i32", "seqs"), {"seqs": 32, "tokens": 2048}) == 32
    assert _max_value(VarScalar("i32", "tokens"), {"seqs": 32}) is None  # unbound: unknown
    assert _alignment(0x1000, 0x2000) == 256 and _alignment(0x1010, 0x2000) == 16


def test_the_fingerprint_names_bundle_library_and_device():
    index = {"stages": [{"sha256": "a" * 64}]}
    base = system_fingerprint(index, ["NVIDIA H100 (sm_90)"])
    assert base.startswith("fp_") and len(base) == 19
    assert base == system_fingerprint(dict(index), ["NVIDIA H100 (sm_90)"])
    assert base != system_fingerprint({"stages": [{"sha256": "b" * 64}]}, ["NVIDIA H100 (sm_90)"])
    assert base != system_fingerprint(index, ["NVIDIA H200 (sm_90)"])


def test_every_response_carries_the_system_fingerprint(tmp_path):
    model, _ = generate(tmp_path / "model", "tiny")
    chain = Chain(lower_to_bundle(model), backend="cpu")
    want = of_runner(chain)
    with serving(chain, "tiny") as (url, _):
        seen = set()
        for stream in (False, True):
            answer = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream})
            assert answer.status_code == 200
            if stream:
                chunks = [line.removeprefix("data: ") for line in answer.text.splitlines()
                          if line.startswith("data: {")]
                seen |= {httpx.Response(200, content=c).json()["system_fingerprint"]
                         for c in chunks}
            else:
                seen.add(answer.json()["system_fingerprint"])
    assert seen == {want}


def test_a_decode_steps_gemm_sites_are_bounded_by_its_batch_not_by_the_chunk(tmp_path):
    """The GEMM path of a site is fixed from the most rows it can launch with: the decode
    steps' sites may never see a prefill chunk's rows, so their bound is their batch's."""
    from kerncc import manifest
    from kerncc.runtime.session import program_bounds

    generate(tmp_path, "tiny", max_tokens=48, max_seqs=3)
    man = manifest.load(tmp_path / "model.json")
    bounds = program_bounds(man)
    assert bounds["decode"]["tokens"] == 1 and bounds["decode"]["seqs"] == 1
    assert bounds["decode_batch"]["tokens"] == 3 and bounds["decode_batch"]["seqs"] == 3
    assert bounds["prefill"]["tokens"] == 48  # rows as fed: the chunk's bound
    assert bounds["load"] == man.vars_max()


def test_the_decode_steps_are_step_programs_at_any_batch_bound(tmp_path):
    """Past 64 sequences a decode_batch's bound leaves the GEMV's range; its sites must still
    take the batch-1 decode's path (a sequence's step has one set of bits alone and among
    others), so the Session names the step programs to the backend apart from their bounds."""
    from kerncc import manifest
    from kerncc.runtime.session import program_bounds, step_programs

    generate(tmp_path, "tiny", max_tokens=128, max_seqs=72)
    man = manifest.load(tmp_path / "model.json")
    assert step_programs(man) == {"decode", "decode_batch"}
    assert program_bounds(man)["decode_batch"]["seqs"] == 72  # past gemv.DECODE_MAX_M


def test_a_pinned_sites_one_row_launches_take_the_entry_with_its_bits():
    """A site on the pinned cuBLASLt algorithms (wide: gemv.takes_lt) gives its launches of at
    most gemv.SEQ_MAX_M rows to gemv.SEQ_ENTRY (the same bits, tests/test_gemv_cuda.py), with
    programmatic dependent launch, and the rest to cuBLASLt, which the launch after may not
    overlap; a narrow decode site keeps the GEMV family at every m (no driver: the launches
    are recorded)."""
    from kerncc.runtime.backends.cuda import CudaBackend
    from kerncc.runtime.launch import Site, VarScalar

    seen: list = []

    class FakeSite:
        def __call__(self, a, w, c, m, n, k, stream, overlap=False):
            seen.append(("family", m, overlap))

        def launch(self, entry, a, w, c, m, n, k, stream, overlap=False):
            seen.append((entry, m, overlap))

    backend = CudaBackend.__new__(CudaBackend)  # the policy alone: no device
    backend.gemm_paths, backend.pdl, backend.capturing = {}, True, True
    backend.after_kernel, backend.overlapped, backend.launches = True, 0, 0
    backend._launch_stream = 0
    backend.check_extern = lambda name: None
    backend._gemv_site = lambda name, invariant=False: FakeSite()
    backend._pinned_gemm = lambda name, n, k, max_m, align: (
        lambda a, w, c, m, stream: seen.append(("pinned", m, False)))

    def site(n: int, k: int) -> Site:
        return Site(number=n, program="decode_batch", call=0, label=None, op="gemm", launch=0,
                    kind="extern", entry="extern:cublaslt_bf16_tn", module=None,
                    block=(1, 1, 1), grid=(1, 1, 1), shared_mem=0, when=None,
                    args=(1 << 20, 2 << 20, 3 << 20, VarScalar("i32", "seqs"), n, k))

    wide = backend._invariant_extern(site(gemv.LT_MIN_N, 2048), {"seqs": 128}, True)
    narrow = backend._invariant_extern(site(2048, 2048), {"seqs": 128}, True)
    assert backend.gemm_paths == {gemv.LT_MIN_N: "pinned", 2048: "gemv"}
    for m in (1, 2, 1, 64):
        wide((1, 1, 1), 0, (m,))
    narrow((1, 1, 1), 0, (1,))
    assert seen == [(gemv.SEQ_ENTRY, 1, True), ("pinned", 2, False), (gemv.SEQ_ENTRY, 1, False),
                    ("pinned", 64, False), ("family", 1, False)]
    assert gemv.SEQ_MAX_M == 1 and gemv.SEQ_ENTRY in gemv.ENTRIES and gemv.SEQ_ENTRY in gemv.SHARED
