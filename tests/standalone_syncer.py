"""A `ddiloco syncer` started by hand, as docs/clusters.md ("By hand") runs one, for the integration tests that start
its learners themselves: the run's token file, a free port and the syncer on it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ddiloco.checkpoint import read_json
from tests.helpers import wait_until

TOKEN = "standalone-process-test-token-0123"


def write_token(path: Path, token: str) -> Path:
    path.write_text(token)
    os.chmod(path, 0o600)
    return path


def unused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_syncer(procs, run_dir, token_file, *extra, name="syncer"):
    """A syncer on a free port; its address, once its DIR/syncer.json names this process."""
    popen = procs.start(name, "syncer", "--run-dir", str(run_dir), "--token-file", str(token_file), *extra)
    info = wait_until(lambda: (read_json(run_dir / "syncer.json") or {}).get("pid") == popen.pid
                      and read_json(run_dir / "syncer.json"), f"{name} serving", alive=[popen])
    return popen, info["address"]
