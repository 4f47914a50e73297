"""Test certificates made on the spot: a CA, and leaf certificates it signs (server and client).

EC P-256 keys: generating one takes microseconds, where RSA-2048 takes tenths of a second.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass
class Pem:
    cert: bytes
    key: bytes
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    def write(self, folder: Path, name: str) -> tuple[str, str]:
        """Writes NAME.crt and NAME.key; returns their paths."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / f"{name}.crt", folder / f"{name}.key"
        cert.write_bytes(self.cert)
        key.write_bytes(self.key)
        return str(cert), str(key)


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    return Pem(cert.public_bytes(serialization.Encoding.PEM),
               key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()), cert, key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "batchwire test CA") -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    return _pem(cert, key)


def make_cert(ca: Pem, common_name: str, names: tuple[str, ...] = (), client: bool = False,
              server: bool = True) -> Pem:
    """A leaf signed by ca, valid for the DNS names and IP addresses in names."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name)).issuer_name(ca.certificate.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return _pem(builder.sign(ca.private_key, hashes.SHA256()), key)
