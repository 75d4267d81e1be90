"""What crosses the wire between nodes, and how both ends know it is genuine.

A reader asks the owner for one chunk (store.CHUNK_BYTES) of one version of a file::

    GET /v1/chunk/<number>/<relpath, percent-quoted>
    X-Cachefs-Version: <size>:<mtime_ns>            the version the reader sees
    X-Cachefs-Auth: <unix time>:<hmac of time, path and version>

and the owner answers 200 with the chunk's bytes and::

    X-Cachefs-Version: <size>:<mtime_ns>            the version the bytes are of
    X-Cachefs-Xxh3: <xxh3_64 of the body>
    X-Cachefs-Auth: <hmac of the request's auth, the version and the xxh3>

or 401 (auth), 400 (path), 404 (no such file), 409 (the owner sees another version), 503
(the owner's remote did not answer).  ``GET /v1/health``, signed the same way with no
version, answers the owner's figures as JSON (its remote traffic, for the cluster's).

Both directions are signed with the cluster's shared secret (HMAC-SHA256), so the secret
never crosses the wire, a request cannot be replayed after ``MAX_CLOCK_SKEW_SECONDS``, and
an answer is bound to the request it answers.  The bytes themselves are not encrypted: the
peer port belongs on the cluster's private network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import time
import urllib.parse
from pathlib import Path

import xxhash

from cachefs.attr import Version
from cachefs.errors import UsageError

PREFIX = "/v1/chunk/"
VERSION_HEADER = "X-Cachefs-Version"
CHECKSUM_HEADER = "X-Cachefs-Xxh3"
AUTH_HEADER = "X-Cachefs-Auth"
MAX_CLOCK_SKEW_SECONDS = 120
MIN_SECRET_BYTES = 16


def chunk_path(relpath: str, number: int) -> str:
    return f"{PREFIX}{number}/{urllib.parse.quote(relpath, safe='/')}"


def parse_chunk_path(path: str) -> tuple[str, int]:
    """``(relpath, number)`` of a request path; ValueError for anything else."""
    if not path.startswith(PREFIX):
        raise ValueError("not a chunk request")
    number_text, sep, quoted = path[len(PREFIX):].partition("/")
    if not sep or not number_text.isdigit():
        raise ValueError("no chunk number")
    return urllib.parse.unquote(quoted, errors="strict"), int(number_text)


HEALTH_PATH = "/v1/health"


def format_version(version: Version | None) -> str:
    """A version as the wire spells it; "" for requests about no file (health)."""
    return "" if version is None else f"{version.size}:{version.mtime_ns}"


def parse_version(text: str | None) -> Version:
    size, sep, mtime = (text or "").partition(":")
    if not sep:
        raise ValueError(f"not a version: {text!r}")
    return Version(int(size), int(mtime))


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_request(secret: bytes, path: str, version: Version | None,
                 now: float | None = None) -> dict[str, str]:
    stamp = str(int(time.time() if now is None else now))
    text = format_version(version)
    return {VERSION_HEADER: text, AUTH_HEADER: f"{stamp}:{_mac(secret, stamp, path, text)}"}


def request_is_genuine(secret: bytes, path: str, version_text: str | None,
                       auth: str | None) -> bool:
    stamp, _, mac = (auth or "").partition(":")
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > MAX_CLOCK_SKEW_SECONDS:
        return False
    expected = _mac(secret, stamp, path, version_text or "")
    return hmac.compare_digest(expected, mac)


def sign_response(secret: bytes, request_auth: str, version: Version | None,
                  body: bytes) -> dict[str, str]:
    checksum = xxhash.xxh3_64_hexdigest(body)
    text = format_version(version)
    return {VERSION_HEADER: text, CHECKSUM_HEADER: checksum,
            AUTH_HEADER: _mac(secret, request_auth, text, checksum)}


def response_is_genuine(secret: bytes, request_auth: str, headers, body: bytes) -> bool:
    """Whether ``body`` is what a holder of the secret signed as the answer to this request:
    the signature first, then the checksum of the bytes that actually arrived."""
    version_text = headers.get(VERSION_HEADER) or ""
    checksum = headers.get(CHECKSUM_HEADER) or ""
    mac = headers.get(AUTH_HEADER) or ""
    expected = _mac(secret, request_auth, version_text, checksum)
    return hmac.compare_digest(expected, mac) \
        and hmac.compare_digest(xxhash.xxh3_64_hexdigest(body), checksum)


def read_secret(path: Path) -> bytes:
    """The cluster's shared secret from ``path``; UsageError for a missing, short or
    exposed one (a secret others on the node can read is no secret)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the peer secret {path}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"the peer secret {path} is readable by others: chmod 600 {path}")
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(f"the peer secret {path} is shorter than {MIN_SECRET_BYTES} bytes: "
                         f"make one with 'head -c 32 /dev/urandom | base64 > {path}'")
    return secret
