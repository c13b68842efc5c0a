"""The serving protocol (spec §4): what a verified manifest tells a serving loop, checked once.

`check(verified)` reads the axes, fills, tables and forwards off a verified manifest, every
problem collected, and returns a `Protocol` (`model`) the serving loop queries instead of naming
buffers, programs or vars itself. The rules live in `axes` (axes, fills, tables) and `forwards`
(programs).
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostics
from kerncc.protocol import axes as axes_rules
from kerncc.protocol import forwards as forwards_rules
from kerncc.protocol.model import *  # noqa: F403  (the result types are the package's API)
from kerncc.protocol.model import DERIVED_NOTE, HEADLINE, Protocol
from kerncc.verify import Verified


def check(verified: Verified, sampled: bool = True) -> Protocol:
    """Read the serving contract off a verified manifest, or raise every reason it does not fit.

    `sampled` (kern's `Protocol::check`) also requires some forward to hand tokens back; pass
    False for host-sampled models and pipeline stages before the last (`check_unsampled`).
    """
    if not isinstance(verified, Verified):
        raise TypeError("the protocol reads a Verified manifest; run kerncc.verify.verify first")
    manifest = verified.manifest
    diags = Diagnostics()
    axes = axes_rules.read_axes(manifest, diags)
    if axes is None:
        diags.raise_if_any(HEADLINE)
        raise AssertionError("axes missing without a diagnostic")
    fills = axes_rules.read_fills(manifest, axes, diags)
    pages, lines = axes_rules.read_tables(manifest, axes, diags)
    forwards = forwards_rules.read_forwards(manifest, axes, fills, sampled, diags)
    diags.raise_if_any(HEADLINE)
    return Protocol(
        rows=axes.rows, groups=axes.groups, tray=axes.tray, fills=tuple(fills),
        page_tables=tuple(pages), line_tables=tuple(lines), forwards=tuple(forwards.forwards),
        once=_flagged(manifest, "once"), derive=_flagged(manifest, "derive"),
        span=forwards.span, context=forwards.context, axes_derived=axes.derived,
        note=DERIVED_NOTE if axes.derived else None)


def check_unsampled(verified: Verified) -> Protocol:
    """`check` without requiring a forward that hands tokens back (host sampling, early stages)."""
    return check(verified, sampled=False)


def _flagged(manifest: m.Manifest, flag: str) -> tuple[str, ...]:
    return tuple(sorted(name for name, p in manifest.programs.items() if getattr(p, flag)))

