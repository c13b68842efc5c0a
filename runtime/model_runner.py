"""The model runner (vLLM v1's model-runner role): every call's inputs, built from the protocol.

It knows no buffer, program or var by name: the serving protocol (kerncc.protocol, spec §4)
says which program takes prefill chunks and which one row of each of several sequences, which
buffer carries each fill, which inputs are page tables, and which output hands the token back.
A chain of stages is served like one manifest: the protocol is read off every stage that fits
it (`check_unsampled`) and merged (the head stages the union of every stage's inputs, spec
§3.10); the runner refuses to start if some stage reads an input it cannot fill.

`ModelRunner` owns, for whoever drives it (kerncc.serve.engine):
* the page geometry (tokens per page = the page table's `stride`, pages per sequence) and the
  limits of a request (`request_limits`, read off the manifests alone, so a command line can
  check before any weight loads; `limits`, its KV pool's): `check_request` is the one owner
  of a request's rules, naming fields as its caller does (`Names`: flags or JSON pointers);
* every call's inputs from the rows it feeds (`Rows`: a sequence's known tokens, its pages and
  the rows [start, start + n) of this call): tokens, positions, slots, lengths, page tables;
* what the device already holds: a call sends only the host inputs that differ, and a decode
  call stages the next one's (all but its tokens) while it runs (`stage_next`), where the
  runner says its stages live in this process (`in_process`: Session, Chain; a placement's
  chain sends inputs with each item);
* the device feed for steps ahead (`feeder`): a decode call's token input written on the
  device from the call before it (`Session.feed`), only where the stages prove the fed values
  fit that input's domain (the library's argmax writes the output: `Session.token_range`),
  since those bytes pass no host check;
* draws on the device (`draws_on_device`, `submit(draws=...)`): a call's tokens sampled from
  its logits into its token output (`Session.sample_into`) right after it, so that sampled
  sequences are fed on the device like greedy ones. The sampler picks an index of the logits
  row, the same range as the argmax it replaces, so the feed's proof still holds. A call's
  draw may also come later than its forward (`submit(drawn_later=True)`, then `draw`), once
  what it needs is known on the host (a grammar's mask, from the token of the call before):
  the forward runs meanwhile, and the next call, issued after the draw, is fed its tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np

from kerncc import manifest as m
from kerncc import protocol as proto
from kerncc.analysis.access import call_access
from kerncc.diagnostics import KernccError
from kerncc.runtime.chain import Chain
from kerncc.runtime.domains import is_whole
from kerncc.runtime.memory import chain_token_capacity, numpy_dtype
from kerncc.runtime.session import Session, stage_vars
from kerncc.verify import verify

INPUT_FILLS = ("token", "position", "valid", "slot", "seq_len", "cu_seqlens", "span_at")
LOGITS = "logits"

Feed = Callable[[dict[str, int]], None]  # writes a call's token input on the device
Draws = tuple[Sequence[Any], Sequence[tuple[int, int]]]  # (sampling params, counters) a row


class _Joined:
    """A call's pending outputs and the pending download of its drawn tokens, as one."""

    def __init__(self, call: Any, drawn: Any) -> None:
        self.call, self.drawn = call, drawn

    def result(self) -> dict[str, Any]:
        return {**self.call.result(), **self.drawn.result()}


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
    low, high, why = _token_range(protocol, manifests)
    return Limits(context, context_why, chain_token_capacity(manifests, kv_tokens), low, high,
                  why)


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


@attrs.frozen
class Names:
    """What a caller calls a request's prompt and new-token count, in the errors of
    `check_request`: flags (`FLAGS`), or the JSON fields of the HTTP API (`FIELDS`), whose
    errors carry a pointer (`/prompt/3`, `/max_tokens`) the HTTP layer names the field by."""

    prompt: str = "prompt"
    max_new: str = "max_new"
    pointers: bool = False

    def refuse(self, message: str, field: str, index: int | None = None) -> KernccError:
        pointer = f"/{field}" if index is None else f"/{field}/{index}"
        return KernccError.single(message, pointer if self.pointers else "")


FLAGS = Names("--prompt", "--max-new")
FIELDS = Names("prompt", "max_tokens", pointers=True)


def check_request(limits: Limits, prompt: Sequence[Any], max_new: Any,
                  names: Names = Names()) -> None:
    """Refuse a request that cannot finish, before any work, naming the field as `names`
    says: an empty prompt, an id not whole or outside what the token inputs take (the
    vocabulary, their dtype), at its position; `max_new` not whole or below 1, or with the
    prompt longer than a sequence may grow (the context, the KV cache's token slots)."""
    where = f"{names.prompt} position"
    if not len(prompt):
        raise names.refuse(f"{names.prompt}: the prompt is empty", names.prompt)
    # Plain Python ints (what JSON gives) are checked in one pass of builtins: a scan took
    # 0.5 ms a 2,100-token prompt, on the thread that serves HTTP, 32 times a wave.
    plain = set(map(type, prompt)) <= {int}
    odd = None if plain else next((i for i, t in enumerate(prompt) if not is_whole(t)), None)
    if odd is not None:  # 1.5 ran as token 1
        raise names.refuse(f"{where} {odd}: {prompt[odd]!r} is not a whole number (a token "
                           "id)", names.prompt, odd)
    if not is_whole(max_new):  # 2.5 gave 3 tokens
        raise names.refuse(f"{names.max_new} {max_new!r}: expected a whole number",
                           names.max_new)
    if max_new < 1:
        raise names.refuse(f"{names.max_new} {max_new}: generate at least 1 token",
                           names.max_new)
    low, high = limits.token_low, limits.token_high
    if not (low <= min(prompt) and (high is None or max(prompt) <= high)):
        bad = next(i for i, t in enumerate(prompt)
                   if not (low <= t and (high is None or t <= high)))
        span = f"{low}..{high}" if high is not None else f"{low} and up"
        raise names.refuse(f"{where} {bad}: token id {prompt[bad]} is outside {span} "
                           f"({limits.token_why or 'a token id is never negative'})",
                           names.prompt, bad)
    needed = len(prompt) + max_new - 1  # the last generated token is never fed back
    for bound, why in ((limits.context, limits.context_why),
                       (limits.kv_tokens, "the KV cache's token slots")):
        if bound is not None and needed > bound:
            most = bound - len(prompt) + 1
            fix = (f"at most {names.max_new} {most} with this prompt" if most >= 1
                   else "the prompt alone is too long")
            raise names.refuse(
                f"{names.max_new} {max_new}: the prompt's {len(prompt)} tokens and {max_new} "
                f"new ones need {needed} positions, but a sequence holds at most {bound} "
                f"({why}); {fix}", names.max_new)



# ---------------------------------------------------------------------------------------------
# The runner


class Rows(NamedTuple):
    """Rows [start, start + n) of one sequence in a call: its known tokens are `prompt` then
    `generated` (kept apart: a decode row reads one token, joining them would copy both), its
    KV cache lies in `pages` (its page-table row); `seq` names it."""

    seq: int
    prompt: Sequence[int]
    generated: Sequence[int]
    pages: Sequence[int]
    start: int
    n: int

    def token(self, index: int) -> int:
        prompt = self.prompt
        return prompt[index] if index < len(prompt) else self.generated[index - len(prompt)]

    def tokens(self) -> list[int]:
        return [*self.prompt, *self.generated][self.start:self.start + self.n]


class ModelRunner:
    """The protocol of a Session or Chain, and every call's inputs (see the module doc)."""

    def __init__(self, runner: Session | Chain) -> None:
        if not isinstance(runner, (Session, Chain)):
            raise KernccError.single(f"expected a Session or a Chain to serve, got "
                                     f"{type(runner).__name__}")
        self.runner = runner
        self.sessions = sessions_of(runner)
        manifests = [s.manifest for s in self.sessions]
        self.protocol = chain_protocol(manifests)
        self.chunk_program = self.protocol.chunk()
        self.step_program = self.protocol.forward(1, 1)
        self.chunk_emits = self.chunk_program is not None and chunk_tokens(self.protocol)
        if self.chunk_program is None and self.step_program is None:
            raise KernccError.single("no program takes one sequence (neither a chunk program "
                                     "nor a one-row program): nothing to serve one prompt with")
        self.stride, self.width = page_geometry(self.protocol, manifests)
        self.pages = max(1, self.sessions[0].token_capacity // self.stride)  # the KV pool's
        self.vocab = self._vocab()
        # what a request may ask of this runner: the checks of `check_request`
        self.limits = request_limits(manifests, self.protocol, self.pages * self.stride)
        self._check_inputs()
        tokens = [f.name for f in self.protocol.fills if f.fill == "token"]
        self._token_input = tokens[0] if tokens else None
        # The host inputs the device holds ({name: (vars, array)}, in stream order), for those
        # only the host writes (kind `input` in every stage: no op may write one): a call sends
        # only the inputs that differ, and a decode call stages the next one's (stage_next).
        # Runners in this process only (a placement's chain sends inputs with each item), and
        # only when every stage runs every forward (a Chain writes a stage's inputs only when
        # it runs).
        local = getattr(runner, "in_process", False) and all(
            f.name in s.sites for f in self.protocol.forwards for s in self.sessions)
        self.plain = _plain_inputs(self.sessions) if local else frozenset()
        self._held: dict[str, tuple[tuple, np.ndarray]] = {}
        self._rows: dict[int, tuple[list[int], np.ndarray]] = {}  # page-table rows by sequence
        # the last page-table matrix by table: (its sequences, their pages, the matrix), kept
        # so that a step of the same sequences and pages hands back the same array
        self._tables: dict[str, tuple[tuple[int, ...], list[list[int]], np.ndarray]] = {}
        # what `stage_next` wrote for the next decode call: ((seq, start) a row, their pages,
        # the inputs) for `inputs` to hand back as they are (used once)
        self._staged: tuple[tuple, list, dict[str, np.ndarray]] | None = None
        self._feeds: dict[tuple[str, int, int | None], TokenFeed | None] = {}
        self._drawers: dict[str, Session | None] = {}

    @property
    def keeps_inputs(self) -> bool:
        """Whether the device keeps host inputs between calls: staged ahead, fed on it."""
        return bool(self.plain)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence may hold (page-table width, and the pool)."""
        pages = min(self.width, self.pages) if self.width else self.pages
        return pages * self.stride

    def forward(self, kind: str, groups: int) -> proto.Forward:
        """The program of a `decode` or `chunk` call of `groups` sequences."""
        if kind == "decode":
            found = self.protocol.forward(groups, 1) or self.chunk_program
        else:
            found = self.protocol.forward(groups, proto.VAR_ROWS) or self.step_program
        if found is None:
            raise KernccError.single(f"no program takes {groups} sequences of a {kind} call")
        return found

    # ------------------------------------------------------------------------ checks

    def _vocab(self) -> int | None:
        """Rows of the table the token ids index (the embedding), when the manifest says."""
        fill = self.protocol.token_rows()
        for s in self.sessions:
            buf = s.manifest.buffers.get(fill.name) if fill else None
            target = buf.domain.index_into if buf is not None and buf.domain else None
            table = s.manifest.buffers.get(target) if target else None
            if table is not None:
                return table.dims_at(s.manifest.vars_max())[0]
        return None

    def _check_inputs(self) -> None:
        """Every input the served programs read is a fill or a page table the runner writes."""
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

    # ------------------------------------------------------------------------ calls

    def capture_graphs(self, sequences: int) -> int:
        """Capture, on every stage that lives here, the graph of the one-row forward a call of
        1 to `sequences` sequences takes (the protocol's tightest, as a step picks it), so that
        no step of a server waits for a capture the first time its batch has a new size; the
        graphs made or found (0 on a backend without graphs)."""
        if not getattr(self.runner, "in_process", False):
            return 0
        made = 0
        for groups in range(1, min(sequences, self.protocol.max_groups(1)) + 1):
            forward = self.protocol.forward(groups, 1)
            vars = self.protocol.vars(groups, groups, groups, 1)
            made += sum(s.capture(forward.name, stage_vars(s.manifest, vars))
                        for s in self.sessions if forward.name in s.sites)
        return made

    def submit(self, forward: proto.Forward, rows: Sequence[Rows], outputs: Collection[str],
               feed: Feed | None = None, draws: Draws | None = None,
               drawn_later: bool = False) -> Any:
        """Issue `rows` through `forward` without waiting; the call's pending `outputs`.
        `feed`: the token input is written on the device by `feed(vars)` (the call before
        hands it over, `feeder`), not sent from the host. `draws`: (params, counters), one
        of each per sequence of a decode call: its tokens are drawn on the device into the
        token output (`draws_on_device` said yes), which comes back among the outputs.
        `drawn_later`: the forward alone, its tokens drawn by `draw` once its draws are
        known (a grammar's mask needs the token of the call in flight before it); the token
        output is not among the outputs until then."""
        count = sum(r.n for r in rows)
        inputs = self.inputs(rows, tokens=feed is None, staged=True)
        vars = self.protocol.vars(len(rows), count, count, max(r.start + r.n for r in rows))
        send = self._unheld(inputs, vars)
        drawn = draws is not None or drawn_later
        try:
            if feed is not None:
                feed(vars)
                self._held.pop(self._token_input, None)  # the device's, not the host's
            wanted = set(outputs) - {forward.emits} if drawn else outputs
            if isinstance(self.runner, Chain):
                pending = self.runner.submit(forward.name, send, vars, rows=count,
                                             outputs=wanted)
            else:
                pending = self.runner.submit(forward.name, send, vars, outputs=wanted)
            if draws is not None:
                pending = self.draw(forward, pending, draws)
        except Exception:
            self._held.clear()  # some inputs may be written, others not
            raise
        self._hold(inputs, vars)
        return pending

    def draw(self, forward: proto.Forward, pending: Any, draws: Draws) -> Any:
        """The tokens of the call `submit(drawn_later=True)` gave `pending` for, drawn on the
        device by `draws` into its token output (read after the draw, as `submit(draws=...)`
        reads it); the call's pending outputs with them. That call must be the last one
        issued: the logits buffer holds its logits (nothing is issued between the two), and
        a call fed from its token output after the draw reads the drawn tokens (stream
        order)."""
        drawer = self._drawers[forward.name]
        return _Joined(pending, drawer.sample_into(LOGITS, forward.emits, *draws))

    def stage_next(self, rows: Sequence[Rows]) -> None:
        """While a decode call of `rows` runs, write the inputs (but the tokens) the same
        sequences' next decode call will take, if none of them needs a page more for it:
        between two steps the host then sends the tokens only. Whatever the next call turns
        out to be (a sequence ended or got a page, a chunk came in), `submit` sends what
        differs."""
        if not self.plain or any(r.start + r.n >= len(r.pages) * self.stride for r in rows):
            return
        # Rows(...) rather than `_replace`: a fifth of its cost, 128 of them a step
        nxt = [Rows(r.seq, r.prompt, r.generated, r.pages, r.start + r.n, 1) for r in rows]
        vars = self.protocol.vars(len(nxt), len(nxt), len(nxt), max(r.start + 1 for r in nxt))
        staged = {name: array for name, array in self.inputs(nxt, tokens=False).items()
                  if name in self.plain}
        try:
            self.runner.stage_inputs(self._unheld(staged, vars), vars)
        except KernccError:
            self._held.clear()  # some may be written; the next call sends everything
            return
        self._hold(staged, vars)
        # the next call's `inputs` hands these back (the same arrays: `_unheld` sees them
        # held at once) rather than building them again and comparing them element by element
        self._staged = (_rows_key(nxt), [list(r.pages) for r in nxt], staged)  # copies: a
        # pool's row grows in place

    def reset(self) -> None:
        """Forget what the device holds (the runner may have run other work since)."""
        self._held.clear()
        self._staged = None

    def forget(self, seq: int) -> None:
        """Sequence `seq` ended: its page-table row goes."""
        self._rows.pop(seq, None)

    def _unheld(self, inputs: dict[str, np.ndarray], vars: dict[str, int]
                ) -> dict[str, np.ndarray]:
        """The inputs the device does not hold yet at these vars (all but `plain` ones)."""
        key = tuple(sorted(vars.items()))
        held = self._held
        # `is` first: a staged input or an unchanged page-table matrix is the very array held
        # (never written in place), and comparing a 128-sequence table cost a scan a call
        return {name: array for name, array in inputs.items()
                if not (name in self.plain and name in held and held[name][0] == key
                        and (held[name][1] is array or np.array_equal(held[name][1], array)))}

    def _hold(self, inputs: dict[str, np.ndarray], vars: dict[str, int]) -> None:
        key = tuple(sorted(vars.items()))
        for name, array in inputs.items():
            if name in self.plain:
                self._held[name] = (key, array)

    # ------------------------------------------------------------------------ inputs

    def inputs(self, rows: Sequence[Rows], tokens: bool = True, staged: bool = False
               ) -> dict[str, np.ndarray]:
        """The inputs of a call of `rows` (`tokens`: with the fed tokens, else without).
        `staged`: those `stage_next` wrote for exactly these rows (their sequences, starts and
        pages) are handed back as they are, built once, the rest built; either way used once."""
        found, self._staged = self._staged, None
        inputs: dict[str, np.ndarray] = {}
        if staged and found is not None and found[0] == _rows_key(rows) \
                and found[1] == [r.pages for r in rows]:
            inputs.update(found[2])
        for f in self.protocol.fills:
            if f.name not in inputs and f.fill in INPUT_FILLS and (tokens or f.fill != "token"):
                values = self._fill_values(f, rows)
                inputs[f.name] = np.asarray(values, dtype=numpy_dtype(f.dtype))
        for t in self.protocol.page_tables:
            if t.name not in inputs:
                inputs[t.name] = self._table(t, rows)
        return inputs

    def _table(self, table: proto.PageTable, rows: Sequence[Rows]) -> np.ndarray:
        """The page-table matrix of a call of `rows`: the last one's array itself when the
        same sequences hold the same pages (a decode step's, most steps: stacking 128 rows of
        256 and comparing them to the device's cost ~0.1 ms a step), else a new array, with
        only the rows whose pages changed rebuilt when the sequences are the same."""
        seqs, pages = tuple(r.seq for r in rows), [r.pages for r in rows]
        kept = self._tables.get(table.name)
        if kept is not None and kept[0] == seqs and kept[2].shape[1] == table.width:
            if kept[1] == pages:
                return kept[2]
            matrix = kept[2].copy()  # never in place: the device's copy is compared to it
            for i, r in enumerate(rows):
                if kept[1][i] != r.pages:
                    matrix[i] = self._table_row(r, table.width)
        else:
            matrix = np.stack([self._table_row(r, table.width) for r in rows])
        self._tables[table.name] = (seqs, [list(p) for p in pages], matrix)
        return matrix

    def _table_row(self, rows: Rows, width: int) -> np.ndarray:
        """A sequence's page-table row (its pages, then zeros), rebuilt only when its pages
        change: a 32-sequence step rebuilt 32 rows of `width` from lists every call."""
        kept = self._rows.get(rows.seq)
        if kept is None or kept[1].shape[0] != width or kept[0] != rows.pages:
            row = np.zeros(width, np.int32)
            row[:len(rows.pages)] = rows.pages
            kept = self._rows[rows.seq] = (list(rows.pages), row)
        return kept[1]

    def _fill_values(self, f: proto.Filled, rows: Sequence[Rows]) -> list[int] | np.ndarray:
        ones = all(r.n == 1 for r in rows)  # a decode call: a row a sequence
        if f.fill == "token":
            if f.axis == "groups" or ones:
                return [r.token(r.start) for r in rows]
            return [t for r in rows for t in r.tokens()]
        if f.fill == "position":
            if ones:
                return [r.start for r in rows]
            return np.concatenate([np.arange(r.start, r.start + r.n) for r in rows])
        if f.fill == "valid":
            return [1] * sum(r.n for r in rows)
        if f.fill == "slot":  # numpy: a 2048-row chunk's slots in Python took about 0.5 ms
            stride = self.stride
            if ones:
                return [r.pages[r.start // stride] * stride + r.start % stride for r in rows]
            return np.concatenate([slots(r.pages, stride, r.start, r.start + r.n)
                                   for r in rows])
        if f.fill == "seq_len":
            return [r.start + r.n for r in rows]
        if f.fill == "cu_seqlens":
            ends = list(itertools.accumulate(r.n for r in rows))
            return [0] + ends + [ends[-1]] * (f.axis.n - 1 - len(ends))  # type: ignore[union-attr]
        return [0]  # span_at: no run in a plain call

    # ------------------------------------------------------------------------ steps ahead

    def draws_on_device(self, forward: proto.Forward) -> bool:
        """Whether a call of `forward` may have its tokens drawn on the device
        (`submit(draws=...)`): its stages are in this process, the last one that runs it
        writes both the logits and the token output, and that output is the library's argmax
        over the logits' rows (`Session.token_range`: [0, vocab), vocab the logits' width),
        so a drawn token lies where the argmax's would. Worked out once per program."""
        if forward.name not in self._drawers:
            self._drawers[forward.name] = self._drawer(forward)
        return self._drawers[forward.name] is not None

    def _emitter(self, forward: proto.Forward) -> tuple[Session, tuple[int, int]] | None:
        """The last stage in this process that runs `forward`, and the values its token
        output can hold (`Session.token_range`); None where either is unknown."""
        if forward.emits is None or not getattr(self.runner, "in_process", False):
            return None
        runs = [s for s in self.sessions if forward.name in s.sites]
        span = runs[-1].token_range(forward.name, forward.emits) if runs else None
        return None if span is None else (runs[-1], span)

    def _drawer(self, forward: proto.Forward) -> Session | None:
        found = self._emitter(forward)
        if found is None or LOGITS not in found[0].manifest.buffers:
            return None
        source, span = found
        logits = source.manifest.buffers[LOGITS]
        dims = logits.dims_at(source.manifest.vars_max())
        if logits.dtype != "f32" or len(dims) != 2 or dims[1] != span[1] + 1:
            return None
        return source

    def feeder(self, forward: proto.Forward, groups: int, call: int | None = None
               ) -> TokenFeed | None:
        """How a decode call of `forward` at `groups` sequences has its token input written
        on the device from the token output of the call of `forward` before it
        (`Session.feed`, row for row), worked out once; None where the stages cannot prove
        the fed values fit that input's domain (`token_range`, `fits_domain`: those bytes
        pass no host check), `forward` hands back no token, or the runner's stages are not
        in this process. `call`: the call is the call-th of a step of several decode calls,
        which all write the one token output: it reads the copy that the same call of the
        step before kept (`TokenFeed.keep`, right after it and its draw), not the output."""
        key = (forward.name, groups, call)
        if key not in self._feeds:
            self._feeds[key] = self._feeder(forward, self.protocol.vars(groups, groups,
                                                                        groups, 1), call)
        return self._feeds[key]

    def _feeder(self, forward: proto.Forward, vars: dict[str, int], call: int | None
                ) -> TokenFeed | None:
        names = {f.name for f in self.protocol.fills if f.fill == "token"}
        found = self._emitter(forward)
        if len(names) != 1 or found is None:
            return None
        name, (source, span) = next(iter(names)), found
        targets = [s for s in self.sessions if name in s.stage.host_inputs]
        if not targets or not all(
                t.fits_domain(name, *span, stage_vars(t.manifest, vars)) for t in targets):
            return None
        # a copy kept under the program's name too: only a call of `forward` writes it, so
        # `span`, proven for `forward`'s output, covers what the feed reads
        slot = None if call is None else (forward.name, call)
        return TokenFeed(name, source, forward.emits, targets, slot)


class TokenFeed:
    """A decode call's token input written on the device (`ModelRunner.feeder`): calling it
    with the call's vars feeds every stage that takes the input, from the token output of the
    call before, or from the copy of it kept under `slot` (`keep`: after each call of a step
    of several calls, since the next one writes the output again)."""

    def __init__(self, name: str, source: Session, output: str, targets: Sequence[Session],
                 slot: tuple[str, int] | None) -> None:
        self.name, self.source, self.output = name, source, output
        self.targets, self.slot = list(targets), slot

    def __call__(self, vars: dict[str, int]) -> None:
        for target in self.targets:
            target.feed(self.name, self.source, self.output, stage_vars(target.manifest, vars),
                        kept=self.slot)

    def keep(self) -> None:
        """Keep the token output as the call just issued left it (after its draw, if drawn
        on the device) for the same call of the step after; nothing without a slot."""
        if self.slot is not None:
            self.source.keep(self.output, self.slot)



def _rows_key(rows: Sequence[Rows]) -> tuple[tuple[int, int, int], ...]:
    """What names a call's rows but their tokens and pages: (seq, start, n) each."""
    return tuple((r.seq, r.start, r.n) for r in rows)


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


def _plain_inputs(sessions: Sequence[Session]) -> frozenset[str]:
    """Host inputs of kind `input` in every stage that takes them (no op writes one)."""
    kinds: dict[str, set[str]] = {}
    for s in sessions:
        for name in s.stage.host_inputs:
            kinds.setdefault(name, set()).add(s.manifest.buffers[name].kind)
    return frozenset(name for name, found in kinds.items() if found == {"input"})
