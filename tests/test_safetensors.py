"""kerncc.checkpoint.safetensors: round trips of every dtype, the header layout, every malformed file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kerncc.diagnostics import KernccError
from kerncc.checkpoint.safetensors import SafeTensors, dtypes, load_file, save_file


def _nonzero(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random data with no zero element (bytes 1..255, so no float is +-0 either)."""
    if dtype == np.bool_:
        return np.ones(shape, dtype=np.bool_)
    count = int(np.prod(shape)) * dtype.itemsize
    raw = rng.integers(1, 256, size=count, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _raw_file(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    """A file with any header bytes: the malformed cases are written by hand."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _both_readers(path: Path) -> list:
    return [lambda: load_file(path), lambda: SafeTensors(path)]


@pytest.mark.parametrize("name", sorted(dtypes()))
def test_round_trip_every_dtype(tmp_path: Path, name: str) -> None:
    rng = np.random.default_rng(len(name))
    dtype = dtypes()[name]
    tensors = {"x": _nonzero(dtype, (3, 5), rng), "scalar": _nonzero(dtype, (), rng),
               "empty": np.zeros((0, 4), dtype=dtype)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    loaded = load_file(path)
    with SafeTensors(path) as mapped:
        for key, want in tensors.items():
            for got in (loaded[key], mapped.get(key)):
                assert got.dtype == dtype and got.shape == want.shape
                assert got.tobytes() == want.tobytes()
            assert mapped.shape(key) == want.shape and mapped.dtype(key) == dtype


def test_named_dtypes_map_to_ml_dtypes() -> None:
    table = dtypes()
    assert table["BF16"] == np.dtype(ml_dtypes.bfloat16)
    assert table["F8_E4M3"] == np.dtype(ml_dtypes.float8_e4m3fn)
    assert table["F8_E8M0"] == np.dtype(ml_dtypes.float8_e8m0fnu)


def test_header_layout_is_the_reference_one(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    b = np.array([1.5, -2.0], dtype=np.float32)
    a = np.array([7, 8, 9], dtype=np.uint8)
    save_file({"b": b, "a": a}, path, metadata={"z": "1", "format": "np"})
    content = path.read_bytes()
    (n,) = struct.unpack("<Q", content[:8])
    header = content[8:8 + n]
    want = ('{"__metadata__":{"format":"np","z":"1"},'
            '"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},'
            '"b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}}')
    assert n % 8 == 0
    assert header.rstrip(b" ").decode() == want
    assert header == want.encode() + b" " * (n - len(want))
    assert content[8 + n:] == a.tobytes() + b.astype("<f4").tobytes()
    assert SafeTensors(path).metadata == {"format": "np", "z": "1"}


def test_bytes_are_deterministic(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.int16).reshape(2, 3)
    y = np.arange(4, dtype=ml_dtypes.bfloat16)
    save_file({"x": x, "y": y}, tmp_path / "1")
    save_file({"y": y, "x": x}, tmp_path / "2")
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


def test_big_endian_and_strided_inputs_are_written_little_endian(tmp_path: Path) -> None:
    x = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    save_file({"x": x}, tmp_path / "t")
    got = load_file(tmp_path / "t")["x"]
    assert got.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got, x)


def test_mapped_views_are_lazy_and_read_only(tmp_path: Path) -> None:
    save_file({"w": np.ones((4, 4), np.float32), "v": np.arange(3, dtype=np.int64)}, tmp_path / "t")
    with SafeTensors(tmp_path / "t") as f:
        assert f.keys() == ["v", "w"] and "w" in f and len(f) == 2
        w = f.get("w")
        assert not w.flags.writeable
        with pytest.raises(KernccError, match="`nope`"):
            f.get("nope")
    np.testing.assert_array_equal(w, 1.0)  # a view outlives the close
    with pytest.raises(KernccError, match="closed"):
        f.get("w")


def test_loaded_arrays_are_writable(tmp_path: Path) -> None:
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "t")
    got = load_file(tmp_path / "t")["w"]
    got[0] = 5.0
    assert got[0] == 5.0


@pytest.mark.parametrize("bad", [np.array(["a"]), np.zeros(2, dtype=np.float128), [1, 2]])
def test_save_refuses_what_the_format_cannot_hold(tmp_path: Path, bad: object) -> None:
    with pytest.raises(KernccError, match="`t`"):
        save_file({"t": bad}, tmp_path / "x")  # type: ignore[dict-item]


def test_save_refuses_the_metadata_key_as_a_tensor_name(tmp_path: Path) -> None:
    with pytest.raises(KernccError):
        save_file({"__metadata__": np.zeros(1)}, tmp_path / "x")


def _entry(dtype: object = "F32", shape: tuple = (2,), offsets: tuple = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (case id, header, data bytes, text the message must hold: the tensor's name where there is one)
MALFORMED = [
    ("bad-json", b"{not json", b"", "not valid JSON"),
    ("not-utf8", b"\xff\xfe{}", b"", "not valid JSON"),
    ("not-object", b"[1, 2]", b"", "not a JSON object"),
    ("duplicate", (b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                   b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'), b"\0", "duplicate"),
    ("unknown-dtype", {"w": _entry(dtype="Q7")}, bytes(8), "`w`: unknown dtype \"Q7\""),
    ("dtype-not-str", {"w": _entry(dtype=4)}, bytes(8), "`w`: unknown dtype"),
    ("missing-field", {"w": {"dtype": "F32", "shape": [2]}}, bytes(8), "`w`"),
    ("entry-not-object", {"w": 3}, b"", "`w`"),
    ("negative-dim", {"w": _entry(shape=(-2,))}, bytes(8), "`w`: shape"),
    ("float-dim", {"w": _entry(shape=(2.0,))}, bytes(8), "`w`: shape"),
    ("bool-offset", {"w": _entry(offsets=(False, 8))}, bytes(8), "`w`: data_offsets"),
    ("offsets-past-end", {"w": _entry(offsets=(0, 16))}, bytes(8), "`w`: data_offsets [0, 16]"),
    ("offsets-reversed", {"w": _entry(shape=(0,), offsets=(8, 0))}, bytes(8), "`w`"),
    ("offsets-not-pair", {"w": _entry(offsets=(0, 4, 8))}, bytes(8), "`w`: data_offsets"),
    ("overlap", {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}, bytes(12),
     "`b`: data_offsets [4, 12] overlap tensor `a`"),
    ("size-mismatch", {"w": _entry(shape=(3,))}, bytes(8), "`w`: shape [3] of F32 needs 12 bytes"),
    ("metadata-not-str", {"__metadata__": {"k": 1}}, b"", "__metadata__"),
]


@pytest.mark.parametrize("case, header, data, text", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_header(tmp_path: Path, case: str, header, data: bytes, text: str) -> None:
    path = _raw_file(tmp_path / f"{case}.safetensors", header, data)
    for read in _both_readers(path):
        with pytest.raises(KernccError) as info:
            read()
        assert str(path) in str(info.value)
        assert text in str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00", struct.pack("<Q", 100) + b"{}"],
                         ids=["empty", "short-length", "length-past-end"])
def test_short_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)
    for read in _both_readers(path):
        with pytest.raises(KernccError, match="short|exceeds"):
            read()


def test_missing_file_is_a_kerncc_error(tmp_path: Path) -> None:
    for read in _both_readers(tmp_path / "absent"):
        with pytest.raises(KernccError, match="absent"):
            read()


def test_zero_byte_tensors_may_share_an_offset(tmp_path: Path) -> None:
    header = {"a": _entry(shape=(0,), offsets=(0, 0)), "b": _entry(shape=(0,), offsets=(0, 0))}
    path = _raw_file(tmp_path / "z", header)
    assert {k: v.shape for k, v in load_file(path).items()} == {"a": (0,), "b": (0,)}


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6))
def test_corrupted_files_raise_only_kerncc_errors(tmp_path: Path, flips) -> None:
    path = tmp_path / "fuzz.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.int8)}, path,
              metadata={"m": "x"})
    content = bytearray(path.read_bytes())
    for position, value in flips:
        content[position % len(content)] = value
    path.write_bytes(bytes(content))
    for read in _both_readers(path):
        try:
            read()
        except KernccError:
            pass


def test_a_header_length_past_the_file_allocates_nothing(tmp_path: Path) -> None:
    """A 16-byte file claiming a 99 MB header is refused before that much is read (or held)."""
    import tracemalloc

    from kerncc.hf.checkpoint import read_header

    path = tmp_path / "liar.safetensors"
    path.write_bytes(struct.pack("<Q", 99_000_000) + b"{}      ")
    for read in [*_both_readers(path), lambda: read_header(path)]:
        tracemalloc.start()
        try:
            with pytest.raises(KernccError, match="exceeds the file"):
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
