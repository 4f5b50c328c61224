"""`ddiloco --version` names the wire schema beside the package version: processes of one run must share the schema
(another is refused as `bad_schema`, whose message points here), and the package version alone (0.1.0 in every
version probed) told two versions apart no better than nothing; from a checkout it names the commit too
(`ddiloco.build_info`, tests/unit/test_build_info.py)."""

from __future__ import annotations

import subprocess
import sys

from ddiloco.build_info import build_id
from ddiloco.messages import SCHEMA_VERSION


def test_the_version_flag_names_the_wire_schema():
    done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ddiloco {build_id()} (wire schema {SCHEMA_VERSION})"


def test_python_m_ddiloco_is_the_ddiloco_command():
    # `python -m ddiloco` answered "No module named ddiloco.__main__" (an environment without its scripts on PATH).
    done = subprocess.run([sys.executable, "-m", "ddiloco", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ddiloco {build_id()} (wire schema {SCHEMA_VERSION})"


def test_a_refusal_for_another_schema_names_this_processs_schema_whatever_the_syncer_says():
    # A syncer of an older version refuses a newer learner without the hint a current syncer gives: the learner adds it.
    import grpc

    from ddiloco.transport.grpc_client import error_text
    from ddiloco.transport.grpc_common import REASON_KEY

    class Refusal(grpc.RpcError):
        def __init__(self, details: str) -> None:
            self._details = details

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return self._details

        def trailing_metadata(self) -> tuple:
            return ((REASON_KEY, "bad_schema"),)

    old = "bad_schema: wire schema version 6, but the syncer speaks 5: run the same ddiloco version everywhere"
    assert error_text(Refusal(old)) == (f"FAILED_PRECONDITION: {old} (this process speaks wire schema "
                                        f"{SCHEMA_VERSION}; `ddiloco --version` shows each one's)")
    current = old + " (`ddiloco --version` shows each one's schema)"
    assert error_text(Refusal(current)) == f"FAILED_PRECONDITION: {current}"  # said once
