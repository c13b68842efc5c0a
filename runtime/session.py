"""Sessions: one stage of a bundle loaded on a backend and run; a Chain runs every stage.

`Session(bundle, stage)` allocates the stage's memory from its plan (kerncc.runtime.memory),
checks every weight's and derive source's `bind` against the checkpoint's headers, streams the
weights to the device (kerncc.runtime.loader), runs the `derive` programs inside loading with
the staging plan (sources streamed into their windows just before the first call that reads
them, the staging freed after), runs the `once` programs (`load_times` says where the seconds
went), and then serves
`run(program, inputs, vars)`: host inputs written and domain-checked, the program's launches
issued (through stage.py's generated functions when the stage has them, else by interpreting
plan.json's launch records, `when` gates included), the outputs it writes handed back.
Workspaces are dead between runs; everything else persists. `submit` issues a run without
waiting (its `Pending.result()` waits); programs marked `graph` are captured once per
assignment of the vars they read and replayed on backends with graphs (cuda), and other driven
programs once an assignment repeats (`graphs="auto"`). Chains of stages
are in kerncc.runtime.chain.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from kerncc import manifest as m
from kerncc import protocol as proto
from kerncc.analysis.access import call_access
from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.kernels import library
from kerncc.progress import progress
from kerncc.runtime import domains
from kerncc.runtime.backends import make_backend
from kerncc.runtime.backends.base import Backend, BackendError, Launcher
from kerncc.runtime.bundle import Bundle, Stage, bundle_error
from kerncc.runtime.footprint import check_fits, fitting_capacity, page_tokens, stage_footprint
from kerncc.runtime.launch import PlanError, Site, evaluate, parse_sites, plan_error
from kerncc.runtime.memory import Memory, default_token_capacity, numpy_dtype
from kerncc.runtime.loader import Loader, Target
from kerncc.runtime.weights import CheckpointLike, open_checkpoint, plan_buffer
from kerncc.verify import verify

HOST_WRITTEN = ("input", "inout")
LAUNCH_FAILURES = (BackendError, ValueError, IndexError, TypeError)
GRAPH_POLICIES = ("auto", "marked", "off")
AUTO_GRAPHS = 16  # graphs per program beyond those marked `graph` (distinct chunk sizes)
_stage_modules = itertools.count()


def graph_policy(graphs: bool | str) -> str:
    """`auto` (graph programs, and other driven programs once a var assignment repeats),
    `marked` (only programs marked `graph`) or `off`; True means auto, False off."""
    if graphs is True or graphs is False:
        return "auto" if graphs else "off"
    if graphs not in GRAPH_POLICIES:
        raise KernccError.single(f"unknown graph policy `{graphs}` "
                                 f"(known: {', '.join(GRAPH_POLICIES)})")
    return graphs


def open_bundle(bundle: Bundle | str | os.PathLike) -> Bundle:
    if isinstance(bundle, Bundle):
        return bundle
    if not isinstance(bundle, (str, os.PathLike)):
        raise KernccError.single(f"bundle: expected a Bundle or the path of a bundle directory, "
                                 f"got {type(bundle).__name__}")
    return Bundle.open(bundle)


def open_backend(backend: str | Backend) -> Backend:
    if isinstance(backend, str):
        return make_backend(backend)
    if not isinstance(backend, Backend):
        raise KernccError.single(f"backend: expected a backend name or object, got "
                                 f"{type(backend).__name__}")
    return backend


def check_token_capacity(token_capacity: int | None) -> None:
    """None (the default capacity) or a whole number of at least one token."""
    if token_capacity is None:
        return
    if not domains.is_whole(token_capacity) or token_capacity < 1:
        raise KernccError.single(f"token_capacity {token_capacity!r}: expected a whole number "
                                 "of at least 1, or None for the default")


def as_mapping(value: Any, name: str) -> Mapping:
    """`inputs` or `vars` of a run: a mapping by name, or None for none."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise KernccError.single(f"{name}: expected a mapping by name, got "
                                 f"{type(value).__name__}")
    return value


def stage_vars(manifest: m.Manifest, vars: Mapping[str, int]) -> dict[str, int]:
    """The vars of `vars` that `manifest` (one stage's) declares."""
    return {n: v for n, v in vars.items() if n in manifest.vars}


def _var_value(value: Any) -> bool:
    """A var's value: a whole number (an integral float such as 3.0 is taken too)."""
    return domains.is_whole(value) or (isinstance(value, float) and value.is_integer())


class Session:
    """One stage of a bundle, loaded on a backend and ready to run programs."""

    in_process = True  # inputs may be staged ahead and fed on the device (model_runner)

    def __init__(self, bundle: Bundle | str | os.PathLike, stage: int = 0,
                 backend: str | Backend = "cpu", checkpoint: CheckpointLike = None,
                 token_capacity: int | None = None, interpret: bool = False,
                 graphs: bool | str = "auto", allow_nonfinite: bool = False) -> None:
        self.bundle = open_bundle(bundle)
        self.allow_nonfinite = allow_nonfinite  # load NaN and infinite weights unrefused
        if not domains.is_whole(stage):
            raise KernccError.single(f"stage {stage!r}: expected a whole number")
        if not 0 <= stage < len(self.bundle.stages):
            raise KernccError.single(f"the bundle has {len(self.bundle.stages)} stages; "
                                     f"there is no stage {stage}")
        self.stage: Stage = self.bundle.stages[stage]
        self.manifest = self.stage.manifest
        policy = graph_policy(graphs)  # a typo is refused on every backend, not only on cuda
        check_token_capacity(token_capacity)
        self.backend = open_backend(backend)
        self.backend.activate()
        self.graphs = policy if self.backend.graphs else "off"
        self._graphs: dict[tuple, Any] = {}
        self._seen: dict[tuple, int] = {}
        self.token_capacity = token_capacity or fitting_capacity(
            [(self.stage.index, self.manifest, self.stage.plan)], self.backend.free_bytes(),
            default_token_capacity(self.manifest), self.backend.device_bytes)
        page = page_tokens(self.manifest)
        if self.token_capacity < page:  # the pool's page ids would index past its slots
            raise KernccError.single(
                f"a KV pool of {self.token_capacity} token slots (--kv-tokens, token_capacity) "
                f"holds not one page of {page} tokens: give at least {page}")
        self._check_fits()
        self.memory = Memory(self.backend, self.manifest, self.stage.plan, self.token_capacity)
        self.last_vars = self._vars({})
        self._env = self.last_vars
        self._derive_base: dict[str, int] = {}
        self._uploaded: set[str] = set()
        self._derived: set[str] = set()
        self._writes: dict[str, list[str]] = {}  # program -> the buffers it hands back
        self._tensors = open_checkpoint(checkpoint if checkpoint is not None
                                         else self.bundle.checkpoint)
        self._loader: Loader | None = None
        self._sources: dict[str, Target] = {}
        self.load_times: dict[str, float] = {}  # seconds by phase (bench/scale.py shows them)
        # copies of outputs a feed to come reads (`keep`): (buffer, slot) -> allocation
        self._kept: dict[tuple[str, Hashable], Any] = {}
        try:
            self._load(interpret)
        finally:
            self._close_loader()
            self._close_checkpoint()

    def __repr__(self) -> str:
        return f"Session(stage {self.stage.index} of {self.bundle!r}, {self.backend.name})"

    @property
    def programs(self) -> list[str]:
        """The programs `run` accepts (derive programs ran at load and are gone)."""
        return [name for name in self.sites if name not in self._derived]

    @property
    def generated(self) -> bool:
        """Whether runs go through the stage's generated stage.py (else plan.json is read)."""
        return bool(self._fast)

    # ------------------------------------------------------------------------ loading

    def _check_fits(self) -> None:
        """Refuse a stage whose planned memory does not fit the device, before any allocation
        (a Chain has checked its stages together already; this covers a Session alone)."""
        footprint = stage_footprint(self.stage.index, self.manifest, self.stage.plan,
                                    self.token_capacity)
        check_fits([footprint], self.backend.free_bytes(), repr(self.backend),
                   self.backend.device_bytes)

    def _load(self, interpret: bool) -> None:
        derive = sorted((n for n, p in self.manifest.programs.items() if p.derive),
                        key=str.encode)
        if derive:
            self.memory.stage(self.stage.plan.get("staging", {}))
        self.sites = self._parse_sites()
        self._by_number = {s.number: s for sites in self.sites.values() for s in sites}
        self.backend.add_modules(dict(self.stage.modules))
        self._launchers = self.backend.rewrite_launchers(self.sites, self._prepare_sites(),
                                                         program_bounds(self.manifest),
                                                         step_programs(self.manifest))
        self._graph_vars = {name: sorted(set().union(*(s.vars_read() for s in sites)))
                            for name, sites in self.sites.items()}
        self._fast = {} if interpret else self._load_stage_py()
        self._timed("weights", self._load_weights)
        self._timed("derive", self._run_derive, derive)
        self._close_loader()
        self._timed("once", self._run_once)

    def _timed(self, phase: str, step: Callable, *args: Any) -> None:
        started = time.perf_counter()
        step(*args)
        self.load_times[phase] = time.perf_counter() - started

    def _run_once(self) -> None:
        for name in sorted((n for n, p in self.manifest.programs.items() if p.once),
                           key=str.encode):
            self._execute(name, self._vars({}))
        self.backend.sync()  # the device's share of loading is counted here, not at a first run

    def _parse_sites(self) -> dict[str, list[Site]]:
        try:
            return parse_sites(self.stage.plan, self.memory)
        except PlanError as err:
            raise plan_error(str(self.stage.plan_path()), "", str(err)) from None

    def _prepare_sites(self) -> dict[int, Launcher]:
        """Every launch's launcher, built once (kernels and externs checked before any run)."""
        problems, launchers = [], {}
        for site in self._by_number.values():
            try:
                if site.kind == "extern":
                    self.backend.check_extern(site.extern_name)
                else:
                    self.backend.check_kernel(site.entry, site.module)
                launchers[site.number] = self.backend.prepare(site)
            except BackendError as err:
                problems.append(Diagnostic(f"{site.where()}: {err}",
                                           Location(file=str(self.stage.plan_path()))))
        if problems:
            raise KernccError(f"stage {self.stage.index} cannot run on the "
                              f"{self.backend.name} backend:", problems)
        return launchers

    def _load_stage_py(self) -> dict[str, Callable]:
        """The stage's functions, compiled from kerncc's rendering of its plan (never from the
        bundle's stage.py, which kerncc.bundle.reader checked to be the same listing)."""
        code = self.stage.code
        if code is None:
            return {}
        path = self.stage.stage_py
        namespace: dict[str, Any] = {"__name__": f"_kerncc_stage_{next(_stage_modules)}"}
        try:
            # kerncc's own rendering of the checked plan, never text read from the bundle
            exec(compile(code, f"<kerncc rendering of {path}>", "exec"), namespace)  # noqa: S102
        except Exception as err:  # noqa: BLE001 - a failure of the rendering is kerncc's
            raise bundle_error(path, f"cannot load: {type(err).__name__}: {err}") from None
        programs = namespace.get("PROGRAMS")
        if not isinstance(programs, dict):
            raise bundle_error(path, "stage.py defines no PROGRAMS dict")
        return {name: fn for name, fn in programs.items() if name in self.sites}

    def _load_weights(self) -> None:
        """Every weight streamed to the device (kerncc.runtime.loader), after every weight's
        and every derive source's segments were checked against the checkpoint."""
        weights = sorted((n for n, b in self.manifest.buffers.items() if b.kind == "weight"),
                         key=str.encode)
        if not weights and not self.memory.windows:
            return
        targets = [self._target(name, self.memory.buffer(name), 0) for name in weights]
        self._sources = {name: self._target(name, self.memory.staging, int(window["offset"]))
                         for name, window in self.memory.windows.items()}
        self._loader = Loader(self.backend, self._require_checkpoint(),
                              finite=not self.allow_nonfinite)
        label = f"stage {self.stage.index} weights"
        with progress(total=sum(t.nbytes for t in targets), label=label, unit="B") as bar:
            self._stream(targets, bar.update)

    def _stream(self, targets: list[Target], update: Callable[[int], None] | None = None
                ) -> None:
        try:
            self._loader.load(targets, update)
        except KernccError as err:
            headline = f"{err.headline} (checkpoint: {self._checkpoint_name})"
            raise self.stage.located(KernccError(headline, err.diagnostics)) from None

    def _target(self, name: str, allocation: Any, offset: int) -> Target:
        """Buffer `name`'s bind segments checked against the checkpoint (headers only)."""
        buf = self.manifest.buffers[name]
        tensors = self._require_checkpoint()
        nbytes = buf.nbytes(self.manifest.vars_max())
        where = f"/buffers/{name}/bind"
        dtype = numpy_dtype(buf.dtype)
        try:
            pieces = plan_buffer(buf.bind, tensors, dtype, nbytes, where=where)
        except KernccError as err:
            headline = f"{err.headline} (checkpoint: {self._checkpoint_name})"
            raise self.stage.located(KernccError(headline, err.diagnostics)) from None
        return Target(name, where, dtype, allocation, offset, tuple(pieces))

    def _close_loader(self) -> None:
        """Wait for the loader's copies and give its staging back (its times are kept)."""
        if self._loader is None:
            return
        loader, self._loader = self._loader, None
        loader.close()
        for key, value in loader.stats.as_dict().items():
            self.load_times[f"load_{key}"] = value

    def _require_checkpoint(self) -> Callable[[str], np.ndarray]:
        if self._tensors is None:
            index = self.bundle.dir / "bundle.json"
            raise KernccError.single(f"stage {self.stage.index} binds weights from a checkpoint, "
                                     f"but none was given and `{index}` records none "
                                     "(give one: `kerncc run --weights FILE`, `checkpoint=`)",
                                     "/checkpoint")
        return self._tensors.get

    @property
    def _checkpoint_name(self) -> str:
        return self._tensors.name if self._tensors else "none"

    def _close_checkpoint(self) -> None:
        if self._tensors is not None and self._tensors.owned is not None:
            self._tensors.owned.close()
        self._tensors = None

    # ------------------------------------------------------------------------ derive

    def _run_derive(self, names: list[str]) -> None:
        """Run derive programs in name order over the staged sources, then drop them."""
        if not names:
            return
        count = 0
        for name in names:
            self._derive_base[name] = count
            count += len(self.stage.plan["programs"][name].get("calls", []))
        for name in names:
            self._execute(name, self._vars({}))
        self.backend.sync()
        self.memory.unstage()
        self._derived = set(names)

    def _arrive(self, call: int) -> None:
        """Upload the sources whose window is live at derive call `call` and not yet there."""
        for source, window in self.memory.windows.items():
            live = int(window["first"]) <= call <= int(window["last"])
            if not live or source in self._uploaded:
                continue
            # stream-ordered behind the window's previous occupant's launches (a synchronous
            # backend has finished them)
            started = time.perf_counter()
            self._stream([self._sources[source]])
            self.load_times["sources"] = self.load_times.get("sources", 0.0) + (
                time.perf_counter() - started)
            self._uploaded.add(source)

    # ------------------------------------------------------------------------ running

    def run(self, program: str, inputs: Mapping[str, Any] | None = None,
            vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """Write `inputs`, run `program` at `vars` (unset vars are 1), return its outputs."""
        return self.submit(program, inputs, vars).result()

    def submit(self, program: str, inputs: Mapping[str, Any] | None = None,
               vars: Mapping[str, int] | None = None,
               outputs: bool | Collection[str] = True) -> Pending:
        """`run` without waiting: the launches and the outputs' downloads are issued, and
        `result()` waits for them. On a GPU the host goes on while the device works.
        `outputs` says which outputs come back: all the program writes (True), none (False: a
        chain's inner stages, whose outputs cross), or those named (a server needs the logits
        and the token, not an inout buffer of megabytes a chunk)."""
        self.backend.activate()
        self._check_program(program)
        env = self._vars(vars)
        self._write_inputs(as_mapping(inputs, "inputs"), env)
        self._execute(program, env)
        self.last_vars = env
        written = self._written(program)
        if outputs is not True:
            wanted = set(outputs or ())
            written = [name for name in written if name in wanted]
        return Pending({name: self._read_async(name, env) for name in written})

    def stage_inputs(self, inputs: Mapping[str, Any],
                     vars: Mapping[str, int] | None = None) -> None:
        """Write host inputs of a run to come, checked as `submit` checks them, ordered after
        everything issued so far (on a GPU the host goes on: the copies wait on the stream for
        the runs before them). A later `submit` that does not name an input runs on the bytes
        staged here: a driver writes what it already knows of the next step while this one
        runs, and only the rest (the token this step hands back) once it is known."""
        self.backend.activate()
        self._write_inputs(as_mapping(inputs, "inputs"), self._vars(vars))

    def _write_inputs(self, inputs: Mapping[str, Any], env: dict[str, int]) -> None:
        for name, value in inputs.items():
            self._write_host(name, value, env)

    def _check_program(self, program: str) -> None:
        if program in self._derived:
            raise KernccError.single(f"program `{program}` is a derive program: it ran inside "
                                     "loading and cannot run again")
        if not isinstance(program, str) or program not in self.sites:
            known = ", ".join(f"`{p}`" for p in self.programs)
            raise KernccError.single(f"stage {self.stage.index} has no program `{program}` "
                                     f"(it has {known})")

    def _vars(self, given: Mapping[str, int] | None) -> dict[str, int]:
        env = {name: 1 for name in self.manifest.vars}
        for name, value in as_mapping(given, "vars").items():
            var = self.manifest.vars.get(name)
            if var is None:
                raise KernccError.single(f"var `{name}` is not a var of stage "
                                         f"{self.stage.index} (its vars: "
                                         f"{', '.join(sorted(self.manifest.vars)) or 'none'})")
            if not _var_value(value):
                raise KernccError.single(f"var `{name}` = {value!r} is not a whole number")
            if not 1 <= value <= var.max:
                raise KernccError.single(f"var `{name}` = {value} is outside [1, {var.max}]")
            env[name] = int(value)
        return env

    def _execute(self, program: str, env: dict[str, int]) -> None:
        self._env = env
        self.backend.stream_joined()  # callers may have used the stream between runs
        graph = self._graph(program, env)
        if graph is None:
            self._issue_program(program, env)
        else:
            self.backend.replay(graph)

    def capture(self, program: str, vars: Mapping[str, int] | None = None) -> bool:
        """Capture the graph of `program`, a program marked `graph`, at `vars` now, ahead of
        its first run there (that run then replays it): a server does this at start so that
        no step waits for a capture. False where no graph is made (a backend without graphs,
        the `off` policy, a program not marked `graph`); True where one is or was."""
        self.backend.activate()
        self._check_program(program)
        declared = self.manifest.programs[program]
        if self.graphs == "off" or not declared.graph or declared.once or declared.derive:
            return False
        env = self._vars(vars)
        key = self._graph_key(program, env)
        if key not in self._graphs:
            self._env = env
            self.backend.stream_joined()
            self._capture(key, program, env)
        return True

    def _graph_key(self, program: str, env: dict[str, int]) -> tuple:
        """A program's graph is one per assignment of the vars its launches read."""
        return (program, *(env[v] for v in self._graph_vars[program]))

    def _capture(self, key: tuple, program: str, env: dict[str, int]) -> Any:
        graph = self._graphs[key] = self.backend.capture(lambda: self._issue_program(program, env))
        return graph

    def _graph(self, program: str, env: dict[str, int]) -> Any:
        """The graph to replay for `program` at `env`, captured now if it is time; None: issue
        the launches one by one.

        A program marked `graph` is captured at its first run at each assignment of the vars
        its launches read. Under the `auto` policy any other driven program is captured too,
        once an assignment comes back (a prefill chunk size seen before), up to
        AUTO_GRAPHS assignments per program: its launches depend on nothing but those vars
        (inputs are read from buffers at fixed addresses), so a replay issues exactly them.
        """
        if self.graphs == "off":
            return None
        declared = self.manifest.programs[program]
        if declared.once or declared.derive:
            return None
        key = self._graph_key(program, env)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        if not declared.graph:
            seen = self._seen.get(key, 0)
            self._seen[key] = seen + 1
            captured = sum(1 for k in self._graphs if k[0] == program)
            if self.graphs != "auto" or seen == 0 or captured >= AUTO_GRAPHS:
                return None
        return self._capture(key, program, env)

    def _issue_program(self, program: str, env: dict[str, int]) -> None:
        fast = self._fast.get(program)
        if fast is not None:
            fast(_StageHandle(self), dict(env))
            return
        for site in self.sites[program]:
            if not site.gated_off(env):
                self._issue(site, site.grid_at(env), site.var_values(env))

    def _issue(self, site: Site, grid: tuple[int, int, int], scalars: Sequence[int]) -> None:
        if site.program in self._derive_base and self.memory.staging is not None:
            self._arrive(self._derive_base[site.program] + site.call)
        shared = site.shared_mem if isinstance(site.shared_mem, int) \
            else evaluate(site.shared_mem, self._env)
        try:
            self._launchers[site.number](grid, shared, scalars)
        except LAUNCH_FAILURES as err:
            raise KernccError.single(f"stage {self.stage.index}, {site.where()}, entry "
                                     f"`{site.entry}`: the launch failed: {err}") from None

    def _written(self, program: str) -> list[str]:
        """Output and inout buffers the program's calls write, in name order (worked out once
        per program: on a GPU it was most of a chunk's host time)."""
        written = self._writes.get(program)
        if written is None:
            found: set[str] = set()
            for call in self.manifest.programs[program].calls:
                found |= call_access(call, self.manifest.ops.get(call.op)).buffer_writes
            kinds = ("output", "inout")
            written = self._writes[program] = sorted(
                (n for n in found if self.manifest.buffers[n].kind in kinds), key=str.encode)
        return written

    # ------------------------------------------------------------------------ buffers

    def _buffer(self, name: str) -> m.Buffer:
        buf = self.manifest.buffers.get(name)
        if buf is None:
            raise KernccError.single(f"stage {self.stage.index} has no buffer `{name}`")
        if name not in self.memory.buffers:
            raise KernccError.single(f"buffer `{name}` is a {buf.kind}: it has no memory of "
                                     "its own between runs")
        return buf

    def read(self, name: str, vars: Mapping[str, int] | None = None) -> np.ndarray:
        """A copy of buffer `name`, shaped at `vars` (default: the last run's)."""
        buf = self._buffer(name)
        env = self.last_vars if vars is None else self._vars(vars)
        dims = buf.dims_at(env)
        self.backend.activate()
        raw = self.backend.download(self.memory.buffer(name), 0, buf.nbytes(env))
        return raw.view(numpy_dtype(buf.dtype)).reshape(dims)

    def sample(self, buffer: str, rows: Sequence[int], params: Sequence[Any],
               counters: Sequence[tuple[int, int]]) -> np.ndarray:
        """One token (int32) per listed row of f32 logits buffer `buffer` [rows, vocab] at the
        last run's vars: rows[i] sampled with params[i] (`kerncc.runtime.sampling.
        SamplingParams`) and the Philox counter counters[i] = (sequence, step). On cuda the
        tokens are picked on the device and only they come back."""
        from kerncc.runtime import sampling

        return sampling.sample(self, buffer, rows, params, counters)

    def sample_into(self, buffer: str, output: str, params: Sequence[Any],
                    counters: Sequence[tuple[int, int]]) -> Pending:
        """Rows 0..n-1 of f32 logits `buffer` (n = len(params), at the last run's vars) drawn
        into i32 buffer `output` on the device, after everything issued so far, as `sample`
        draws them; the pending download of `output`. A run to come may read the tokens
        there (`feed`) before they reach the host. Rows with logits processing
        (kerncc.runtime.processing.Processed) add their results under `processing.HEARD`."""
        from kerncc.runtime import processing, sampling

        heard = sampling.sample_into(self, buffer, output, params, counters)
        outputs: dict[str, Any] = {output: self._read_async(output, self.last_vars)}
        if heard is not None:  # processed rows: their results, heard when taken
            outputs[processing.HEARD] = heard
        return Pending(outputs)

    def _read_async(self, name: str, env: dict[str, int]) -> _Output:
        buf = self.manifest.buffers[name]
        raw = self.backend.download_async(self.memory.buffer(name), 0, buf.nbytes(env))
        return _Output(raw, numpy_dtype(buf.dtype), tuple(buf.dims_at(env)))

    def device_array(self, name: str, vars: Mapping[str, int] | None = None) -> DeviceArray:
        """Buffer `name` in place on the GPU, shaped at `vars` (default: the last run's), for
        other GPU libraries: it has `__cuda_array_interface__` (numba.cuda.as_cuda_array,
        cupy.asarray, torch.as_tensor take it without a copy). Only on the cuda backend."""
        buf = self._buffer(name)
        if self.backend.name != "cuda":
            raise KernccError.single(f"buffer `{name}` lives on the {self.backend.name} "
                                     "backend; device arrays exist on cuda only (use `read`)")
        env = self.last_vars if vars is None else self._vars(vars)
        allocation = self.memory.buffer(name)
        return DeviceArray(allocation.ptr, tuple(buf.dims_at(env)), numpy_dtype(buf.dtype),
                           int(self.backend.stream_handle))  # type: ignore[attr-defined]

    def write(self, name: str, array: Any, vars: Mapping[str, int] | None = None) -> None:
        """Write buffer `name` (shape at `vars`, default: read off the array's shape)."""
        buf = self._buffer(name)
        given = vars if vars is not None else domains.vars_from_shape(buf, array)
        env = self._vars(given)
        self._store(name, buf, array, env)

    def _write_host(self, name: str, value: Any, env: dict[str, int]) -> None:
        buf = self._buffer(name)
        if buf.kind not in HOST_WRITTEN:
            raise KernccError.single(f"`{name}` is a {buf.kind} buffer; the host writes only "
                                     "input and inout buffers before a run")
        self._store(name, buf, value, env)

    def _store(self, name: str, buf: m.Buffer, value: Any, env: dict[str, int]) -> None:
        try:
            array = domains.host_array(name, buf, value, env, numpy_dtype(buf.dtype))
            if buf.kind in HOST_WRITTEN:
                domains.check(name, buf, array, env, self._index_rows)
        except KernccError as err:
            raise self.stage.located(err) from None
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.backend.activate()
        self.backend.upload(self.memory.buffer(name), 0, data)

    def _index_rows(self, target: str, env: dict[str, int]) -> int | None:
        """Rows an `index_into` target has (spec §1.6); None when unbounded."""
        if target in self.manifest.buffers:
            return self.manifest.buffers[target].dims_at(env)[0]
        state = self.manifest.states.get(target)
        if state is None or state.host is not None:
            return None
        if state.bytes_per_token:
            return self.token_capacity
        if state.bytes_per_seq:
            return self.memory.seq_slots * state.bytes_per_seq
        return None

    # ------------------------------------------------------------------------ device feeds

    def token_range(self, program: str, name: str) -> tuple[int, int] | None:
        """The values buffer `name` can hold once `program` has run, when this stage can prove
        them: [0, vocab) when the last launch of `program` that touches the buffer is the
        library's `argmax_f32` writing it (ungated, `vocab` a constant); None when it cannot.
        A driver feeds such a buffer into an input on the device (`feed`) only where this
        range lies in that input's domain: the bytes then never pass the host's checks."""
        buf = self.manifest.buffers.get(name)
        if buf is None or name not in self.memory.buffers or buf.dtype != "i32":
            return None
        address = self._address(self.backend.pointer(self.memory.buffer(name), 0))
        last = next((site for site in reversed(self.sites.get(program, []))
                     if address in (self._address(arg) for arg in site.args)), None)
        if (last is None or last.kind != "kernel" or last.entry != "argmax_f32"
                or last.when is not None or len(last.args) != 4
                or last.module != library.index()["sampling"]["sha256"]
                or self._address(last.args[1]) != address
                or not isinstance(last.args[3], np.generic)):
            return None
        vocab = int(last.args[3])
        return (0, vocab - 1) if vocab >= 1 else None

    def fits_domain(self, name: str, low: int, high: int,
                    vars: Mapping[str, int] | None = None) -> bool:
        """Whether every value in [low, high] lies in input `name`'s domain at `vars`."""
        buf = self._buffer(name)
        return buf.kind in HOST_WRITTEN and domains.admits(buf, self._vars(vars),
                                                           self._index_rows, low, high)

    def _address(self, arg: Any) -> int | None:
        """A launch argument's device address, or None when it is no pointer."""
        if isinstance(arg, np.ndarray):
            return self.backend.address(arg)
        if type(arg) is int:
            return arg
        return None

    def feed(self, name: str, source: Session, output: str,
             vars: Mapping[str, int] | None = None, kept: Hashable | None = None) -> None:
        """Write input `name` at `vars` from `source`'s buffer `output` (this stage or another
        one), device to device, after everything issued so far: a run to come reads it as if
        the host had written it. `kept`: from the copy of `output` that `source` kept under
        that slot (`keep`) instead of the buffer itself. The caller has proven the values fit
        (`token_range`, `fits_domain`): no host check sees them."""
        buf, given = self._buffer(name), source._buffer(output)
        origin = source.memory.buffer(output) if kept is None else source._kept.get((output,
                                                                                    kept))
        if origin is None:
            raise KernccError.single(f"cannot feed input `{name}` from a copy of `{output}` "
                                     f"kept under {kept!r}: none was kept")
        nbytes = buf.nbytes(self._vars(vars))
        if buf.kind not in HOST_WRITTEN or given.dtype != buf.dtype or nbytes > int(
                origin.nbytes):
            raise KernccError.single(f"cannot feed input `{name}` ({buf.dtype}) from "
                                     f"`{output}` ({given.dtype})")
        source._copy_to(self, origin, self.memory.buffer(name), nbytes)

    def keep(self, output: str, slot: Hashable) -> None:
        """Copy buffer `output` whole into a copy kept under `slot`, on the device after
        everything issued so far, for a feed to come (`feed(kept=slot)`) that must read these
        bytes after later runs have written `output` again (the several decode calls of one
        serving step all write one token output). The copy holds what `output` held, so the
        caller's proof of its values (`token_range`) covers it."""
        self._buffer(output)
        allocation = self.memory.buffer(output)
        nbytes = int(allocation.nbytes)
        copy = self._kept.get((output, slot))
        if copy is None:
            self.backend.activate()
            try:
                copy = self.backend.allocate(nbytes)
            except (MemoryError, BackendError) as err:
                raise KernccError.single(f"cannot keep a copy of `{output}` ({nbytes} bytes) "
                                         f"on the {self.backend.name} backend: {err}") from None
            self._kept[(output, slot)] = copy
        self.backend.activate()
        self.backend.copy(allocation, 0, copy, 0, nbytes)

    def transfer(self, name: str, target: Session, vars: Mapping[str, int]) -> None:
        """Copy buffer `name`'s bytes at `vars` into the same-named buffer of `target`."""
        buf = target._buffer(name)
        self._buffer(name)
        nbytes = buf.nbytes(target._vars(vars))
        self._copy_to(target, self.memory.buffer(name), target.memory.buffer(name), nbytes)

    def _copy_to(self, target: Session, source: Any, sink: Any, nbytes: int) -> None:
        """`nbytes` from this stage's allocation `source` into `target`'s `sink`: on the
        device when both are one backend or can send to each other, else through the host."""
        if target.backend is self.backend:
            self.backend.activate()
            self.backend.copy(source, 0, sink, 0, nbytes)
            return
        send = getattr(self.backend, "send", None)
        if send is not None and type(target.backend) is type(self.backend):
            send(source, target.backend, sink, nbytes)  # device to device, no host wait
            return
        self.backend.activate()
        data = self.backend.download(source, 0, nbytes)
        target.backend.activate()
        target.backend.upload(sink, 0, data)


class DeviceArray:
    """A view of device memory by the CUDA Array Interface (version 3), owning nothing."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, stream: int) -> None:
        self.ptr, self.shape, self.dtype, self.stream = ptr, shape, dtype, stream

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": self.stream or None}

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, {self.shape}, {self.dtype})"


class _Output:
    """One output's pending download, shaped on arrival."""

    def __init__(self, raw: Any, dtype: np.dtype, dims: tuple[int, ...]) -> None:
        self.raw, self.dtype, self.dims = raw, dtype, dims

    def result(self) -> np.ndarray:
        return self.raw.result().view(self.dtype).reshape(self.dims)


class Pending:
    """A submitted run: `result()` waits for its outputs ({buffer name: array})."""

    def __init__(self, outputs: dict[str, _Output]) -> None:
        self._outputs = outputs
        self._done: dict[str, np.ndarray] | None = None

    def result(self) -> dict[str, np.ndarray]:
        if self._done is None:
            self._done = {name: out.result() for name, out in self._outputs.items()}
        return self._done


class _StageHandle:
    """The `rt` stage.py's functions launch through."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def launch(self, site: int, grid: Sequence[int] | None, scalars: Sequence[int] = ()) -> None:
        """Issue launch `site`; `grid` is None for an extern launch."""
        s = self._session
        found = s._by_number.get(site)
        if found is None:
            raise KernccError.single(f"stage.py launches site {site}, which plan.json lacks")
        shape = (1, 1, 1) if grid is None else (int(grid[0]), int(grid[1]), int(grid[2]))
        s._issue(found, shape, scalars)


def program_bounds(manifest: m.Manifest) -> dict[str, dict[str, int]]:
    """Each program's vars at their largest in any call of it: the vars' bounds, tightened for
    a `batch` program of fixed rows a sequence (a decode step calls with at most its groups
    times its rows), so a GEMM site of the decode step is known to stay small even where the
    rows var's bound is a prefill chunk's. A stage the serving protocol does not fit keeps the
    vars' bounds."""
    widest = manifest.vars_max()
    try:
        axes = proto.check_unsampled(verify(manifest))
    except KernccError:
        axes = None
    steps = step_programs(manifest)
    bounds = {}
    for name, program in manifest.programs.items():
        env = dict(widest)
        batch = program.batch
        if axes is not None and name in steps:
            rows, groups = axes.rows.var, axes.groups.var
            env[groups] = min(env.get(groups, batch.groups), batch.groups)
            env[rows] = min(env.get(rows, batch.groups * batch.rows), batch.groups * batch.rows)
        bounds[name] = env
    return bounds


def step_programs(manifest: m.Manifest) -> frozenset[str]:
    """The programs that run a decode step (a `batch` of fixed rows a sequence: `decode`,
    `decode_batch`): one row a sequence whatever their batch bound, so a backend gives their
    GEMM sites one path at every batch size (runtime/backends/cuda.py `_invariant_extern`),
    and a sequence's step computes the same bits alone as among 128 others."""
    return frozenset(name for name, program in manifest.programs.items()
                     if program.batch is not None and program.batch.span is None
                     and isinstance(program.batch.rows, int))

