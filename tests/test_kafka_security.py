"""Kafka security: the client options every connector gets, and the broker's loopback bind.

No TLS or SASL cluster is available to the tests: this Tansu build takes a
`--cert` flag but serves plain TCP with it, and its SCRAM users could not be
created (`tansu user create` fails with "early eof" against `--authentication`).
So the options are checked as built (the `ssl.SSLContext`, the SASL fields),
and reaching the clients is checked by behaviour: with SASL configured, every
client we build speaks SASL to the plaintext broker and is refused at once.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kafka_fixtures import KAFKA, feedback_store, kafka_broker
from pydantic import ValidationError

from clora_feedback.config import FeedbackConfig, KafkaConfig, load_settings
from clora_feedback.errors import ConfigError, UnavailableError
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.ingest import KafkaDeadLetters
from clora_feedback.feedback.kafka import build_consumer
from clora_feedback.feedback.records import (
    build_producer,
    dead_letter_options,
    kafka_client_options,
)
from clora_feedback.feedback.store import FeedbackStore

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

SECRET = "pa55-w0rd-never-logged"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    """A self-signed CA-like certificate with its key, and the same key encrypted."""
    cert, key, locked = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "locked.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=kafka-test-ca"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "pkey", "-in", str(key), "-out", str(locked), "-aes256",
         "-passout", "pass:topsecret"],
        check=True, capture_output=True,
    )  # fmt: skip
    return {"cert": cert, "key": key, "locked": locked}


# -- the options ------------------------------------------------------------------------------


def test_plaintext_by_default() -> None:
    assert kafka_client_options(KafkaConfig()) == {"security_protocol": "PLAINTEXT"}
    assert dead_letter_options(KafkaConfig()) == {
        "security_protocol": "PLAINTEXT",
        "max_request_size": 1_048_576,
    }


@needs_openssl
def test_sasl_ssl_with_scram_and_the_password_from_an_env_var(
    tls_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAFKA_PASSWORD", SECRET)
    config = KafkaConfig(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="clora",
        sasl_plain_password_env="KAFKA_PASSWORD",
        ssl_cafile=tls_files["cert"],
    )
    options = kafka_client_options(config)
    context = options.pop("ssl_context")
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "clora",
        "sasl_plain_password": SECRET,
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    subjects = [dict(x[0] for x in c["subject"]) for c in context.get_ca_certs()]
    assert {"commonName": "kafka-test-ca"} in subjects  # our CA, not only the system's
    # The secret is in no rendering of the settings.
    for text in (repr(config), str(config), config.model_dump_json(), json.dumps(str(config))):
        assert SECRET not in text


def test_the_password_can_come_from_the_clora_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file without the password; the environment adds it (nested settings merge)."""
    path = tmp_path / "clora.json"
    kafka = {"security_protocol": "SASL_PLAINTEXT", "sasl_plain_username": "clora"}
    path.write_text(json.dumps({"feedback": {"kafka": kafka}}))
    monkeypatch.setenv("CLORA_FEEDBACK__KAFKA__SASL_PLAIN_PASSWORD", SECRET)
    settings = load_settings(path)
    password = settings.feedback.kafka.sasl_plain_password
    assert password is not None and password.get_secret_value() == SECRET
    assert SECRET not in repr(settings) and SECRET not in settings.model_dump_json()
    assert kafka_client_options(settings.feedback.kafka)["sasl_plain_password"] == SECRET


@needs_openssl
def test_mutual_tls_loads_the_client_certificate(tls_files: dict[str, Path]) -> None:
    config = KafkaConfig(
        security_protocol="SSL", ssl_certfile=tls_files["cert"], ssl_keyfile=tls_files["key"]
    )
    assert isinstance(kafka_client_options(config)["ssl_context"], ssl.SSLContext)
    # An encrypted key is refused, never prompted for on the server's terminal.
    locked = config.model_copy(update={"ssl_keyfile": tls_files["locked"]})
    with pytest.raises(ConfigError) as info:
        kafka_client_options(locked)
    assert info.value.code == "kafka_tls"


def test_an_unreadable_ca_file_is_a_config_error(tmp_path: Path) -> None:
    config = KafkaConfig(security_protocol="SSL", ssl_cafile=tmp_path / "missing.pem")
    with pytest.raises(ConfigError) as info:
        kafka_client_options(config)
    assert info.value.code == "kafka_tls" and "missing.pem" in info.value.message


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"security_protocol": "SASL_SSL", "sasl_plain_username": "u"}, "needs"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_plain_password": "p"}, "needs"),
        ({"ssl_cafile": "/etc/ca.pem"}, "security_protocol is PLAINTEXT"),
        ({"security_protocol": "SSL", "ssl_certfile": "/c.pem"}, "go together"),
        ({"sasl_plain_password_env": "CLORA_TEST_UNSET_VARIABLE"}, "is not set"),
        ({"security_protocol": "TLS"}, "security_protocol"),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
    ],
)
def test_inconsistent_security_settings_are_refused(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        KafkaConfig(**fields)


# -- every client we build gets them ---------------------------------------------------------


async def test_every_client_we_build_speaks_the_configured_protocol(
    kafka_broker: LocalBroker,
    feedback_store: FeedbackStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SASL towards the plaintext broker: each client is refused, and the password never shows."""
    caplog.set_level(logging.DEBUG)
    sasl = KafkaConfig(
        security_protocol="SASL_PLAINTEXT", sasl_plain_username="clora", sasl_plain_password=SECRET
    )
    bootstrap = kafka_broker.bootstrap
    clients: list[Any] = [
        build_producer(sasl, bootstrap),
        build_consumer(feedback_store, FeedbackConfig(kafka=sasl), bootstrap),
        KafkaDeadLetters(
            bootstrap, KAFKA.dead_letter_topic, client_options=dead_letter_options(sasl)
        ),
    ]
    for client in clients:
        with pytest.raises(UnavailableError) as info:
            await client.start()
        assert SECRET not in str(info.value)
        await client.stop()
    # The same clients, configured for plaintext, connect.
    plain = KafkaConfig()
    for client in [
        build_producer(plain, bootstrap),
        build_consumer(feedback_store, FeedbackConfig(kafka=plain), bootstrap),
        KafkaDeadLetters(
            bootstrap, KAFKA.dead_letter_topic, client_options=dead_letter_options(plain)
        ),
    ]:
        await client.start()
        await client.stop()
    assert not any(SECRET in r.getMessage() for r in caplog.records)


# -- the embedded broker ---------------------------------------------------------------------


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets that process `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = fd.readlink().as_posix() if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                address, port = local.split(":")
                assert len(address) == width
                out.append(f"{table}:{address}:{int(port, 16)}")
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_embedded_broker_listens_on_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tansu also reads its listener from the environment; ours must win over it.
    monkeypatch.setenv("LISTENER_URL", "tcp://0.0.0.0:9092")
    with LocalBroker(tmp_path / "tansu") as broker:
        port = int(broker.bootstrap.rsplit(":", 1)[1])
        assert broker.pid is not None
        addresses = listening_addresses(broker.pid)
    assert addresses == [f"tcp:0100007F:{port}"]  # 127.0.0.1, nothing else, no IPv6 wildcard
