"""The paged KV pool: page ids of the paged states, one pool for every stage of a chain.

Every stage sizes its paged states for the same token capacity (kerncc.runtime.chain), so a
page id names the same slots on each: the head hands a sequence's page ids to all stages
(spec §6.1). Pages are taken as a sequence grows and given back, all at once, when it finishes,
is cancelled, fails or is preempted. The pool never raises on a full pool: `take` says None and
the scheduler decides who waits (kerncc.serve.scheduler).
"""

from __future__ import annotations

from kerncc.diagnostics import KernccError


class KVPool:
    """Page ids 0..pages-1, handed out lowest first, tracked by owner so none leaks."""

    def __init__(self, pages: int) -> None:
        if pages < 1:
            raise KernccError.single(f"a KV pool of {pages} pages holds nothing")
        self.pages = pages
        self._free = list(range(pages - 1, -1, -1))  # pop() hands out the lowest id
        self._held: dict[int, list[int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def held(self, owner: int) -> list[int]:
        """The page ids `owner` holds, in the order it took them (its page-table row)."""
        return self._held.get(owner, [])

    def take(self, owner: int, count: int) -> list[int] | None:
        """`count` more pages for `owner` (appended to its row), or None if too few are free."""
        if count > len(self._free):
            return None
        got = [self._free.pop() for _ in range(count)]
        self._held.setdefault(owner, []).extend(got)
        return got

    def release(self, owner: int) -> int:
        """Give back every page `owner` holds; how many. Releasing twice is harmless."""
        pages = self._held.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def owners(self) -> list[int]:
        return sorted(self._held)

    def check(self) -> None:
        """Every page is free or held by exactly one owner (a leak or a double grant raises)."""
        held = [p for pages in self._held.values() for p in pages]
        if sorted(held + self._free) != list(range(self.pages)):
            raise AssertionError(f"KV pool out of balance: {len(self._free)} free, "
                                 f"{len(held)} held of {self.pages}")
