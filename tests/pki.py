"""A cluster CA, a server certificate for 127.0.0.1 and a client certificate,
made with `cryptography` (tests/test_kube_tls.py; bench/agentrun.py's `pod`
source serves the fake API server with them)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID, NameOID
from fakeapi import ServerTls

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    ca: Path  # CA certificate, no keyUsage extension
    server: ServerTls  # for 127.0.0.1, signed by `ca`
    client_cert: Path  # signed by `ca`
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        # a CA as many cluster set-ups make it: no keyUsage (but the key
        # identifiers, so that keyUsage is the only thing strict mode minds)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None,
           key_path: Path | None = None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None and key_path is not None:
        key_path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))


def make_pki(directory: Path, cn: str = "cluster-ca") -> Pki:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(cn, ca_key, cn, ca_key, ca=True)
    assert not any(e.oid == ExtensionOID.KEY_USAGE for e in ca.extensions)
    _write(directory / "ca.crt", ca)
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(directory / f"{who}.crt", _cert(who, key, cn, ca_key, ca=False), key,
               directory / f"{who}.key")
    return Pki(
        directory / "ca.crt",
        ServerTls(str(directory / "server.crt"), str(directory / "server.key"),
                  str(directory / "ca.crt")),
        directory / "client.crt",
        directory / "client.key",
    )
