"""The progress line: readable numbers, no `nan`, and few enough lines for a notebook cell."""

import io
import json
import math

import pytest

from podracer.session import logger as logger_module
from podracer.session.logger import RunLogger, format_duration, progress_line


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(logger_module, "clock", fake)
    return fake


def _row(steps: int, sps: float = 1000.0, episode_return=None, **more) -> dict:
    return {"env_steps": steps, "sps": sps, "episode_return_mean": episode_return, **more}


def _progress_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("steps")]


def _screen(text: str) -> str:
    """What a terminal shows for `text` on one line: `\\r` returns to column 0, then overwrites."""
    shown: list[str] = []
    column = 0
    for char in text:
        if char == "\r":
            column = 0
        else:
            shown[column:column + 1] = [char]
            column += 1
    return "".join(shown)


@pytest.mark.parametrize("seconds, text", [
    (0, "0:00:00"), (59.6, "0:01:00"), (3600, "1:00:00"), (112359.6, "31:12:40"),
    (math.nan, "-:--:--"), (math.inf, "-:--:--"), (None, "-:--:--"), (-1.0, "-:--:--"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_progress_line_reads_steps_percentage_elapsed_and_eta():
    line = progress_line(100_352, 500_000, 23_456.0, 21.5, 4.2)
    assert "steps     100,352/500,000 (20%)" in line
    assert "23,456 steps/s" in line and "return    21.50" in line
    # 399,648 steps left at 23,456 steps/s is 17 s.
    assert "elapsed 0:00:04" in line and line.endswith("eta 0:00:17")
    assert "mean params" not in line
    # Rounded down: 100% only when the run is done.
    assert "(99%)" in progress_line(499_999, 500_000, 1.0, 1.0, 0.0)
    assert "(100%)" in progress_line(500_000, 500_000, 1.0, 1.0, 0.0)
    assert "eta -:--:--" in progress_line(0, 500_000, 0.0, 1.0, 0.0)
    assert "mean params   475.25" in progress_line(1, 2, 1.0, 300.0, 0.0, mean_params_return=475.25)


def test_no_nan_before_the_first_episode(tmp_path, clock):
    stream = io.StringIO()
    log = RunLogger(str(tmp_path), 1000, stream=stream, min_interval_s=0.0)
    log.log(_row(100, sps=0.0))  # nothing measured yet
    log.log(_row(200, episode_return=math.nan))
    log.log(_row(300, mean_params_return=None))  # evolution strategies, before an evaluation
    lines = _progress_lines(stream.getvalue())
    assert len(lines) == 3
    for line in lines:
        assert "nan" not in line.lower() and "return        -" in line
    assert "mean params        -" in lines[2]
    log.log(_row(1000, episode_return=12.5))
    assert "return    12.50" in _progress_lines(stream.getvalue())[-1]
    log.summary({"env_steps": 1000})


def test_a_long_run_prints_few_lines_but_writes_every_row(tmp_path, clock):
    stream = io.StringIO()
    log = RunLogger(str(tmp_path), 100_000, stream=stream)
    for i in range(1000):  # 1,000 rows over 20 s
        clock.now += 0.02
        log.log(_row((i + 1) * 100, episode_return=float(i)))
    lines = _progress_lines(stream.getvalue())
    # The first row, one each 5 s, and the final row.
    assert 2 <= len(lines) <= 5
    assert "100,000/100,000 (100%)" in lines[-1] and "return   999.00" in lines[-1]
    log.summary({"env_steps": 100_000})
    assert _progress_lines(stream.getvalue()) == lines
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["env_steps"] for row in rows] == [(i + 1) * 100 for i in range(1000)]


def test_summary_first_shows_the_last_row_held_back(tmp_path, clock):
    # A run stopped early (a signal): its last row is not the final step count.
    stream = io.StringIO()
    log = RunLogger(str(tmp_path), 100_000, stream=stream)
    for i in range(10):
        clock.now += 0.1
        log.log(_row((i + 1) * 100, episode_return=float(i)))
    assert len(_progress_lines(stream.getvalue())) == 1
    log.summary({"env_steps": 1000})
    text = stream.getvalue()
    lines = _progress_lines(text)
    assert len(lines) == 2 and "1,000/100,000" in lines[-1]
    assert text.index(lines[-1]) < text.index("summary\n")


def test_terminal_rewrites_one_line_in_place(tmp_path, clock):
    stream = Terminal()
    log = RunLogger(str(tmp_path), 10**9, stream=stream)
    log.log(_row(1, sps=10**8, episode_return=1.0, mean_params_return=1.0))  # a long line first
    for i in range(100):  # 100 rows in 1 s: at most about 10 rewrites
        clock.now += 0.01
        log.log(_row(i + 2, sps=10.0, episode_return=2.0))
    text = stream.getvalue()
    assert "\n" not in text and text.startswith("\r")
    assert 2 <= text.count("\r") <= 12
    # The shorter line blanks the tail of the longer one it overwrites.
    first, last = text.split("\r")[1].rstrip(), text.split("\r")[-1].rstrip()
    assert len(last) < len(first) and "10 steps/s" in last
    assert _screen(text).rstrip() == last
    # The summary first shows the row the rate limit held back, then starts a new line.
    log.summary({"env_steps": 101})
    shown, summary = stream.getvalue().split("\n", 1)
    assert "101/1,000,000,000" in _screen(shown) and summary.startswith("summary\n")


def test_compiled_says_so_and_starts_the_elapsed_clock(tmp_path, clock):
    stream = io.StringIO()
    log = RunLogger(str(tmp_path), 1000, stream=stream)
    clock.now = 100.0
    log.compiled(4.26)
    clock.now = 104.0
    log.log(_row(500, episode_return=1.0))
    printed = stream.getvalue().splitlines()
    assert printed[0] == "compiled in 4.3 s; training"
    assert "elapsed 0:00:04" in printed[1]
    # Rows keep counting wall time from the logger's start, as plots of runs expect.
    log.summary({"env_steps": 500})
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["wall_s"] == 104.0

    quiet = io.StringIO()
    RunLogger(str(tmp_path / "other"), 1000, stream=quiet, enabled=False).compiled(1.0)
    assert quiet.getvalue() == ""
