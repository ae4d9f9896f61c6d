"""TLS material for the edge: real certificates from the command line, or a self-signed one.

QUIC always runs TLS 1.3.  Without ``--certificate``/``--private-key`` the edge creates a
self-signed ECDSA P-256 certificate for ``localhost``, ``127.0.0.1`` and ``::1`` on first start,
keeps it under the state directory, and says loudly that clients must pin it (its SHA-256
fingerprint is printed) or use ``--insecure``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class TlsFiles:
    """The certificate and key an edge serves with; ``self_signed``: generated here, to be pinned by clients."""

    certificate: Path
    private_key: Path
    self_signed: bool


log = logging.getLogger("edgepath.tls")


def state_dir() -> Path:
    """Where the self-signed certificate persists between starts."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edgepath"


def default_certificate() -> Path:
    return state_dir() / "edge-cert.pem"


def fingerprint(cert_path: Path) -> str:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def generate_self_signed(cert_path: Path, key_path: Path, days: int = 365) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgepath self-signed (localhost)")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def resolve(certificate: str | None, private_key: str | None) -> TlsFiles:
    """The files to serve with: the given pair, or the self-signed one (created on first use)."""
    if (certificate is None) != (private_key is None):
        raise ValueError("--certificate and --private-key go together")
    if certificate is not None and private_key is not None:
        for p in (certificate, private_key):
            if not Path(p).is_file():
                raise ValueError(f"TLS file {p} does not exist")
        return TlsFiles(Path(certificate), Path(private_key), self_signed=False)
    cert, key = default_certificate(), state_dir() / "edge-key.pem"
    if not (cert.is_file() and key.is_file()):
        generate_self_signed(cert, key)
        log.warning(
            "generated a SELF-SIGNED certificate %s (SHA-256 %s): clients cannot verify this server unless "
            "they trust that file (edgepath request does by default) or skip verification; "
            "pass --certificate/--private-key for a real one",
            cert,
            fingerprint(cert),
        )
    else:
        log.warning("serving with the self-signed certificate %s (SHA-256 %s)", cert, fingerprint(cert))
    return TlsFiles(cert, key, self_signed=True)
