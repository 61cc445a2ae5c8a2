"""Throwaway PKI for TLS tests: a CA, a server and a client certificate signed by it, a server
certificate of the same CA for another host, and an unrelated CA with a client certificate of its
own. EC P-256 keys, valid 1 day, PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    elsewhere_cert: Path       # the mesh CA's, naming only ELSEWHERE_HOST (not 127.0.0.1 or localhost)
    elsewhere_key: Path


ELSEWHERE_HOST = "kv-elsewhere.mesh.internal"


@dataclass(frozen=True)
class _Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def make_certs(directory: Path) -> CertFiles:
    """Writes the PEM files into directory and returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _make_ca("pdmesh-test-ca")
    other_ca = _make_ca("pdmesh-other-ca")
    server = _issue(ca, "pdmesh-worker", _server_extensions())
    client = _issue(ca, "pdmesh-gateway", _client_extensions())
    other_client = _issue(other_ca, "pdmesh-gateway", _client_extensions())
    elsewhere = _issue(ca, "pdmesh-worker", _server_extensions([x509.DNSName(ELSEWHERE_HOST)]))
    return CertFiles(
        ca=_write_cert(directory / "ca.pem", ca),
        server_cert=_write_cert(directory / "server.pem", server),
        server_key=_write_key(directory / "server.key", server),
        client_cert=_write_cert(directory / "client.pem", client),
        client_key=_write_key(directory / "client.key", client),
        other_ca=_write_cert(directory / "other-ca.pem", other_ca),
        other_client_cert=_write_cert(directory / "other-client.pem", other_client),
        other_client_key=_write_key(directory / "other-client.key", other_client),
        elsewhere_cert=_write_cert(directory / "elsewhere.pem", elsewhere),
        elsewhere_key=_write_key(directory / "elsewhere.key", elsewhere))


def _make_ca(common_name: str) -> _Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    builder = (_builder(name, name, key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(_key_usage(cert_sign=True), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    return _Issued(builder.sign(key, hashes.SHA256()), key)


def _issue(issuer: _Issued, common_name: str, extensions: list[tuple[x509.ExtensionType, bool]]) -> _Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(_name(common_name), issuer.cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(cert_sign=False), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
                              critical=False))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return _Issued(builder.sign(issuer.key, hashes.SHA256()), key)


def _server_extensions(names: list[x509.GeneralName] | None = None) -> list[tuple[x509.ExtensionType, bool]]:
    names = names or [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    return [(x509.SubjectAlternativeName(names), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)]


def _client_extensions() -> list[tuple[x509.ExtensionType, bool]]:
    return [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)]


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=not cert_sign, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_cert(path: Path, issued: _Issued) -> Path:
    path.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, issued: _Issued) -> Path:
    path.write_bytes(issued.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.chmod(0o600)
    return path
