"""Automatic prefix caching: full pages of prompt KV kept for later prompts that begin alike
(what is kept, when a prompt takes it and how pages are evicted: docs/serving.md).

A page's key is vLLM's hash chain: (the serial of page i-1's entry, page i's tokens), kept as
the dict key itself, not a digest, and a serial is never reused, so two keys are equal only
when their whole prefixes are: no collision can hand a prompt another prompt's KV. A radix tree
(SGLang) matches at any token, but the pool's unit is a page and a page is shared whole (a
partial one would need copying on write), so a hash chain over pages does all a tree would
here, with one dict lookup a page and no tree to keep balanced on eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kerncc.serve import scheduler as sch
from kerncc.serve.pool import KVPool

ROOT = 0  # the serial of the empty prefix (the pool's serials start at 1)

Prompts = Callable[[int], Sequence[int]]  # a sequence id -> its prompt's tokens


class PrefixCache:
    """The keys of every sequence's kept pages, the matches of the waiting ones, and counts."""

    def __init__(self, pool: KVPool, stride: int, enabled: bool = True) -> None:
        self.pool, self.stride, self.enabled = pool, stride, enabled
        self._chains: dict[int, list[int]] = {}  # seq id -> serials of its first pages' keys
        # waiting seq id -> the pages it would share and their serials
        self._hits: dict[int, tuple[list[int], list[int]]] = {}
        # waiting seq id -> its prompt's pages' tokens, one tuple a page, made once: a refresh
        # runs every turn while someone waits, and slicing 125 pages of each of 32 waiting
        # prompts every turn cost milliseconds
        self._pages: dict[int, list[tuple[int, ...]]] = {}
        self.queried = 0  # prompt tokens admitted (counts: a server runs long)
        self.hit = 0  # of them, taken from the cache

    def refresh(self, state: sch.State, limits: sch.Limits, prompts: Prompts) -> sch.State:
        """The state with each waiting sequence that the next step may admit told what it
        would take from the cache (`Seq.reuse`, `Seq.fresh`) or that it waits for a page a
        running sequence computes (`Seq.held`). Admission goes in queue order and stops at
        the first that does not fit, so `fresh` counts a page once, for the first to take it."""
        room = limits.max_running - len(state.running)
        if not self.enabled or room <= 0 or not state.waiting:
            return state
        self._hits.clear()
        claimed: set[int] = set()
        waiting = list(state.waiting)
        ahead = list(state.running)  # and those admitted before it, if it is
        for index, seq in enumerate(waiting[:room]):
            prompt = prompts(seq.id)
            pages, serials = self._match(prompt, seq)
            held = self._computing(prompt, len(pages), seq, ahead, limits, prompts)
            fresh = sum(1 for p in pages if not self.pool.is_held(p) and p not in claimed)
            claimed.update(pages)
            self._hits[seq.id] = (pages, serials)
            reuse = len(pages) * self.stride
            if (seq.reuse, seq.fresh, seq.held) != (reuse, fresh, held):
                waiting[index] = seq.matched(reuse, fresh, held)
            if held:
                break  # admission stops here: the ones behind it are not looked at
            ahead.append(waiting[index].admitted(self.stride))
        return attrs.evolve(state, waiting=tuple(waiting))

    def _limit(self, seq: sch.Seq) -> int:
        """Most pages a sequence may take: never its prompt's last token's page."""
        prompt = seq.tokens if seq.prompt is None else seq.prompt
        return (prompt - 1) // self.stride

    def _match(self, prompt: Sequence[int], seq: sch.Seq) -> tuple[list[int], list[int]]:
        """The longest run of kept pages that begins `prompt`: their ids and serials."""
        pages: list[int] = []
        serials: list[int] = []
        parent = ROOT
        for tokens in self._page_tokens(seq, prompt):
            found = self.pool.lookup((parent, tokens))
            if found is None:
                break
            pages.append(found[0])
            serials.append(parent := found[1])
        return pages, serials

    def _page_tokens(self, seq: sch.Seq, prompt: Sequence[int]) -> list[tuple[int, ...]]:
        """The tokens of each page `seq` may take (`_limit`), kept while it waits."""
        kept = self._pages.get(seq.id)
        if kept is None:
            s = self.stride
            kept = self._pages[seq.id] = [tuple(prompt[i * s:(i + 1) * s])
                                          for i in range(self._limit(seq))]
        return kept

    def _computing(self, prompt: Sequence[int], page: int, seq: sch.Seq,
                   ahead: Sequence[sch.Seq], limits: sch.Limits, prompts: Prompts) -> bool:
        """Whether a sequence ahead (running, or admitted first) has yet to feed page `page` of
        `prompt` through chunks, with the same tokens up to its end (it will keep it: better
        wait and share it)."""
        start, end = page * self.stride, (page + 1) * self.stride
        if page >= self._limit(seq):
            return False
        for other in ahead:
            if not other.cached < end <= other.chunk_end(limits.chunk_emits):
                continue
            theirs = prompts(other.id)
            # the page itself first: prompts that share a system prompt differ right after
            # it, and comparing 2,000 tokens for each pair of 32 newcomers cost milliseconds
            if theirs[start:end] == prompt[start:end] and theirs[:start] == prompt[:start]:
                return True
        return False

    def admit(self, seq_id: int, pages: int, prompt: Sequence[int]) -> None:
        """`seq_id` was admitted taking its first `pages` pages from the cache (`refresh`'s
        match): it holds them now, before any page is taken (a take may evict a cached one)."""
        self.queried += len(prompt)
        if not self.enabled:
            return
        self._pages.pop(seq_id, None)
        shared, serials = self._hits.pop(seq_id, ([], []))
        if len(shared) < pages:
            raise AssertionError(f"sequence {seq_id} was planned {pages} cached pages, "
                                 f"{len(shared)} were matched")
        self.pool.share(seq_id, shared[:pages])
        self.hit += pages * self.stride
        self._chains[seq_id] = serials[:pages]

    def issued(self, item: sch.Item, prompts: Prompts) -> None:
        """A chunk call was issued: keep each page it completes (its KV is written before any
        later call reads it)."""
        if not self.enabled or item.kind != "chunk":
            return
        s = self.stride
        for seq_id, start, rows in item.parts:
            chain = self._chains.setdefault(seq_id, [])
            full = (start + rows) // s
            if len(chain) >= full:
                continue
            pages, prompt = self.pool.held(seq_id), prompts(seq_id)
            for i in range(len(chain), full):
                key = (chain[-1] if chain else ROOT, tuple(prompt[i * s:(i + 1) * s]))
                chain.append(self.pool.register(pages[i], key))

    def released(self, seq_id: int) -> None:
        """`seq_id` gave its pages back (finished, cancelled, failed or preempted)."""
        self._chains.pop(seq_id, None)
        self._hits.pop(seq_id, None)
        self._pages.pop(seq_id, None)

    def forget(self) -> None:
        """Keep nothing (something else may have written the pages)."""
        self.pool.forget()
        self._chains.clear()
        self._hits.clear()
        self._pages.clear()

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0
