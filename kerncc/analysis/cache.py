"""Analyses computed once per manifest object: the memo behind every cached analysis of the IR.

A `Manifest` is frozen and never edited in place, so anything computed from one (its
verification, accesses, liveness, buffer sizes, dataflow graph) holds for as long as that
object lives. `per_manifest` memoizes a function of a manifest (and hashable extra arguments)
by the manifest's *identity*: hashing or comparing a 36-layer manifest costs more than most
analyses, and passes hand unchanged stages on as the same object. An entry dies with its
manifest (a weak reference), so a long process does not keep old IRs alive.

The memoized function stays reachable as `wrapper.compute`: a test may replace it to count how
often an analysis really runs (tests/test_analysis_cache.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

# id(manifest) -> (weak reference to it, {key: result}); the weak reference proves the id was
# not reused by a newer object after the old one died.
_MEMO: dict[int, tuple[weakref.ref, dict[Hashable, Any]]] = {}


def _entry(man: Any) -> dict[Hashable, Any]:
    found = _MEMO.get(id(man))
    if found is not None and found[0]() is man:
        return found[1]
    key = id(man)
    ref = weakref.ref(man, functools.partial(_forget, key))
    table: dict[Hashable, Any] = {}
    _MEMO[key] = (ref, table)
    return table


def _forget(key: int, ref: weakref.ref, table: dict = _MEMO) -> None:
    # `table` is bound now: at interpreter exit the module's globals may already be gone.
    found = table.get(key)
    if found is not None and found[0] is ref:
        del table[key]


def memo(man: Any, key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()` the first time `key` is asked of this manifest object, the stored result after."""
    table = _entry(man)
    if key not in table:
        table[key] = compute()
    return table[key]


def per_manifest(fn: Callable[..., T]) -> Callable[..., T]:
    """Memoize `fn(manifest, *args)` per manifest object (args must be hashable).

    A raised exception is remembered and raised again, so a failed verification fails the
    same way every time without running the rules again.
    """
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def wrapper(man: Any, *args: Hashable) -> T:
        table = _entry(man)
        key = (name, args)
        if key not in table:
            try:
                result = wrapper.compute(man, *args)  # type: ignore[attr-defined]
            except Exception as err:
                table[key] = (False, err)
                raise  # with its traceback, the first time
            table[key] = (True, result)
            return result
        ok, value = table[key]
        if not ok:
            raise value.with_traceback(None)
        return value

    wrapper.compute = fn  # type: ignore[attr-defined]
    return wrapper


def clear() -> None:
    """Forget every cached analysis (tests that count computations start from here)."""
    _MEMO.clear()
