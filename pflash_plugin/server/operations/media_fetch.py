"""Media URLs fetched without server-side request forgery (issue 46): only hosts on the
--media_hosts list, each address the name resolves to public (private, loopback, link-local and
reserved addresses only where the list names that address), the connection made to the address
that was checked (a second lookup cannot rebind it), redirects followed only onto listed hosts
(3 at most), the body capped at --media_max_bytes and the whole fetch at
--media_fetch_timeout_s. Every refusal is a RequestError (400) naming the client's field."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from ..wire.protocol import RequestError

MAX_REDIRECTS = 3
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class FetchLimits:
    hosts: frozenset[str]  # names, addresses, or host:port, lower case
    max_bytes: int
    timeout_s: float


@dataclass(frozen=True)
class Fetched:
    data: bytes
    mime: str | None  # the response's Content-Type, without parameters


def _refuse(where: str, why: str) -> RequestError:
    return RequestError(400, f"{where}: {why}", param=where)


class _Pinned(http.client.HTTPSConnection):
    """HTTPS to an address already checked, the certificate verified for the URL's host name."""

    def __init__(self, address: str, port: int, host: str, timeout: float) -> None:
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self._sni = host

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self._sni)  # type: ignore[attr-defined]


def _address(host: str, port: int, limits: FetchLimits, where: str) -> str:
    """The address to connect to: the first the name resolves to, each of them allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise _refuse(where, f"the host {host!r} does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not ip.is_global and address not in limits.hosts and f"{address}:{port}" not in limits.hosts:
            raise _refuse(where, f"the host {host!r} resolves to {address}, a private or local address that "
                          "--media_hosts does not list")
    return addresses[0]


def _target(url: str, limits: FetchLimits, where: str) -> tuple[urllib.parse.SplitResult, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refuse(where, "an http(s) URL with a host is required")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise _refuse(where, "the URL's port is not a number") from None
    host = parts.hostname.lower()
    if host not in limits.hosts and f"{host}:{port}" not in limits.hosts:
        listed = "names no host" if not limits.hosts else "does not list it"
        raise _refuse(where, f"media URLs are fetched only from the hosts --media_hosts lists, and it {listed} "
                      f"({host}); send the image as a data URL or base64")
    return parts, port


def _get(url: str, limits: FetchLimits, where: str, deadline: float) -> tuple[http.client.HTTPResponse, str]:
    """One GET of `url` (nothing followed): the response and the connection's URL."""
    parts, port = _target(url, limits, where)
    host = parts.hostname or ""
    address = _address(host, port, limits, where)
    timeout = max(deadline - time.monotonic(), 0.01)
    conn: http.client.HTTPConnection = (_Pinned(address, port, host, timeout) if parts.scheme == "https"
                                        else http.client.HTTPConnection(address, port, timeout=timeout))
    path = parts.path or "/"
    path += f"?{parts.query}" if parts.query else ""
    try:
        conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*, audio/*",
                                           "User-Agent": "pflash-plugin"})
        return conn.getresponse(), url
    except (OSError, http.client.HTTPException) as error:
        conn.close()
        raise _refuse(where, f"the URL could not be fetched ({type(error).__name__})") from None


def _body(response: http.client.HTTPResponse, limits: FetchLimits, where: str, deadline: float) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > limits.max_bytes:
        raise _refuse(where, f"{int(length):,} bytes, over the server's limit of {limits.max_bytes:,} per media "
                      "item (--media_max_bytes)")
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise _refuse(where, f"the fetch took longer than {limits.timeout_s:g} s (--media_fetch_timeout_s)")
        try:
            chunk = response.read1(_CHUNK)  # what one receive brings: a slow drip meets the deadline
        except (OSError, http.client.HTTPException) as error:
            raise _refuse(where, f"the URL could not be fetched ({type(error).__name__})") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limits.max_bytes:
            raise _refuse(where, f"over the server's limit of {limits.max_bytes:,} bytes per media item "
                          "(--media_max_bytes)")
        chunks.append(chunk)


def fetch(url: str, limits: FetchLimits, where: str) -> Fetched:
    """The body at `url`, following redirects onto listed hosts only."""
    deadline = time.monotonic() + limits.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        response, url = _get(url, limits, where, deadline)
        try:
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _refuse(where, f"the URL answered {response.status} without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            if not 200 <= response.status < 300:
                raise _refuse(where, f"the URL answered HTTP {response.status}")
            mime = (response.getheader("Content-Type") or "").split(";")[0].strip().lower() or None
            return Fetched(_body(response, limits, where, deadline), mime)
        finally:
            response.close()
    raise _refuse(where, f"more than {MAX_REDIRECTS} redirects")
