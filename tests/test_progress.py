"""Progress as a person reads it: a bar on a terminal; in a log file plain lines, never carriage-return
frames, at most one every few seconds; per-pass lines thinned the same way, the last one always."""

from __future__ import annotations

import io
import os

from prunepipe.pipelines.progress import EveryFewSeconds, PlainProgress, progress, tracked, writes_to_terminal


def test_a_log_file_gets_plain_lines_with_the_rate(capsys):
    bar = progress(10, desc="pass 1/2", unit="sample", unit_scale=64, every_seconds=0.0)
    assert isinstance(bar, PlainProgress)  # pytest's captured stderr is no terminal
    for _ in range(3):
        bar.update(1)
    bar.set_postfix(loss="0.1234")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 4 and "\r" not in err
    assert lines[0].startswith("pass 1/2: 64/640 sample (") and "sample/s)" in lines[0]
    assert lines[-1].startswith("pass 1/2: 256/640 sample") and lines[-1].endswith(", loss 0.1234")


def test_plain_lines_wait_for_their_interval(capsys):
    bar = progress(1000, desc="reading", every_seconds=3600)
    for _ in range(1000):
        bar.update(1)
    assert capsys.readouterr().err == ""  # the caller prints its own summary


def test_disabled_progress_prints_nothing(capsys, monkeypatch):
    progress(5, disable=True, every_seconds=0).update(5)  # the other ranks
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert list(tracked(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_a_terminal_is_told_from_a_file():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        assert writes_to_terminal(terminal)
    os.close(leader)
    assert not writes_to_terminal(io.StringIO())


def test_pass_lines_in_a_file_are_thinned_but_the_last_is_kept():
    lines = EveryFewSeconds(seconds=3600, stream=io.StringIO())
    assert lines.due()  # the first
    assert not lines.due() and not lines.due()
    assert lines.due(force=True)  # the last pass
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        on_terminal = EveryFewSeconds(seconds=3600, stream=terminal)
        assert on_terminal.due() and on_terminal.due()
    os.close(leader)
