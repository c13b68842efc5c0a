"""Serving one sequence: chunked prefill, then decode (greedy, or sampled: kerncc.runtime.
sampling), over a paged KV cache.

The driver knows no buffer, program or var by name: the serving protocol (kerncc.protocol,
spec §4) says which program takes a prefill chunk (`chunk()`) and which one row
(`forward(1, 1)`), which buffer carries each fill, which inputs are page tables, and which
output hands the token back. When the chunk program hands back a token (spec §3.10: a chunk
program whose last calls write the `tokens` output hands back the first token; `chunk_tokens`),
the whole prompt goes through it in chunks and the last chunk's token is the first generated,
so the first token costs no one-row step (a full read of the weights); otherwise kern-serve's
order (spec §6.1): the prompt minus its last token in chunks, the last token through the
one-row program, whose token is the first. Each further token is fed back through the one-row
program.

Greedy decoding runs one step ahead of the host: step k + 1 is issued, its token fed on the
device from step k's token output (`Session.feed`), before the host has step k's token, so the
GPU goes from one step to the next without waiting for the host (kern-serve's order of calls,
the same bits). It does so only where the stage proves the fed values fit the token input's
domain (the library's argmax writes the output: `Session.token_range`), since those bytes pass
no host check; when a token ends generation, the one step issued past it is dropped. Sampled
decoding (the host draws each token) and stages in other processes go one step at a time.

A chain of stages is served like one manifest: the protocol is read off every stage that fits
it (`check_unsampled`) and merged (the head stages the union of every stage's inputs, spec
§3.10); the driver refuses to start if some stage reads an input it cannot fill. Pages come
from one pool (block size = the page table's `stride`), handed out from the top down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kerncc import manifest as m
from kerncc import protocol as proto
from kerncc.analysis.access import call_access
from kerncc.diagnostics import KernccError
from kerncc.runtime.chain import Chain
from kerncc.runtime.domains import is_whole
from kerncc.runtime.memory import default_token_capacity, numpy_dtype
from kerncc.runtime.sampling import SamplingParams
from kerncc.runtime.session import Session
from kerncc.verify import verify

INPUT_FILLS = ("token", "position", "valid", "slot", "seq_len", "cu_seqlens", "span_at")
LOGITS = "logits"
LOOKAHEAD = True  # greedy steps issued one ahead, their token fed on the device (module doc)


def chunk_tokens(protocol: proto.Protocol) -> bool:
    """Whether every chunk program (rows set per call) hands back a token: the next token
    after each sequence's last row of the call."""
    chunks = [f for f in protocol.forwards if f.rows == proto.VAR_ROWS and not f.span]
    return bool(chunks) and all(f.emits is not None for f in chunks)


def sessions_of(runner: Session | Chain) -> list[Session]:
    return runner.sessions if isinstance(runner, Chain) else [runner]


# ---------------------------------------------------------------------------------------------
# The protocol of a chain


def chain_protocol(manifests: Sequence[m.Manifest]) -> proto.Protocol:
    """One stage's protocol, or the union of the protocols of the stages that fit one."""
    found: list[proto.Protocol] = []
    errors: list[KernccError] = []
    for man in manifests:
        try:
            found.append(proto.check_unsampled(verify(man)))
        except KernccError as err:
            errors.append(err)
    if not found:
        raise errors[0]
    return _merged(found)


def _merged(protocols: list[proto.Protocol]) -> proto.Protocol:
    def union(items: list) -> tuple:
        return tuple({item.name: item for item in items}.values())

    forwards: dict[str, proto.Forward] = {}
    for p in protocols:
        for f in p.forwards:
            old = forwards.get(f.name)
            # The stage that writes the token output knows what the program hands back.
            forwards[f.name] = f if old is None or f.emits is not None else old
    return attrs.evolve(
        protocols[-1],
        fills=union([f for p in protocols for f in p.fills]),
        page_tables=union([t for p in protocols for t in p.page_tables]),
        line_tables=union([t for p in protocols for t in p.line_tables]),
        forwards=tuple(forwards[name] for name in sorted(forwards, key=str.encode)))


# ---------------------------------------------------------------------------------------------
# Pages


class PagePool:
    """Page ids of the paged states, handed out from the highest down, taken back in bulk."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.free = list(range(pages))

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise KernccError.single(f"the KV cache is full: {count} more pages needed, "
                                     f"{len(self.free)} of {self.pages} free")
        return [self.free.pop() for _ in range(count)]

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


# ---------------------------------------------------------------------------------------------
# Limits of a request, checked before any weight loads


@attrs.frozen
class Limits:
    """What one request may ask for, read off the manifests alone (no weights, no device)."""

    context: int | None = None  # positions one sequence may hold
    context_why: str = ""
    kv_tokens: int | None = None  # token slots of the paged KV cache, all sequences together
    token_low: int = 0
    token_high: int | None = None  # the highest token id the token inputs accept
    token_why: str = ""


def page_geometry(protocol: proto.Protocol, manifests: Sequence[m.Manifest]) -> tuple[int, int]:
    """(tokens per page, pages per sequence) of the page tables; (16, 0) without one."""
    if protocol.line_tables:
        names = ", ".join(f"`{t.name}`" for t in protocol.line_tables)
        raise KernccError.single(f"per-sequence state tables ({names}) are not served by "
                                 "`kerncc run` yet")
    geometry = {(_table_stride(manifests, t.name), t.width) for t in protocol.page_tables}
    if len(geometry) > 1:
        raise KernccError.single(f"page tables disagree on stride and width: {geometry}")
    return geometry.pop() if geometry else (16, 0)


def _table_stride(manifests: Sequence[m.Manifest], table: str) -> int:
    for man in manifests:
        buf = man.buffers.get(table)
        if buf is not None and buf.domain is not None:
            return buf.domain.stride
    return 1


def request_limits(manifests: Sequence[m.Manifest], protocol: proto.Protocol | None = None,
                   kv_tokens: int | None = None) -> Limits:
    """The limits of serving these stages: context, KV cache and token ids."""
    protocol = protocol or chain_protocol(manifests)
    stride, width = page_geometry(protocol, manifests)
    bounds = []
    if width:
        bounds.append((width * stride, f"a page table holds {width} pages of {stride} tokens"))
    if protocol.context is not None:
        why = f"`{protocol.context.var}` <= {protocol.context.max}"
        bounds.append((protocol.context.max, why))
    context, context_why = min(bounds, default=(None, ""))
    if kv_tokens is None:
        kv_tokens = max(default_token_capacity(man) for man in manifests)
    low, high, why = _token_range(protocol, manifests)
    return Limits(context, context_why, kv_tokens, low, high, why)


def _token_range(protocol: proto.Protocol, manifests: Sequence[m.Manifest]
                 ) -> tuple[int, int | None, str]:
    """The ids every token input accepts: its dtype, its domain, the table it indexes."""
    low, high, why = 0, None, ""
    for f in protocol.fills:
        if f.fill != "token":
            continue
        info = np.iinfo(numpy_dtype(f.dtype))
        found = [(int(info.max), f"`{f.name}` is {f.dtype}")]
        for man in manifests:
            if f.name in man.buffers:
                found += _domain_highs(man, f.name)
        top, top_why = min(found)
        low = max(low, int(info.min))
        if high is None or top < high:
            high, why = top, top_why
    return low, high, why


def _domain_highs(man: m.Manifest, name: str) -> list[tuple[int, str]]:
    domain, env = man.buffers[name].domain, man.vars_max()
    if domain is None:
        return []
    found = []
    if isinstance(domain.max, int) and not isinstance(domain.max, bool):
        found.append((domain.max, f"`{name}`'s domain max"))
    target = man.buffers.get(domain.index_into) if domain.index_into else None
    if target is not None and target.shape:
        rows = target.shape[0]
        rows = env.get(rows) if isinstance(rows, str) else rows
        if isinstance(rows, int):
            why = f"`{name}` indexes `{domain.index_into}`, {rows} rows: the vocabulary"
            found.append((rows // domain.stride - 1, why))
    return found


def token_ids(prompt: Any, name: str = "prompt") -> list[int]:
    """`prompt` as a list of ints: a sequence or a 1-D array of whole numbers. Anything else
    is refused here, by position, rather than truncated (1.5 ran as 1) or failing in numpy."""
    if prompt is None:
        return []
    if isinstance(prompt, (str, bytes)):
        raise KernccError.single(f"{name}: expected token ids, got the text {prompt!r} "
                                 "(encode it first)")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise KernccError.single(f"{name}: expected one list of token ids, got an array "
                                     f"of shape {list(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise KernccError.single(f"{name}: expected a list of token ids, got "
                                 f"{type(prompt).__name__}")
    for position, token in enumerate(prompt):
        if not is_whole(token):
            raise KernccError.single(f"{name} position {position}: {token!r} is not a whole "
                                     "number (a token id)")
    return [int(t) for t in prompt]


def check_whole(value: Any, name: str) -> None:
    """Refuse a count that is not a whole number (nan, 2.5, "2", None, True)."""
    if not is_whole(value):
        raise KernccError.single(f"{name} {value!r}: expected a whole number")


def check_request(limits: Limits, prompt: Sequence[int], max_new: int, *,
                  max_new_name: str = "max_new", prompt_name: str = "prompt") -> None:
    """Refuse a request that cannot finish, before any work: the ids past the vocabulary (at
    their prompt position) and a prompt plus `max_new` longer than a sequence may grow.
    `max_new_name` and `prompt_name` are what the caller calls them (`--max-new`)."""
    if not prompt:
        raise KernccError.single(f"{prompt_name}: the prompt is empty")
    check_whole(max_new, max_new_name)
    if max_new < 1:
        raise KernccError.single(f"{max_new_name} {max_new}: generate at least 1 token")
    for position, token in enumerate(prompt):
        if not limits.token_low <= token <= (limits.token_high if limits.token_high is not None
                                             else token):
            raise KernccError.single(
                f"{prompt_name} position {position}: token id {token} is outside "
                f"{limits.token_low}..{limits.token_high} ({limits.token_why})")
    needed = len(prompt) + max_new - 1  # the last generated token is never fed back
    for bound, why in ((limits.context, limits.context_why),
                       (limits.kv_tokens, "the KV cache's token slots")):
        if bound is not None and needed > bound:
            most = bound - len(prompt) + 1
            fix = (f"at most {max_new_name} {most} with this prompt" if most >= 1
                   else "the prompt alone is too long")
            raise KernccError.single(
                f"{max_new_name} {max_new}: the prompt's {len(prompt)} tokens and {max_new} new "
                f"ones need {needed} positions, but a sequence holds at most {bound} ({why}); "
                f"{fix}")


@attrs.define
class Served:
    """One sequence being served: its tokens so far, how many are cached, its pages."""

    tokens: list[int]
    cached: int = 0
    pages: list[int] = attrs.field(factory=list)


@attrs.frozen
class Generation:
    """What `generate` produced: the new tokens, and every run's logits (last row)."""

    tokens: list[int]
    logits: np.ndarray | None
    steps: list[tuple[str, int]]  # (program, rows) of every run, in order


# ---------------------------------------------------------------------------------------------
# The driver


class Generator:
    """Chunked prefill and greedy decode of one sequence at a time on a Session or Chain."""

    def __init__(self, runner: Session | Chain) -> None:
        if not isinstance(runner, (Session, Chain)):
            raise KernccError.single(f"Generator: expected a Session or a Chain, got "
                                     f"{type(runner).__name__}")
        self.runner = runner
        self.sessions = sessions_of(runner)
        self.protocol = chain_protocol([s.manifest for s in self.sessions])
        self.chunk_program = self.protocol.chunk()
        self.step_program = self.protocol.forward(1, 1)
        self.chunk_emits = self.chunk_program is not None and chunk_tokens(self.protocol)
        if self.chunk_program is None and self.step_program is None:
            raise KernccError.single("no program takes one sequence (neither a chunk program "
                                     "nor a one-row program): nothing to serve one prompt with")
        self.stride, self.width = self._page_geometry()
        self.pool = PagePool(self.sessions[0].token_capacity // self.stride)
        self.limits = request_limits([s.manifest for s in self.sessions], self.protocol,
                                     self.pool.pages * self.stride)
        self._check_inputs()

    @property
    def max_chunk(self) -> int:
        return self.protocol.rows.max

    def _page_geometry(self) -> tuple[int, int]:
        return page_geometry(self.protocol, [s.manifest for s in self.sessions])

    def _check_inputs(self) -> None:
        """Every input the served programs read is a fill or a page table the driver writes."""
        fillable = {f.name for f in self.protocol.fills if f.fill in INPUT_FILLS}
        fillable |= {t.name for t in self.protocol.page_tables}
        programs = [f.name for f in (self.chunk_program, self.step_program) if f is not None]
        for s in self.sessions:
            for name in sorted(_reads(s.manifest, programs) & set(s.stage.host_inputs)):
                if name not in fillable:
                    raise s.stage.located(KernccError.single(
                        f"stage {s.stage.index} reads input `{name}`, which is neither a fill "
                        "`kerncc run` writes nor a page table", f"/buffers/{name}"))
        for f in self.protocol.fills:
            if (f.fill not in INPUT_FILLS and f.fill not in m.OUTPUT_FILLS) or f.width != 1:
                owner = next(s for s in self.sessions if f.name in s.manifest.buffers)
                raise owner.stage.located(KernccError.single(
                    f"fill `{f.fill}` on `{f.name}` (width {f.width}) is not served by "
                    "`kerncc run` yet", f"/buffers/{f.name}/fill"))

    # ------------------------------------------------------------------------ serving

    def generate(self, prompt: Sequence[int], max_new: int, chunk: int | None = None,
                 stop: Callable[[int], bool] | None = None,
                 sampling: SamplingParams | None = None,
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Prefill `prompt` in chunks of `chunk` rows, then decode `max_new` tokens: greedily
        (the programs' own token), or sampled from the logits by `sampling` (Session.sample,
        counter (sequence 0, step = tokens generated so far)). `on_token` sees each token as
        soon as it is known (to stream it); `stop(token)` then ends generation by returning
        True (an eos token: it stays the last of the tokens)."""
        prompt = token_ids(prompt)
        if not prompt:
            raise KernccError.single("the prompt is empty")
        _check_callbacks(sampling, stop, on_token)
        if chunk is None:
            chunk = self.max_chunk
        check_whole(chunk, "chunk")
        if not 1 <= chunk <= self.max_chunk:
            raise KernccError.single(f"chunk {chunk} is outside [1, {self.max_chunk}] "
                                     f"(`{self.protocol.rows.var}` <= {self.max_chunk})")
        check_request(self.limits, prompt, max_new)
        self._check_tokens(prompt)
        seq = Served(list(prompt))
        record = _Record()
        self._sampling = None if sampling is None or sampling.greedy else sampling.resolved()
        self._generated = 0
        self._staged = False
        try:
            token = self._prefill(seq, chunk, record, stage=max_new > 1)
            feed = self._feed_once() if self._sampling is None and max_new > 2 else None
            generated: list[int] = []
            ahead: Any = None  # a step issued before the token it was fed was known here
            while True:
                generated.append(token)
                if on_token is not None:
                    on_token(token)
                seq.tokens.append(token)
                self._generated = g = len(generated)
                if (stop is not None and stop(token)) or g >= max_new:
                    if ahead is not None:  # issued past the end: its results are nobody's
                        record.drop()
                    break
                if feed is None:
                    token = self._one_row(seq, record, stage=g + 1 < max_new)
                    continue
                forward = self.step_program
                if ahead is None:  # this step's token is known here: the host writes it
                    staged, self._staged = self._staged, False
                    ahead = self._issue(seq, forward, record, staged=staged, stage_next=True)
                current = ahead
                # the step after it, fed on the device from this one's token
                ahead = self._issue(seq, forward, record, staged=self._staged, fed=feed,
                                    stage_next=g + 3 <= max_new) if g + 2 <= max_new else None
                token = self._token(current, forward)
        finally:
            self.pool.give_back(seq.pages)
        return Generation(generated, record.stacked(), record.steps)

    def _feed_once(self) -> Callable[[dict[str, int]], None] | None:
        """`_feeder()`, worked out at the first request that can use it (the stages' launches
        do not change) unless LOOKAHEAD is off."""
        if not LOOKAHEAD:
            return None
        if not hasattr(self, "_device_feed"):
            self._device_feed = self._feeder()
        return self._device_feed

    def _feeder(self) -> Callable[[dict[str, int]], None] | None:
        """How a one-row step's token input is written on the device from the step before
        it (`device_feeder`), or None where it cannot be."""
        if not LOOKAHEAD or self.step_program is None:
            return None
        return device_feeder(self.runner, self.protocol, self.sessions, self.step_program,
                             self.protocol.vars(1, 1, 1, 1))

    def _prefill(self, seq: Served, chunk: int, record: _Record, stage: bool) -> int:
        """The prompt in chunks, the last chunk's token; or, when the chunk program hands back
        none, all but the last prompt token in chunks and the last one as a step: its token.
        `stage`: a decode step follows (see _feed)."""
        if self.chunk_emits:
            while seq.cached < len(seq.tokens):
                rows = min(chunk, len(seq.tokens) - seq.cached)
                last = seq.cached + rows == len(seq.tokens)
                token = self._feed(seq, rows, self.chunk_program, record, wait=last,
                                   stage_next=last and stage)
            return self._next(token, self.chunk_program)
        if self.chunk_program is None:
            chunk = 1
        while seq.cached < len(seq.tokens) - 1:
            rows = min(chunk, len(seq.tokens) - 1 - seq.cached)
            # Chunks are only issued: on GPUs the next chunk goes in while this one runs.
            self._feed(seq, rows, self.chunk_program or self.step_program, record, wait=False)
        return self._one_row(seq, record, stage)

    def _one_row(self, seq: Served, record: _Record, stage: bool = False) -> int:
        """One decode step; `stage`: another follows unless a stop token ends generation."""
        forward = self.step_program or self.chunk_program
        staged, self._staged = self._staged, False
        return self._next(self._feed(seq, 1, forward, record, staged=staged, stage_next=stage),
                          forward)

    def _next(self, token: int | None, forward: proto.Forward) -> int:
        """The next token after the call of `forward` just collected: sampled from its logits,
        or the token it handed back."""
        if getattr(self, "_sampling", None) is not None:
            return self._sample()
        if token is None:
            raise KernccError.single(f"program `{forward.name}` hands back no token "
                                     "(no `tokens` output): nothing to decode with")
        return token

    def _sample(self) -> int:
        """The next token drawn from the last forward's logits (row 0: one sequence)."""
        holder = next((s for s in reversed(self.sessions) if LOGITS in s.manifest.buffers
                       and s.manifest.buffers[LOGITS].kind == "output"), None)
        if holder is None:
            raise KernccError.single("sampling reads the `logits` output, which no stage "
                                     "writes; decode greedily (temperature 0)")
        counter = (0, self._generated)
        return int(holder.sample(LOGITS, [0], [self._sampling], [counter])[0])

    def _check_tokens(self, prompt: Sequence[int]) -> None:
        """Every prompt id fits the buffers that carry tokens (the domain checks then name
        ids past the vocabulary)."""
        for f in self.protocol.fills:
            if f.fill != "token":
                continue
            info = np.iinfo(numpy_dtype(f.dtype))
            low, high = int(info.min), int(info.max)
            if low <= min(prompt) and max(prompt) <= high:  # builtins: fast on long prompts
                continue
            bad = next(int(t) for t in prompt if not low <= int(t) <= high)
            raise KernccError.single(f"token id {bad} does not fit `{f.name}` "
                                     f"({f.dtype}: {low}..{high})")

    def _feed(self, seq: Served, rows: int, forward: proto.Forward, record: _Record,
              wait: bool = True, staged: bool = False, stage_next: bool = False) -> int | None:
        """Issue `rows` rows of the sequence through `forward`; with `wait`, its token.
        `staged`: every input but the tokens is already written (_stage_step). `stage_next`:
        once this call is issued, write the next step's inputs but its token while it runs, so
        between two steps the host only writes one token (on one H200 that cut a batch-1
        decode step from 1.45 to 1.31 ms, host included: docs/benchmarks.md)."""
        pending = self._issue(seq, forward, record, rows, staged, stage_next=stage_next)
        return self._token(pending, forward) if wait else None

    def _issue(self, seq: Served, forward: proto.Forward, record: _Record, rows: int = 1,
               staged: bool = False, fed: Callable[[dict[str, int]], None] | None = None,
               stage_next: bool = False) -> Any:
        """Issue `rows` rows through `forward` (see _feed) without waiting; `fed`: the token
        input is written on the device by `fed(vars)` (the step before hands it over), not by
        the host. The call's pending outputs."""
        start, end = seq.cached, seq.cached + rows
        self._reserve(seq, end)
        part = ("none" if staged else "rest") if fed else ("tokens" if staged else "all")
        inputs = self._inputs(seq, start, end, part)
        vars = self.protocol.vars(1, rows, rows, end)
        if fed is not None:
            fed(vars)
        wanted = {LOGITS} | ({forward.emits} if forward.emits else set())
        if isinstance(self.runner, Chain):
            pending = self.runner.submit(forward.name, inputs, vars, rows=rows, outputs=wanted)
        else:
            pending = self.runner.submit(forward.name, inputs, vars, outputs=wanted)
        seq.cached = end
        record.add(forward.name, rows, pending)
        self._staged = False
        if stage_next:
            self._stage_step(seq)
        return pending

    @staticmethod
    def _token(pending: Any, forward: proto.Forward) -> int | None:
        """The token a call hands back (waiting for it), or None when it hands back none."""
        outputs = pending.result()
        if forward.emits is None or forward.emits not in outputs:
            return None
        return int(np.asarray(outputs[forward.emits]).reshape(-1)[0])

    def _reserve(self, seq: Served, end: int) -> None:
        if self.width and end > self.width * self.stride:
            raise KernccError.single(f"the sequence needs {end} tokens, but a page table holds "
                                     f"{self.width} pages of {self.stride} tokens")
        needed = -(-end // self.stride) - len(seq.pages)
        if needed > 0:
            seq.pages += self.pool.take(needed)

    def _stage_step(self, seq: Served) -> None:
        """Write the next one-row step's inputs but its token (Session.stage_inputs), where the
        runner can: it runs after the call just issued, whose token it needs. Nothing is staged when
        the step could not be taken anyway (a full page table or cache): the step itself then
        says why, if it comes (a stop token may end generation first)."""
        if type(self.runner) not in (Session, Chain):
            return  # a placement's chain (stages in other processes) sends inputs per call
        end = seq.cached + 1
        try:
            self._reserve(seq, end)
            self.runner.stage_inputs(self._inputs(seq, seq.cached, end, "rest"),
                                     self.protocol.vars(1, 1, 1, end))
        except KernccError:
            return
        self._staged = True

    def _inputs(self, seq: Served, start: int, end: int, part: str = "all"
                ) -> dict[str, np.ndarray]:
        """The inputs of rows [start, end): "all", only the "tokens" (fill `token`), the
        "rest" (every other fill and the page tables), or "none"."""
        inputs: dict[str, np.ndarray] = {}
        if part == "none":
            return inputs
        for f in self.protocol.fills:
            wanted = part == "all" or (f.fill == "token") == (part == "tokens")
            if f.fill in INPUT_FILLS and wanted:
                values = self._fill_values(f, seq, start, end)
                inputs[f.name] = np.asarray(values, dtype=numpy_dtype(f.dtype))
        if part == "tokens":
            return inputs
        for t in self.protocol.page_tables:
            row = seq.pages + [0] * (t.width - len(seq.pages))
            inputs[t.name] = np.asarray([row], dtype=np.int32)
        return inputs

    def _fill_values(self, f: proto.Filled, seq: Served, start: int, end: int
                     ) -> list[int] | np.ndarray:
        rows = end - start
        if f.fill == "token":
            fed = seq.tokens[start:end]
            return fed[:1] if f.axis == "groups" else fed
        if f.fill == "position":
            return np.arange(start, end, dtype=np.int64)
        if f.fill == "valid":
            return [1] * rows
        if f.fill == "slot":  # numpy: a 2048-row chunk's slots in Python took about 0.5 ms
            return slots(seq.pages, self.stride, start, end)
        if f.fill == "seq_len":
            return [end]
        if f.fill == "cu_seqlens":
            return [0] + [rows] * (f.axis.n - 1)  # type: ignore[union-attr]
        return [0]  # span_at: no run in a plain call



def device_feeder(runner: Any, protocol: proto.Protocol, sessions: Sequence[Session],
                  forward: proto.Forward, vars: dict[str, int]
                  ) -> Callable[[dict[str, int]], None] | None:
    """How a call of `forward` at `vars` has its token input written on the device from the
    token output of the call of `forward` before it (`Session.feed`, row for row), or None
    where the stages cannot prove the fed values fit that input's domain (`token_range`,
    `fits_domain`: those bytes pass no host check), `forward` hands back no token, or the
    runner is not a Session or an in-process Chain."""
    if forward.emits is None or type(runner) not in (Session, Chain):
        return None
    names = {f.name for f in protocol.fills if f.fill == "token"}
    runs = [s for s in sessions if forward.name in s.sites]
    if len(names) != 1 or not runs:
        return None
    name, source = next(iter(names)), runs[-1]
    span = source.token_range(forward.name, forward.emits)
    targets = [s for s in sessions if name in s.stage.host_inputs]
    if span is None or not targets or not all(
            t.fits_domain(name, *span, _vars_of(t, vars)) for t in targets):
        return None

    def feed(vars: dict[str, int]) -> None:
        for target in targets:
            target.feed(name, source, forward.emits, _vars_of(target, vars))

    return feed


def _vars_of(session: Session, vars: dict[str, int]) -> dict[str, int]:
    """The vars of `vars` that `session`'s stage has."""
    return {n: v for n, v in vars.items() if n in session.manifest.vars}


def _check_callbacks(sampling: Any, stop: Any, on_token: Any) -> None:
    """generate's optional arguments are of their kind (else they fail mid-run, deep inside)."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise KernccError.single(f"sampling: expected SamplingParams or None, got "
                                 f"{type(sampling).__name__}")
    for name, function in (("stop", stop), ("on_token", on_token)):
        if function is not None and not callable(function):
            raise KernccError.single(f"{name}: expected a function of a token or None, got "
                                     f"{type(function).__name__}")


def slots(pages: Sequence[int], stride: int, start: int, end: int) -> np.ndarray:
    """The KV slots of positions [start, end) of a sequence holding `pages` of `stride`."""
    positions = np.arange(start, end, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)[positions // stride] * stride + positions % stride


def _reads(man: m.Manifest, programs: list[str]) -> set[str]:
    found: set[str] = set()
    for name in programs:
        program = man.programs.get(name)
        for call in program.calls if program else ():
            found |= call_access(call, man.ops.get(call.op)).buffer_reads
    return found


class _Record:
    """Every run's program, rows and (once resolved) last-row logits."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] = []
        self.pending: list[Any] = []

    def add(self, program: str, rows: int, pending: Any) -> None:
        self.steps.append((program, rows))
        self.pending.append(pending)

    def drop(self) -> None:
        """Forget the last run (a step issued past the end of generation)."""
        self.steps.pop()
        self.pending.pop()

    def stacked(self) -> np.ndarray | None:
        logits = []
        for pending in self.pending:
            found = pending.result().get(LOGITS)
            if found is not None:
                logits.append(np.asarray(found).reshape(-1, np.shape(found)[-1])[-1].copy())
        return np.stack(logits) if logits else None
