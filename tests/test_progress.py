"""kerncc.progress: a bar on a terminal, silence everywhere else."""

from __future__ import annotations

import io

import pytest

from kerncc.progress import Progress, progress, render, should_draw


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    assert list(progress(range(5), "work", stream=out)) == [0, 1, 2, 3, 4]
    with progress(total=10, label="bytes", unit="B", stream=out) as bar:
        bar.update(10)
    assert out.getvalue() == ""


def test_silent_under_kerncc_no_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNCC_NO_PROGRESS", "1")
    assert not should_draw(Terminal())
    monkeypatch.setenv("KERNCC_NO_PROGRESS", "0")
    assert should_draw(Terminal())


def test_draws_on_a_terminal_and_erases_on_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNCC_NO_PROGRESS", raising=False)
    term = Terminal()
    bar = Progress(range(4), "load", stream=term, min_interval=0)
    assert bar.enabled
    assert list(bar) == [0, 1, 2, 3]
    text = term.getvalue()
    assert "load [" + "#" * 24 + "] 4/4 100%" in text
    assert text.endswith("\r" + " " * len("load [" + "#" * 24 + "] 4/4 100%") + "\r")
    assert "\n" not in text


def test_closes_when_the_loop_raises() -> None:
    term = Terminal()
    bar = Progress(range(4), "x", stream=term, enabled=True, min_interval=0)
    with pytest.raises(RuntimeError):
        for i in bar:
            if i == 2:
                raise RuntimeError("boom")
    assert term.getvalue().endswith("\r")  # the line is erased: the bar closed


def test_throttles_redraws() -> None:
    term = Terminal()
    with Progress(label="n", total=1000, stream=term, enabled=True, min_interval=3600) as bar:
        for _ in range(999):
            bar.update()
        drawn = term.getvalue().count("\r")
        bar.update()  # the last one is always drawn
    assert drawn == 1
    assert "1000/1000 100%" in term.getvalue()


def test_render() -> None:
    assert render("w", 3, 12, "tensors") == "w [######..................] 3/12 tensors 25%"
    assert render("", 1536, 3 * 1024 * 1024, "B").endswith("1.5 KiB/3.0 MiB 0%")
    assert render("loading", 17, None, "") == "loading 17"
    assert render("x", 20, 10, "") == "x [" + "#" * 24 + "] 20/10 100%"


def test_update_by_hand_needs_no_iterable() -> None:
    bar = progress(label="x", stream=io.StringIO())
    with pytest.raises(TypeError):
        iter(bar).__next__()
