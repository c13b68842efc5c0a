"""Helpers for the kernel library's Numba-CUDA kernels (imported by `*_nb.py` only, at build).

The runtime never imports this module, nor numba: the Numba-CUDA kernels are compiled ahead
of time by `kernels/build.py` into cubins like the CUDA C ones. What lives here:
* `kernel(name, *params)`: registers a Python function as a library entry with a plain-pointer
  ABI (`CPointer` arguments, one 8-byte parameter each, like `const T*` in CUDA C; numba
  array arguments would expand to several parameters);
* the few instructions the CUDA C kernels use that numba has no spelling for, as intrinsics
  emitting the same PTX: `cvt.rn.bf16.f32` (`__float2bfloat16`), 16-byte vector loads and
  stores, pointer arithmetic on the address (alignment tests);
* typed constants, because numba widens `uint64 op int` to float64 (the classic pitfall).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

P_U8 = types.CPointer(types.uint8)
P_U16 = types.CPointer(types.uint16)
P_U32 = types.CPointer(types.uint32)
P_I32 = types.CPointer(types.int32)
P_F32 = types.CPointer(types.float32)
I32 = types.int32
U32 = types.uint32

# {entry name: (python function, numba signature)} of the module being imported; each
# `*_nb.py` module collects its own through `kernel` into its module-level ENTRIES.
Entries = dict[str, tuple[Callable[..., None], Any]]


def kernel(entries: Entries, name: str, *params: Any) -> Callable[[Callable], Callable]:
    """Decorator: add `fn` to `entries` as library entry `name` taking `params` (void)."""

    def register(fn: Callable) -> Callable:
        if name in entries:
            raise ValueError(f"entry `{name}` is defined twice")
        entries[name] = (fn, types.void(*params))
        return fn

    return register


# ---- bf16 ----------------------------------------------------------------------------------


@intrinsic
def f32_to_bf16(typingctx, x):
    """The bf16 bits of f32 `x`, rounded to nearest even (`cvt.rn.bf16.f32`, as nvcc's
    `__float2bfloat16` on sm_90: NaN gives the canonical 0x7fff)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(16), [ir.FloatType()])
        return builder.asm(fnty, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [args[0]],
                           side_effect=False)

    return types.uint16(types.float32), codegen


@intrinsic
def bf16_to_f32(typingctx, h):
    """The f32 value of bf16 bits `h` (exact: the bits moved to the high half)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of f32 `x` as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _low32(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """An integer's low 32 bits (numba widens uint32 shifts and ors to 64 bits)."""
    width = value.type.width
    if width == 32:
        return value
    i32 = ir.IntType(32)
    return builder.trunc(value, i32) if width > 32 else builder.zext(value, i32)


@intrinsic
def bits_f32(typingctx, b):
    """The f32 whose IEEE bits are the low 32 bits of integer `b`."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_low32(builder, args[0]), ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def u32(typingctx, b):
    """The low 32 bits of integer `b` as a uint32."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _low32(builder, args[0])

    return types.uint32(b), codegen


# ---- pointers and 16-byte accesses ---------------------------------------------------------


@intrinsic
def address(typingctx, ptr):
    """A pointer's address as a uint64 (alignment tests)."""
    if not isinstance(ptr, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.uint64(ptr), codegen


_U4 = types.UniTuple(types.uint32, 4)


def _vector_ptr(builder: ir.IRBuilder, ptr: ir.Value, index: ir.Value) -> ir.Value:
    at = builder.gep(ptr, [index])
    return builder.bitcast(at, ir.PointerType(ir.VectorType(ir.IntType(32), 4)))


@intrinsic
def load16(typingctx, ptr, index):
    """The 16 bytes at `ptr + index` (elements; 16-byte aligned) as four uint32 words."""
    if not isinstance(ptr, types.CPointer) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr_v, index_v = args
        index_v = context.cast(builder, index_v, sig.args[1], types.int64)
        vec = builder.load(_vector_ptr(builder, ptr_v, index_v), align=16)
        words = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
        return context.make_tuple(builder, sig.return_type, words)

    return _U4(ptr, index), codegen


@intrinsic
def store16(typingctx, ptr, index, w0, w1, w2, w3):
    """Write four words (the low 32 bits of each integer) as the 16 bytes at `ptr + index`
    (elements; 16-byte aligned)."""
    if not isinstance(ptr, types.CPointer) or not isinstance(index, types.Integer):
        return None
    if not all(isinstance(w, types.Integer) for w in (w0, w1, w2, w3)):
        return None

    def codegen(context, builder, sig, args):
        ptr_v, index_v, *words = args
        index_v = context.cast(builder, index_v, sig.args[1], types.int64)
        vec = ir.Constant(ir.VectorType(ir.IntType(32), 4), ir.Undefined)
        for k, w in enumerate(words):
            vec = builder.insert_element(vec, _low32(builder, w), ir.Constant(ir.IntType(32), k))
        builder.store(vec, _vector_ptr(builder, ptr_v, index_v), align=16)
        return context.get_dummy_value()

    return types.void(ptr, index, w0, w1, w2, w3), codegen


@intrinsic
def load16_nc(typingctx, ptr, index):
    """`load16` through the read-only (non-coherent) path, `ld.global.nc.v4.u32`, as nvcc
    emits for a `const T* __restrict__` parameter: only for memory no thread writes while
    the kernel runs."""
    if not isinstance(ptr, types.CPointer) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr_v, index_v = args
        index_v = context.cast(builder, index_v, sig.args[1], types.int64)
        at = builder.ptrtoint(builder.gep(ptr_v, [index_v]), ir.IntType(64))
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
        asm = ("{ .reg .u64 g; cvta.to.global.u64 g, $4; "
               "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [g]; }")
        out = builder.asm(fnty, asm, "=r,=r,=r,=r,l", [at], side_effect=False)
        words = [builder.extract_value(out, k) for k in range(4)]
        return context.make_tuple(builder, sig.return_type, words)

    return _U4(ptr, index), codegen


# ---- 32-bit integer arithmetic (numba computes every integer op in 64 bits) ----------------


@intrinsic
def udiv32(typingctx, a, b):
    """floor(a / b) of the low 32 bits of two non-negative integers, as a 32-bit division
    (numba's `//` is a 64-bit signed one with a floor correction)."""
    if not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.udiv(_low32(builder, args[0]), _low32(builder, args[1]))

    return types.uint32(a, b), codegen


# ---- compiling -----------------------------------------------------------------------------


class _Device:
    """What numba-cuda asks of the current device while compiling a called device function:
    its compute capability (it compiles for the device it runs on; the build has none)."""

    def __init__(self, cc: tuple[int, int]) -> None:
        self.compute_capability = cc


def compile_ptx(fn: Callable, signature: Any, cc: tuple[int, int] = (9, 0)) -> str:
    """The PTX of kernel `fn` at `signature` for `cc`, compiled without a GPU or a driver."""
    from numba import cuda
    from numba.cuda import dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Device(cc)  # no driver is asked for anything
    try:
        ptx, _ = cuda.compile(fn, signature, device=False, output="ptx", cc=cc, abi="numba")
    finally:
        dispatcher.get_current_device = saved
    return ptx
