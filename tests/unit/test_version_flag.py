"""`ddiloco --version` names the wire schema beside the package version: processes of one run must share the schema
(another is refused as `bad_schema`, whose message points here), and the package version alone (0.1.0 in every
version probed) told two versions apart no better than nothing."""

from __future__ import annotations

import subprocess
import sys

from ddiloco import __version__
from ddiloco.messages import SCHEMA_VERSION


def test_the_version_flag_names_the_wire_schema():
    done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ddiloco {__version__} (wire schema {SCHEMA_VERSION})"
