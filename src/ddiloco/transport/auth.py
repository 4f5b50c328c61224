"""The run token and TLS files: reading them, and refusing an open door.

Every call presents a token (gRPC metadata `ddiloco-token`), compared in constant time: the run's
shared token, or a learner's own token derived from it (`learner_token`). A learner's calls (join,
updates, heartbeats, leave, genesis) must carry the token of the learner id they act for, so a learner
can act only as itself; the run token is the operator's (status, evaluators, and the secret learner
tokens derive from). The token comes from a file (`--token-file`, e.g. the
`DIR/token` that `ddiloco run` writes with mode 0600) or from an environment variable named on the
command line (`--token-env`; the command module reads the variable, this module only checks the
value). TLS is optional: the syncer takes a certificate and key, learners the CA that signed it.

A syncer bound to a non-loopback address without a token would let anyone on the network join and
push updates; that needs an explicit `--allow-no-token`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
"""Shorter tokens are guessable; refused."""
LOOPBACK_NAMES = ("localhost",)


def read_token_file(path: str | Path) -> str:
    path = Path(path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ValueError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token file {path} cannot be read: {exc}") from None
    if os.name == "posix" and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Not fatal (a shared secret on a shared filesystem is the user's call), but worth a line.
        logger.warning("token file %s is readable by other users (chmod 600 it)", path)
    return check_token(token, f"token file {path}")


def check_token(token: str, source: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{source} holds a token of {len(token)} characters: use at least {MIN_TOKEN_CHARS} "
                         "(e.g. `python -c 'import secrets; print(secrets.token_hex(24))'`)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{source} holds a token with whitespace or control characters")
    return token


LEARNER_TOKEN_PREFIX = "ddiloco-learner-"


def learner_token(run_token: str, learner_id: int) -> str:
    """Learner `learner_id`'s own token, derived from the run token: `ddiloco-learner-N.` and an HMAC-SHA256
    of the id keyed by the run token. It proves that id and no other; a learner holding only its own token
    cannot derive anyone else's (`ddiloco token --learner N` prints it for a learner on another machine)."""
    digest = hmac.new(run_token.encode(), f"ddiloco learner {learner_id}".encode(), hashlib.sha256).hexdigest()
    return f"{LEARNER_TOKEN_PREFIX}{learner_id}.{digest}"


MAX_LEARNER_ID = 10**12 - 1
"""The largest learner id a learner token may prove (`learner_of_token` reads at most 12 digits)."""


def learner_of_token(run_token: str, presented: str) -> int | None:
    """The learner id a presented token proves (compared in constant time), or None if it is not a valid learner
    token of this run."""
    if not presented.startswith(LEARNER_TOKEN_PREFIX):
        return None
    number, dot, _ = presented[len(LEARNER_TOKEN_PREFIX):].partition(".")
    if not dot or not number.isdigit() or len(number) > len(str(MAX_LEARNER_ID)):
        return None
    learner_id = int(number)
    return learner_id if hmac.compare_digest(presented.encode(), learner_token(run_token, learner_id).encode()) \
        else None


def require_run_token(token: str, source: str) -> str:
    """`token` if it can be a run token (what the syncer serves with, and `ddiloco token` derives from); a learner's
    own token is refused, naming `source`: it proves one learner and derives nothing."""
    if token.startswith(LEARNER_TOKEN_PREFIX):
        raise ValueError(f"{source} holds a learner's token, not the run token: give the run token (DIR/token), from "
                         "which each learner's own is derived (`ddiloco token --token-file DIR/token --learner N`)")
    return token


def token_for_learner(token: str, learner_id: int) -> str:
    """What learner `learner_id` presents: its own token as given, or the one derived from a run token."""
    if token.startswith(LEARNER_TOKEN_PREFIX):
        claimed = token[len(LEARNER_TOKEN_PREFIX):].partition(".")[0]
        if claimed != str(learner_id):
            raise ValueError(f"the token given is learner {claimed}'s, not learner {learner_id}'s: give each learner "
                             "its own (`ddiloco token --learner N`)")
        return token
    return learner_token(token, learner_id)


def split_host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {address!r} is invalid: expected HOST:PORT, e.g. 127.0.0.1:50051")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"address {address!r} is invalid: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"address {address!r} is invalid: port {number} outside 0..65535")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # gRPC retried `::1:50051` as a name ("Misformatted domain name") for the whole connect timeout.
        raise ValueError(f"address {address!r} is invalid: an IPv6 address goes in brackets, [{host}]:{port}")
    return host.strip("[]"), number


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, token: str | None, *, allow_no_token: bool) -> None:
    host, _ = split_host_port(bind)
    if token is None and not is_loopback(host) and not allow_no_token:
        raise ValueError(f"--bind {bind} listens beyond this machine but no run token was given: pass "
                         "--token-file or --token-env (or --allow-no-token on a trusted network)")


def read_tls_files(cert: str | None, key: str | None) -> tuple[bytes, bytes] | None:
    """(key PEM, certificate PEM) for the server, or None without TLS. Both are parsed here, and the key checked
    against the certificate, so that a wrong file is named at the start (gRPC's own error is "Failed to bind to
    address", after a C-core line on stderr)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    try:
        key_pem, cert_pem = Path(key).read_bytes(), Path(cert).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read TLS file: {exc}") from None
    _check_certificates(cert_pem, f"--tls-cert {cert}")
    _check_key_pair(cert, key, key_pem)
    return key_pem, cert_pem


def read_ca_file(path: str | None) -> bytes | None:
    """The PEM certificates a client verifies the syncer with (`--tls-ca`), or None without TLS. A file that holds
    no PEM certificate is refused here, not after the connect timeout ("Failed to create security handshaker")."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read --tls-ca file: {exc}") from None
    _check_certificates(data, f"--tls-ca {path}")
    return data


def _check_certificates(pem: bytes, source: str) -> None:
    """ValueError naming `source` unless `pem` holds PEM certificates OpenSSL can parse."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError):
        raise ValueError(f"{source} holds no PEM certificate (expected a file starting with "
                         "-----BEGIN CERTIFICATE-----)") from None


def _check_key_pair(cert: str, key: str, key_pem: bytes) -> None:
    """ValueError unless `key` is an unencrypted PEM private key that belongs to the certificate in `cert`."""
    if b"ENCRYPTED" in key_pem:
        raise ValueError(f"--tls-key {key} is encrypted: gRPC needs it without a passphrase "
                         f"(`openssl pkey -in {key} -out plain.pem`)")
    if b"PRIVATE KEY-----" not in key_pem:
        raise ValueError(f"--tls-key {key} holds no PEM private key (expected a file starting with "
                         "-----BEGIN PRIVATE KEY-----)")
    try:
        # The password callback only answers a key that asks for one (never a prompt on the terminal).
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError):
        raise ValueError(f"--tls-key {key} does not match --tls-cert {cert} (or is damaged): give the private key "
                         "the certificate was made with") from None
