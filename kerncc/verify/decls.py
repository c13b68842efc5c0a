"""Verifier rule groups 1-6 and 9 (spec §2.1): the declarations, and which of them go unused.

`check_declarations` checks what a manifest declares before anything uses it: the schema version,
vars (bounds, one var per axis), topology groups, the `cut` block, states (sizes, host layout),
buffers (in `verify/buffers.py`) and modules (sha256, the registry ref in `source`, spec §1.7).
`check_unused` is rule group 9; it runs last, once every other rule group has recorded what it
saw in `checker.used`. `registry_url` is the one parser of a module `source` (spec §1.7).

Every message is kern's text behind kern's context prefix (``var `v`: ``, ``state `s`: ``,
``module `m`: ``), located by the JSON pointer of the offending value. Maps are walked in sorted
name order, as kern walks its BTreeMaps, so diagnostics come out in kern's order.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.diagnostics import pointer
from kerncc.verify.checker import Checker
from kerncc.verify.buffers import check_buffers

STATE_SIZES = ("bytes_per_token", "bytes", "bytes_per_seq")
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
HF_URL = "https://huggingface.co/{org}/{repo}/resolve/{rev}/{path}"


def check_declarations(c: Checker) -> None:
    """Rule groups 1-6, in kern's code order."""
    check_schema_version(c)
    check_vars(c)
    check_topology(c)
    check_cut(c)
    check_states(c)
    check_buffers(c)
    check_modules(c)

# ---------------------------------------------------------------------------- 1-3


def check_schema_version(c: Checker) -> None:
    version = c.m.schema_version
    if version != m.SCHEMA_VERSION:
        c.error(f"unsupported schema_version {version} (this runtime reads {m.SCHEMA_VERSION})",
                "/schema_version")


def check_vars(c: Checker) -> None:
    for name, var in sorted(c.m.vars.items()):
        if var.max < 1:
            c.error(f"var `{name}`: max must be >= 1", pointer("vars", name, "max"))
    for axis in m.AXES:
        names = sorted(name for name, var in c.m.vars.items() if var.axis == axis)
        if len(names) < 2:
            continue
        # One diagnostic per axis; it points at the first var that makes the axis ambiguous.
        listed = ", ".join(rust_debug_str(name) for name in names)
        c.error(f"vars [{listed}] all count the `{axis}` axis; one var does",
                pointer("vars", names[1], "axis"))


def check_topology(c: Checker) -> None:
    for group, size in sorted((c.m.topology or {}).items()):
        if size == 0:
            c.error(f"topology group `{group}`: size must be > 0",
                    pointer("topology", "groups", group))


def check_cut(c: Checker) -> None:
    cut = c.m.cut
    if cut is None:
        return
    wrong = [key for key, bad in (("id", not cut.id), ("stages", cut.stages < 2),
                                  ("stage", cut.stage >= cut.stages)) if bad]
    if not wrong:
        return
    # One message names the whole block; the pointer goes to the first field at fault.
    c.error(f"cut: stage {cut.stage} of {cut.stages} with id `{cut.id}`; a cut has at least "
            "2 stages, a stage below their count and an id", pointer("cut", wrong[0]))

# ---------------------------------------------------------------------------- 4: states


def check_states(c: Checker) -> None:
    for name, state in sorted(c.m.states.items()):
        ctx = f"state `{name}`"
        # The model keeps an absent size as 0, and kern omits zero sizes: 0 means "not set".
        sizes = [key for key in STATE_SIZES if getattr(state, key)]
        if state.host is not None:
            if sizes:
                c.error(f"{ctx}: a host state is sized by the host; bytes_per_token / bytes / "
                        "bytes_per_seq must be absent", pointer("states", name, sizes[0]))
            check_host_layout(c, name, state.host)
        elif not sizes:
            c.error(f"{ctx}: one of bytes_per_token / bytes / bytes_per_seq / host must be set",
                    pointer("states", name))
        elif len(sizes) > 1:
            c.error(f"{ctx}: bytes_per_token, bytes and bytes_per_seq are exclusive",
                    pointer("states", name, sizes[1]))


def check_host_layout(c: Checker, name: str, host: m.HostLayout) -> None:
    ctx, ptr = f"state `{name}`: host", pointer("states", name, "host")
    shape, strides = list(host.shape), list(host.strides)
    if len(shape) != len(strides) or not shape:
        c.error(f"{ctx}: {len(shape)} extents and {len(strides)} strides; want as many of each, "
                "at least one", ptr)
        return
    # The outermost extent is the host's block count, unknown until the host allocates.
    inner_zero = [i for i, extent in enumerate(shape) if i > 0 and extent == 0]
    if inner_zero:
        c.error(f"{ctx}: shape {shape}: only the outermost extent may be 0 (the host's count)",
                f"{ptr}/shape/{inner_zero[0]}")
    zero_stride = [i for i, stride in enumerate(strides) if stride == 0]
    if zero_stride:
        c.error(f"{ctx}: strides {strides}: a zero stride aliases elements",
                f"{ptr}/strides/{zero_stride[0]}")
    if inner_zero or zero_stride:
        return
    if host_row_bytes(host) > m.U64_MAX:
        # kerncc's wording around kern's "overflows 64 bits" (the spec elides the middle).
        c.error(f"{ctx}: shape {shape} with strides {strides}: one outer row overflows 64 bits",
                f"{ptr}/strides")


def host_row_bytes(host: m.HostLayout) -> int:
    """Bytes one outermost row spans: strides count elements, as torch strides do.

    A row reaches its last element, and the next row starts `strides[0]` elements on: the row
    takes whichever is further.
    """
    inner = zip(host.shape[1:], host.strides[1:], strict=True)
    last = sum((extent - 1) * stride for extent, stride in inner)
    return max(host.strides[0], last + 1) * m.DTYPE_SIZES[host.dtype]

# ---------------------------------------------------------------------------- 6: modules


class RegistryRefError(ValueError):
    """A module `source` that is neither a local file name nor a fetchable registry ref."""


def check_modules(c: Checker) -> None:
    for name, module in sorted(c.m.modules.items()):
        ctx = f"module `{name}`"
        sha = module.sha256
        if len(sha) != 64 or not set(sha) <= HEX_DIGITS:
            c.error(f"{ctx}: sha256 `{sha}` is not 64 hex chars",
                    pointer("modules", name, "sha256"))
        source_ptr = pointer("modules", name, "source")
        if not module.source:
            c.error(f"{ctx}: empty source", source_ptr)
            continue
        try:
            registry_url(module.source)
        except RegistryRefError as err:
            c.error(f"{ctx}: {err}", source_ptr)


def registry_url(source: str) -> str | None:
    """The URL a module `source` is fetched from (spec §1.7); None for a local file name.

    Raises RegistryRefError with kern's text for a malformed `https://` or `hf:` ref, or for any
    other `scheme://`.
    """
    if "://" in source:
        scheme, rest = source.split("://", 1)
        if scheme != "https":
            raise RegistryRefError(f"invalid registry ref `{source}`: only https:// and hf: "
                                   "sources are fetched")
        return _https_url(source, rest)
    if source.startswith("hf:"):
        return _hf_url(source, source[len("hf:"):])
    return None


def _https_url(source: str, rest: str) -> str:
    host, _, path = rest.partition("/")
    if not host or not path or any(ch.isspace() for ch in source):
        raise RegistryRefError(f"invalid registry ref `{source}`: expected https://<host>/<path>")
    return source


def _hf_url(source: str, rest: str) -> str:
    # A revision never holds `/`, so the last `@` is the one that starts it.
    path, at, rev = rest.rpartition("@") if "@" in rest else (rest, "", "")
    segments = path.split("/")
    bad_path = len(segments) < 3 or any(s in ("", ".", "..") for s in segments)
    bad_rev = bool(at) and (not rev or "/" in rev)
    if bad_path or bad_rev:
        raise RegistryRefError(f"invalid registry ref `{source}`: expected "
                               "hf:<org>/<repo>/<path>[@revision]")
    return HF_URL.format(org=segments[0], repo=segments[1], rev=rev or "main",
                         path="/".join(segments[2:]))

# ---------------------------------------------------------------------------- 9: unused


def check_unused(c: Checker) -> None:
    """Rule group 9: every declaration some rule group recorded in `checker.used`, or an error."""
    used = c.used
    families = (
        ("buffers", c.m.buffers, used.buffers, "buffer `{}` is never used by any program"),
        ("ops", c.m.ops, used.ops, "op `{}` is never called"),
        ("modules", c.m.modules, used.modules, "module `{}` is never launched"),
        ("states", c.m.states, used.states, "state `{}` is never used by any program"),
        ("vars", c.m.vars, used.vars, "var `{}` is never used"),
    )
    for key, declared, seen, text in families:
        for name in sorted(set(declared) - seen):
            c.error(text.format(name), pointer(key, name))
    for group in sorted(set(c.m.topology or {}) - used.groups):
        c.error(f"topology group `{group}` is never used (no peer buffer or rank arg names it)",
                pointer("topology", "groups", group))

# ---------------------------------------------------------------------------- text


def rust_debug_str(text: str) -> str:
    """A string as Rust's `{:?}` prints it (kern lists names that way: `["a", "b"]`)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    for raw, esc in (("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        escaped = escaped.replace(raw, esc)
    return f'"{escaped}"'
