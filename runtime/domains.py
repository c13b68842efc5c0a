"""Host inputs: their shape at the current vars, their element type, their domain (spec §1.6).

Before a run the host writes input and inout buffers; each value must have the buffer's shape
at the call's vars, convert to its dtype without losing anything (no float into an integer
buffer, no integer that does not fit), and lie in its `domain`: `min` / `max` bounds (numbers,
or expressions over the vars) and, for `index_into`, 0 ≤ value ≤ rows/stride − 1 where rows is
the target's (a buffer's first dim at the vars, the token capacity of a paged state, the lines
of a per-sequence state). Every failure names the buffer, and the first bad element with its
index and value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, KernccError, Location

IndexRows = Callable[[str, dict[str, int]], "int | None"]


def is_whole(value: Any) -> bool:
    """Whether `value` is a whole number: a Python or numpy integer, never a bool (True is 1
    to Python, but a flag passed where a count belongs is a mistake)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _env_text(buf: m.Buffer, env: dict[str, int]) -> str:
    names = [d for d in buf.shape if isinstance(d, str)]
    return ", ".join(f"{n}={env[n]}" for n in dict.fromkeys(names)) or "no vars"


def vars_from_shape(buf: m.Buffer, value: Any) -> dict[str, int]:
    """The var values an array's shape implies for a buffer (for `write` without vars)."""
    try:
        shape = np.shape(value)
    except (ValueError, TypeError):  # a ragged list: host_array names it
        return {}
    if len(shape) != len(buf.shape):
        return {}
    return {d: int(n) for d, n in zip(buf.shape, shape) if isinstance(d, str)}


def _located(name: str, what: str, message: str, ptr: str = "") -> KernccError:
    """An error about input `name`, at its buffer's JSON pointer (the caller adds the file)."""
    return KernccError(f"input `{name}` {what}:",
                       [Diagnostic(message, Location(ptr or f"/buffers/{name}/shape"))])


def host_array(name: str, buf: m.Buffer, value: Any, env: dict[str, int],
               dtype: np.dtype) -> np.ndarray:
    """`value` as the buffer's dtype, checked to have its shape at `env`."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as err:  # a ragged list, an object numpy cannot take
        raise _located(name, "is not an array", f"numpy cannot make an array of the value: "
                       f"{err}") from None
    dims = tuple(buf.dims_at(env))
    if array.shape != dims:
        declared = "[" + ", ".join(str(d) for d in buf.shape) + "]"
        raise _located(name, "has the wrong shape",
                       f"the value is {_shape_text(array.shape)}, but the buffer is {declared}, "
                       f"{_shape_text(dims)} at {_env_text(buf, env)}")
    if array.dtype == dtype:
        return array
    return _converted(name, array, dtype)


def _converted(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind in "iu":
        if array.dtype.kind not in "iub":
            raise _located(name, "has the wrong element type",
                           f"the value holds {array.dtype}; the buffer is an integer buffer "
                           f"({dtype})", f"/buffers/{name}/dtype")
        info = np.iinfo(dtype)
        bad = (array < info.min) | (array > info.max)
        if bad.any():
            index, value = _first(array, bad)
            raise _located(name, "does not fit its element type",
                           f"element {index} is {value}, which does not fit {dtype}",
                           f"/buffers/{name}/dtype")
    elif array.dtype.kind not in "iubf" and array.dtype != dtype:
        raise _located(name, "has the wrong element type",
                       f"the value holds {array.dtype}, expected {dtype}", f"/buffers/{name}/dtype")
    return array.astype(dtype)


def _first(array: np.ndarray, bad: np.ndarray) -> tuple[list[int], Any]:
    flat = int(np.argmax(bad.reshape(-1)))
    index = [int(i) for i in np.unravel_index(flat, array.shape)]
    return index, array.reshape(-1)[flat].item()


def _bound(bound: m.Bound, env: dict[str, int]) -> int | float:
    if isinstance(bound, (int, float)) and not isinstance(bound, bool):
        return bound
    return m.eval_expr(bound, env)


def _limits(buf: m.Buffer, env: dict[str, int], index_rows: IndexRows
            ) -> list[tuple[str, int | float, str]]:
    """(`min` or `max`, limit, why) for each bound the domain sets at these vars."""
    d = buf.domain
    found: list[tuple[str, int | float, str]] = []
    if d.min is not None:
        found.append(("min", _bound(d.min, env), "the domain's min"))
    if d.max is not None:
        found.append(("max", _bound(d.max, env), "the domain's max"))
    if d.index_into is not None:
        rows = index_rows(d.index_into, env)
        if rows is not None:
            why = f"it indexes `{d.index_into}` ({rows} rows, {d.stride} per index)"
            found += [("min", 0, why), ("max", rows // d.stride - 1, why)]
    return found


def _comparable(array: np.ndarray) -> np.ndarray:
    """Values to compare with bounds: exact integers, or floats (bf16 and fp8 included)."""
    if array.dtype.kind in "ib" or array.dtype in (np.uint8, np.uint16, np.uint32):
        return array.astype(np.int64)
    return array.astype(np.float64)


def admits(buf: m.Buffer, env: dict[str, int], index_rows: IndexRows, low: int | float,
           high: int | float) -> bool:
    """Whether every value in [low, high] lies in the buffer's domain at `env` (no domain:
    every value does): what `check` would pass for any array of such values."""
    if buf.domain is None:
        return True
    return all(not (side == "min" and low < limit) and not (side == "max" and high > limit)
               for side, limit, _ in _limits(buf, env, index_rows))


def check(name: str, buf: m.Buffer, array: np.ndarray, env: dict[str, int],
          index_rows: IndexRows) -> None:
    """Raise when an element of `array` lies outside the buffer's domain at `env`."""
    if buf.domain is None or array.size == 0:
        return
    values = _comparable(array)
    low = high = None  # the extremes, taken once: most checks pass on them alone
    for side, limit, why in _limits(buf, env, index_rows):
        if side == "min":
            low = values.min() if low is None else low
            if not low < limit:
                continue
            bad = values < limit
        else:
            high = values.max() if high is None else high
            if not high > limit:
                continue
            bad = values > limit
        index, value = _first(array, bad)
        word = "below" if side == "min" else "above"
        message = f"element {index} is {value}, {word} {limit}: {why}"
        raise KernccError(f"input `{name}` is outside its domain:",
                          [Diagnostic(message, Location(f"/buffers/{name}/domain"))])
