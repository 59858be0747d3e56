"""kvstore.tiers.locks: one holder at a time, named to the second; gone with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tiers.locks import FileLock, InUseError

HOLD = """
import sys, time
from kvstore.tiers.locks import FileLock
lock = FileLock(sys.argv[1], "the test thing")
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-P", "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    proc = holder(path)
    try:
        with pytest.raises(InUseError, match=rf"the thing is in use .*\(pid {proc.pid}\)"):
            FileLock(path, "the thing").acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # SIGKILL let it go: no stale file blocks the next holder.
    lock = FileLock(path, "the thing")
    lock.acquire()
    assert lock.held and path.read_text() == f"{os.getpid()}\n"
    second = FileLock(path, "the thing")  # another open file in this process conflicts too
    with pytest.raises(InUseError):
        second.acquire()
    lock.release()
    second.acquire()
    second.release()
    assert path.exists()  # never removed: that would race a new holder


def test_a_lock_file_that_cannot_be_made_names_itself(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot open the lock file of the thing") as caught:
        FileLock(tmp_path / "missing" / "x.lock", "the thing").acquire()
    assert caught.value.filename == str(tmp_path / "missing" / "x.lock")


def test_two_starting_at_once_get_one_lock(tmp_path: Path) -> None:
    path = tmp_path / "race.lock"
    procs = [subprocess.Popen([sys.executable, "-P", "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]  # fmt: skip
    try:
        # Each prints "held" and waits, or is refused and exits (its stdout then ends).
        said = [proc.stdout.readline() if proc.stdout else "" for proc in procs]
        assert said.count("held\n") == 1
        for proc, line in zip(procs, said, strict=True):
            if line != "held\n":
                assert proc.wait(30) != 0 and proc.stderr is not None
                assert "InUseError" in proc.stderr.read()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
