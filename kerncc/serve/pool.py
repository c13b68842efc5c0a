"""The paged KV pool: page ids of the paged states, one pool for every stage of a chain.

Every stage sizes its paged states for the same token capacity (kerncc.runtime.chain), so a
page id names the same slots on each: the head hands a sequence's page ids to all stages
(spec §6.1), and a page the prefix cache keeps (kerncc.serve.prefix) is kept in every stage
at once. Pages are taken as a sequence grows and given back, all at once, when it finishes,
is cancelled, fails or is preempted. The pool never raises on a full pool: `take` says None
and the scheduler decides who waits (kerncc.serve.scheduler).

A page is, at any time, exactly one of
* blank: no sequence holds it and nothing is kept in it;
* in use: held by one or more sequences (its reference count: a prefix page several prompts
  share is held by each of them);
* cached: held by none, but kept under a key (`register`) for a later prompt to `share`;
  `take` evicts the least recently released one when no blank page is left.
`free` counts what `take` can hand out: blank and cached pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kerncc.diagnostics import KernccError


class KVPool:
    """Page ids 0..pages-1, reference-counted by owner so none leaks; blank ones handed out
    lowest first, cached ones evicted least recently released first."""

    def __init__(self, pages: int) -> None:
        if pages < 1:
            raise KernccError.single(f"a KV pool of {pages} pages holds nothing")
        self.pages = pages
        self._blank = list(range(pages - 1, -1, -1))  # pop() hands out the lowest id
        self._held: dict[int, list[int]] = {}
        self._holders: dict[int, set[int]] = {}  # page -> owners, for pages in use
        # owner -> how many of its pages another owner holds too (a release leaves them held)
        self.shared: dict[int, int] = {}
        self._index: dict[Hashable, int] = {}  # key -> cached page
        self._keys: dict[int, tuple[Hashable, int]] = {}  # page -> (key, serial)
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by none: LRU first
        self._serials = 0
        self.evictions = 0  # cached pages handed out blank again (counts: a server runs long)

    @property
    def free(self) -> int:
        """Pages `take` can hand out: blank or cached but held by none."""
        return len(self._blank) + len(self._idle)

    @property
    def blank(self) -> int:
        return len(self._blank)

    @property
    def cached(self) -> int:
        """Pages kept under a key, held or not."""
        return len(self._keys)

    @property
    def idle(self) -> int:
        """Cached pages no sequence holds (evicted first when blank ones run out)."""
        return len(self._idle)

    def held(self, owner: int) -> list[int]:
        """The page ids `owner` holds, in the order it took them (its page-table row)."""
        return self._held.get(owner, [])

    def take(self, owner: int, count: int) -> list[int] | None:
        """`count` more pages for `owner` (appended to its row), or None if too few are free.
        Blank pages first, then cached ones nobody holds, least recently released first."""
        if count > self.free:
            return None
        got = [self._blank.pop() if self._blank else self._evict() for _ in range(count)]
        self._held.setdefault(owner, []).extend(got)
        for page in got:
            self._holders[page] = {owner}
        return got

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        key, _ = self._keys.pop(page)
        del self._index[key]
        self.evictions += 1
        return page

    def share(self, owner: int, pages: Sequence[int]) -> None:
        """`owner` holds cached `pages` too (appended to its row): a prefix another sequence
        computed. A page held by none leaves the eviction order."""
        shared = self.shared
        for page in pages:
            if page not in self._keys or owner in self._holders.get(page, ()):
                raise AssertionError(f"page {page} is not cached or is held twice by {owner}")
            holders = self._holders.setdefault(page, set())
            self._idle.pop(page, None)
            # Only a page's first holder starts sharing it when a second comes: O(1) a page
            # (a loop over every holder made 32 prompts of 125 shared pages O(n^2) to admit)
            if len(holders) == 1:
                (first,) = holders
                shared[first] = shared.get(first, 0) + 1
            if holders:
                shared[owner] = shared.get(owner, 0) + 1
            holders.add(owner)
        self._held.setdefault(owner, []).extend(pages)

    def release(self, owner: int) -> int:
        """Give back every page `owner` holds; how many became free (pages another owner
        still holds do not). A cached page joins the eviction order, the row's last page
        first (it is the least likely to be shared again). Releasing twice is harmless."""
        pages = self._held.pop(owner, [])
        self.shared.pop(owner, None)
        freed = 0
        for page in reversed(pages):
            holders = self._holders[page]
            holders.discard(owner)
            if len(holders) == 1:
                (last,) = holders
                self._drop_shared(last)
            if holders:
                continue
            del self._holders[page]
            freed += 1
            if page in self._keys:
                self._idle[page] = None
            else:
                self._blank.append(page)
        return freed

    def _drop_shared(self, owner: int) -> None:
        left = self.shared[owner] - 1
        if left:
            self.shared[owner] = left
        else:
            del self.shared[owner]

    def register(self, page: int, key: Hashable) -> int:
        """Keep `page` under `key` once its owner no longer holds it; the serial of the entry
        the key names (serials are never reused, so a key built on one names one content).
        When `key` is kept already (two prompts computed the same page), the other page stays
        the cached one and this one goes blank when released."""
        if key in self._index:
            return self._keys[self._index[key]][1]
        if page in self._keys or page not in self._holders:
            raise AssertionError(f"page {page} is cached already or held by none")
        self._serials += 1
        self._index[key] = page
        self._keys[page] = (key, self._serials)
        return self._serials

    def lookup(self, key: Hashable) -> tuple[int, int] | None:
        """The cached page kept under `key` and its serial, or None."""
        page = self._index.get(key)
        return None if page is None else (page, self._keys[page][1])

    def is_held(self, page: int) -> bool:
        return page in self._holders

    def forget(self) -> None:
        """Keep nothing cached (something else may have written the pages): pages no one
        holds go blank, held ones stay held, uncached."""
        self._blank.extend(reversed(list(self._idle)))
        self._idle.clear()
        self._index.clear()
        self._keys.clear()

    def owners(self) -> list[int]:
        return sorted(self._held)

    def check(self) -> None:
        """Every page is blank, cached or in use, exactly one of them; each page's holders
        are the owners whose rows hold it (a leak or a double grant raises)."""
        rows: dict[int, set[int]] = {}
        for owner, pages in self._held.items():
            if len(set(pages)) != len(pages):
                raise AssertionError(f"owner {owner} holds a page twice: {pages}")
            for page in pages:
                rows.setdefault(page, set()).add(owner)
        if rows != self._holders:
            raise AssertionError("KV pool out of balance: holders differ from the rows")
        every = sorted([*self._blank, *self._idle, *self._holders])
        if every != list(range(self.pages)):
            raise AssertionError(f"KV pool out of balance: {len(self._blank)} blank, "
                                 f"{len(self._idle)} cached, {len(self._holders)} in use of "
                                 f"{self.pages}")
        if set(self._idle) - set(self._keys) or set(self._keys) != set(self._index.values()):
            raise AssertionError("KV pool's cache index out of balance")
        shared = {o: sum(len(self._holders[p]) > 1 for p in pages)
                  for o, pages in self._held.items()}
        if {o: n for o, n in shared.items() if n} != self.shared:
            raise AssertionError(f"KV pool's shared counts {self.shared} != {shared}")
