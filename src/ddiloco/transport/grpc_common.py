"""What the gRPC server and its clients agree on: metadata keys, refusal reasons, channel options.

Both sides import these from here, so a client never imports the server.
"""

from __future__ import annotations

from ddiloco.transport.grpc_codec import MAX_MESSAGE_BYTES

TOKEN_KEY = "ddiloco-token"
SESSION_KEY = "ddiloco-session"
"""Metadata of every call a learner makes: which process makes it (host/pid/random), so a second live process with
the same learner id is told apart from the same process joining again, and a process another one replaced can no
longer act for the learner."""
SCHEMA_KEY = "ddiloco-schema-version"
REASON_KEY = "ddiloco-reason"
KEEPALIVE_TIME_MS = 10_000
"""HTTP/2 pings every 10 s on idle connections, so a dead peer on another machine is noticed."""
KEEPALIVE_TIMEOUT_MS = 5_000
"""A ping unanswered this long ends the connection and its calls: a silent partition (a pulled cable, a NAT that
forgot the connection) is noticed about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS after it starts. It is given to
both `grpc.keepalive_timeout_ms` and `grpc.http2.ping_timeout_ms`: grpcio 1.85 bounds the wait by the second, whose
default is 60 s, so with the first alone a learner behind a dead link read itself connected for 60-70 s."""
MIN_PING_INTERVAL_MS = 5_000
"""The server accepts pings this often (must not exceed the clients' keepalive time)."""
RECONNECT_BACKOFF_MS = (100, 2_000)
"""(first, longest) delay between the starts of a client channel's connection attempts (a refused connection, a
syncer restarting, fails at once: the learner finds it back within about 2 s)."""
MIN_CONNECT_TIMEOUT_MS = 10_000
"""The least time a connection attempt is given to finish its handshake (TCP, TLS, HTTP/2 settings): a TLS handshake
at a 1.2 s round trip takes about 2.4 s, and this covers round trips up to about 4 s. It is also how long a learner
given a syncer and its standbys (`--syncer A,B`) waits on a host that answers nothing (its machine gone) before it tries
the next (gRPC's default, 20 s, would double that). gRPC core reads it from `grpc.min_reconnect_backoff_ms`, a name that
reads like a backoff: with it at 100 ms, an attempt is cut after the current backoff, at most about 2.4 s, and a
handshake slower than that never finishes (a probe: over TLS at a 1.2 s round trip both learners exited `unreachable`;
at 600 ms a learner took 4.4 s instead of 1.1 s to its Welcome; tests/integration/test_far_link.py)."""

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's own reconnect backoff grows to minutes by default; a learner waiting for a restarted
    # syncer should find it within a couple of seconds.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),  # (the least time an attempt is given)
]
"""Options shared by the server and its clients."""

ANOTHER_PROCESS = "another_process"
"""The reason of a call refused because another process holds its learner id: a second live process joining, or a
process that another one replaced (after it fell silent or its stream ended) still calling. Such a process stops and
leaves the learner's checkpoint to the process that holds the id."""

NO_GENESIS = "no_genesis"
"""The reason of a Subscribe refused because the run has no global model yet (the learner then pushes its
initial parameters with PushGenesis and subscribes again)."""
