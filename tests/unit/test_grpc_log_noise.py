"""gRPC core's own INFO lines (a failed TLS handshake at every retry) do not reach a ddiloco process's stderr, unless
the environment asks for them (`GRPC_VERBOSITY`)."""

from __future__ import annotations

import os
import subprocess
import sys

HANDSHAKE = """
import ddiloco, grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(1))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials())  # TLS to a plain server
try:
    grpc.channel_ready_future(channel).result(timeout=1.5)
except grpc.FutureTimeoutError:
    print("not ready")
"""


def handshake_stderr(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"} | env
    result = subprocess.run([sys.executable, "-c", HANDSHAKE], capture_output=True, text=True, timeout=60,
                            env=environment)
    assert result.stdout.strip() == "not ready", result
    return result.stderr


def test_a_failed_tls_handshake_prints_no_grpc_line_but_the_environment_may_ask_for_them():
    assert "Handshake failed" not in handshake_stderr()
    assert "Handshake failed" in handshake_stderr(GRPC_VERBOSITY="INFO")  # (a control: the lines exist)
