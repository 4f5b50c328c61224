"""The lock that decides which syncer serves a run directory (`ddiloco.runtime.syncer_standby`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ddiloco.runtime.syncer_standby import SyncerLock

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(120)
"""


def test_the_lock_is_refused_while_a_live_process_holds_it_and_free_once_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "syncer.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = SyncerLock(tmp_path)
        assert not lock.try_acquire()
        assert lock.holder() == str(holder.pid)  # named in "another syncer (pid N) serves DIR"
        holder.send_signal(signal.SIGKILL)  # the kernel releases a flock at the holder's death, kill -9 included
        holder.wait()
        deadline = time.monotonic() + 10
        while not lock.try_acquire():
            assert time.monotonic() < deadline, "the lock was not released"
            time.sleep(0.01)
        assert lock.holder() == str(os.getpid())
        assert not SyncerLock(tmp_path).try_acquire()  # one holder: a second open of the file is refused too
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
