"""TLS mistakes named at once: certificate and key files parsed and matched at the start, `--tls-server-name`
without `--tls-ca` refused, and a handshake that will fail again ending a learner's connect wait
(`ConnectWatch`, time passed in) instead of looking like a syncer that is away.

Certificates are real (made with `openssl` in the test's directory); the connect watch is fed gRPC's own error
texts, as a learner saw them against a TLS syncer.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ddiloco.runtime.process_settings import EvaluatorSettings, LearnerSettings
from ddiloco.transport.auth import read_ca_file, read_tls_files
from ddiloco.transport.grpc_client import ConnectWatch
from tests.helpers import self_signed_pair

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

ADDRESS = "127.0.0.1:50051"
REFUSED = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: Failed to "
           "connect to remote host: Connection refused")
WRONG_CA = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
            "CERTIFICATE_VERIFY_FAILED: self signed certificate: OK")
WRONG_NAME = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: Custom "
              "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.")
IPV6_REFUSED = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv6:%5B::1%5D:50051: Failed "
                "to connect to remote host: Connection refused")
TLS_TO_PLAIN = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: Tls "
                "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:"
                "OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context: OK")
EXPIRED = WRONG_CA.replace("self signed certificate", "certificate has expired")
NOT_YET_VALID = WRONG_CA.replace("self signed certificate", "certificate is not yet valid")
"""An expired syncer certificate, and one whose start date is ahead (BoringSSL's words): both were read as "not signed
by the CA this process trusts"."""
FEW_ATTEMPTS = 5
NOT_GRPC = ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:50051: Failed "
            "parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)")
"""A learner pointed at `python -m http.server` (grpcio 1.85's words): it retried for its whole connect timeout."""
"""A learner whose handshake fails the same way this many times has given up (each attempt takes well under a
second: gRPC answers from the channel's failed state)."""
PLAIN_TO_TLS = ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:50051: "
                "Socket closed")


@pytest.fixture
def pairs(tmp_path):
    return self_signed_pair(tmp_path, "a"), self_signed_pair(tmp_path, "b")


def test_a_certificate_and_its_own_key_are_read(pairs):
    (cert, key), _ = pairs
    key_pem, cert_pem = read_tls_files(cert, key)
    assert b"PRIVATE KEY" in key_pem and b"BEGIN CERTIFICATE" in cert_pem


def test_a_key_that_is_not_the_certificates_is_refused_naming_both(pairs):
    (cert, _), (_, other_key) = pairs
    with pytest.raises(ValueError, match="does not match") as error:
        read_tls_files(cert, other_key)
    assert cert in str(error.value) and other_key in str(error.value)


def test_a_garbage_key_or_certificate_is_refused(tmp_path, pairs):
    (cert, key), _ = pairs
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem file\n")
    with pytest.raises(ValueError, match="--tls-key .* holds no PEM private key"):
        read_tls_files(cert, str(garbage))
    with pytest.raises(ValueError, match="--tls-cert .* holds no PEM certificate"):
        read_tls_files(str(garbage), key)
    with pytest.raises(ValueError, match="--tls-cert .* holds no PEM certificate"):
        read_tls_files(key, key)  # the key given twice


def test_an_encrypted_key_is_refused_without_a_passphrase_prompt(tmp_path, pairs):
    (cert, key), _ = pairs
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
                   check=True, capture_output=True)
    with pytest.raises(ValueError, match="is encrypted"):
        read_tls_files(cert, str(encrypted))


def test_a_ca_file_that_holds_no_certificate_is_refused(tmp_path, pairs):
    (cert, key), _ = pairs
    assert b"BEGIN CERTIFICATE" in read_ca_file(cert)
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\xffnot a certificate")
    for bad in (str(garbage), key):
        with pytest.raises(ValueError, match="--tls-ca .* holds no PEM certificate"):
            read_ca_file(bad)


@pytest.mark.parametrize("cls", [LearnerSettings, EvaluatorSettings])
def test_a_server_name_without_a_ca_is_refused(cls):
    with pytest.raises(ValueError, match="tls_server_name='other.example' is invalid: .*tls_ca"):
        cls(run_dir="run", syncer=ADDRESS, tls_server_name="other.example",
            **({"learner_id": 0} if cls is LearnerSettings else {}))
    cls(run_dir="run", syncer=ADDRESS, tls_server_name="other.example", tls_ca="ca.pem",
        **({"learner_id": 0} if cls is LearnerSettings else {}))


@pytest.mark.parametrize(("error", "fix", "handshake"), [
    (WRONG_CA, "--tls-ca", "TLS"), (WRONG_NAME, "--tls-server-name", "TLS"),
    (TLS_TO_PLAIN, "TLS is on one side only", "TLS"), (PLAIN_TO_TLS, "TLS is on one side only", "TLS"),
    (NOT_GRPC, "does not speak gRPC, so it is not a syncer", "HTTP/2"),
    (EXPIRED, "the syncer's certificate has expired: give the syncer a new --tls-cert", "TLS"),
    (NOT_YET_VALID, "the syncer's certificate is not valid yet", "TLS")])
def test_a_handshake_that_will_fail_again_gives_up_in_a_few_attempts_naming_the_fix(error, fix, handshake):
    watch = ConnectWatch(ADDRESS, connect_timeout_s=120.0, started_at=0.0)
    verdicts = [watch.failed(0.1 * (i + 1), error) for i in range(FEW_ATTEMPTS)]
    assert verdicts[0].give_up is None  # one handshake cut short (a syncer killed in the middle) is not enough
    line = next((v.give_up for v in verdicts if v.give_up is not None), None)
    assert line is not None, f"still retrying after {FEW_ATTEMPTS} failed handshakes"
    assert "\n" not in line and ADDRESS in line and f"{handshake} handshake failed" in line and fix in line


def test_connections_refused_between_handshake_failures_do_not_hide_them():
    # localhost: the IPv4 address fails the name check, then ::1 refuses; gRPC's text names only the last address.
    watch = ConnectWatch(ADDRESS, connect_timeout_s=120.0, started_at=0.0)
    errors = [WRONG_NAME, IPV6_REFUSED, IPV6_REFUSED, WRONG_NAME, IPV6_REFUSED, WRONG_NAME]
    verdicts = [watch.failed(0.1 * (i + 1), e) for i, e in enumerate(errors)]
    assert all(v.give_up is None for v in verdicts[:-1])
    assert "--tls-server-name" in verdicts[-1].give_up


def test_a_refused_connection_is_retried_until_the_connect_timeout():
    # A syncer restarting refuses connections for a while: no early give-up for that.
    watch = ConnectWatch(ADDRESS, connect_timeout_s=10.0, started_at=0.0)
    assert all(watch.failed(0.1 * (i + 1), REFUSED).give_up is None for i in range(50))


def test_a_learner_that_reached_the_syncer_keeps_retrying_a_failed_handshake_but_says_why():
    # A syncer restarted with the wrong certificate can be restarted again with the right one.
    watch = ConnectWatch(ADDRESS, connect_timeout_s=10.0, started_at=0.0)
    watch.reached()
    verdicts = [watch.failed(50.0 + i, WRONG_CA) for i in range(10)]
    assert all(v.give_up is None for v in verdicts)
    assert any(v.warning is not None and "--tls-ca" in v.warning for v in verdicts)
