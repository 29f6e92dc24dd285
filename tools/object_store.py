"""A local S3 server for tests and benches: moto's server mode on 127.0.0.1, behind a small HTTP
proxy that can add per-request latency and inject faults.

    with LocalS3() as s3:
        s3.make_bucket("bucket")  # S3 names: 3 to 63 characters
        fs = fsspec.filesystem("s3", **s3.storage_options)
        s3.latency_s = 0.02
        s3.faults = Faults(rate=0.1)
        subprocess.run([...], env={**os.environ, **s3.env()})

moto keeps its state in process-global backends, so two LocalS3 in one process see the same
buckets. The proxy is written by hand: moto injects neither faults nor latency, and the tools
that do (toxiproxy and the like) are not Python packages.

LocalHTTP serves a local directory read-only over HTTP (GET/HEAD with byte ranges, no listing):

    with LocalHTTP(directory) as http:
        reader = ShardReader(f"{http.url}/dataset")
"""

from __future__ import annotations

import functools
import http.client
import io
import logging
import os
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, cast

from moto.server import ThreadedMotoServer

TRANSIENT_KINDS = ("500", "503", "reset", "truncate")     # what a retry mends
FAULT_KINDS = (*TRANSIENT_KINDS, "403")
# Hop-by-hop headers (and the ones the proxy sets itself) are not relayed.
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "expect", "content-length"}
_ERRORS = {
    "500": ("InternalError", "We encountered an internal error. Please try again."),
    "503": ("SlowDown", "Please reduce your request rate."),
    "403": ("AccessDenied", "Access Denied"),      # credentials that may not read the bucket
}
_CHUNK = 1 << 20


def _serve(server: ThreadingHTTPServer, name: str) -> None:
    """Serve ``server`` on a daemon thread."""
    serve = functools.partial(server.serve_forever, poll_interval=0.05)
    threading.Thread(target=serve, daemon=True, name=name).start()


def _close(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


@dataclass(frozen=True)
class Faults:
    """Inject one of `kinds` into a request whose method is in `methods`, with probability
    `rate` (drawn from a Random seeded with `seed` when the faults are set). "500"/"503"/"403":
    an S3 error reply, not forwarded; "reset": a TCP reset, no reply; "truncate": the real headers,
    half the body, then a close (the client reads short of Content-Length)."""

    rate: float
    kinds: tuple[str, ...] = TRANSIENT_KINDS
    seed: int = 0
    methods: tuple[str, ...] = ("GET",)
    listings_only: bool = False     # only bucket listings (ListObjectsV2): "403" is then
    #                                 credentials that read objects but may not list them

    def __post_init__(self) -> None:
        bad = set(self.kinds) - set(FAULT_KINDS)
        if bad or not self.kinds or not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"bad Faults: rate={self.rate} kinds={self.kinds}")


class LocalS3:
    """moto S3 on 127.0.0.1 behind a fault-injecting proxy; a context manager."""

    def __init__(self) -> None:
        self.latency_s: float = 0.0
        self.requests: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._faults: Faults | None = None
        self._rng = random.Random(0)
        self._moto: ThreadedMotoServer | None = None
        self._proxy: _ProxyServer | None = None
        self._moto_addr = ("127.0.0.1", 0)
        self.moto_url = ""
        self.endpoint_url = ""

    # -- lifecycle

    def start(self) -> LocalS3:
        """Start moto and the proxy (what `with` does)."""
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self._moto_addr = (host, port)
        self.moto_url = f"http://{host}:{port}"
        self._proxy = _ProxyServer(("127.0.0.1", 0), _Handler, self)
        self.endpoint_url = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        _serve(self._proxy, "local-s3-proxy")
        return self

    def stop(self) -> None:
        """Stop the proxy and moto."""
        if self._proxy is not None:
            _close(self._proxy)
            self._proxy = None
        if self._moto is not None:
            self._moto.stop()
            self._moto = None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- clients

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach the proxy."""
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
                "skip_instance_cache": True}

    def env(self) -> dict[str, str]:
        """Environment variables that point a subprocess's botocore/s3fs at the proxy."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint_url,
                "AWS_ENDPOINT_URL": self.endpoint_url}

    def make_bucket(self, name: str) -> None:
        """Create a bucket, straight on moto (not counted by the proxy)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.moto_url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=name)

    # -- knobs

    @property
    def faults(self) -> Faults | None:
        """The faults injected from now on (None: none); setting them reseeds the draw."""
        return self._faults

    @faults.setter
    def faults(self, value: Faults | None) -> None:
        with self._lock:
            self._faults = value
            self._rng = random.Random(value.seed if value is not None else 0)

    def reset_counters(self) -> None:
        """Zero `requests` and `injected`."""
        with self._lock:
            self.requests.clear()
            self.injected.clear()

    def _draw(self, method: str, path: str) -> str | None:
        """Count a request and pick the fault to inject into it, if any."""
        with self._lock:
            self.requests[method] += 1
            faults = self._faults
            if faults is None or method not in faults.methods or \
                    (faults.listings_only and "list-type=" not in path):
                return None
            if self._rng.random() >= faults.rate:
                return None
            kind = self._rng.choice(faults.kinds)
            self.injected[kind] += 1
            return kind


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 owner: LocalS3) -> None:
        self.owner = owner
        super().__init__(addr, handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers-then-body writes meet delayed ACKs (40 ms)
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _abort(self, graceful: bool) -> None:
        """Close the client connection: a FIN if graceful, else a reset (SO_LINGER 0)."""
        self.close_connection = True
        sock = self.connection
        if graceful:
            sock.shutdown(socket.SHUT_WR)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # the fd goes when finish() closes rfile, before shutdown_request's FIN

    def _forward(self, body: bytes) -> http.client.HTTPResponse:
        owner = cast(_ProxyServer, self.server).owner
        for attempt in (0, 1):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*owner._moto_addr, timeout=60)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True,
                                skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP:
                        conn.putheader(name, value)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _error(self, kind: str) -> None:
        code, message = _ERRORS[kind]
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>local-s3-fault</RequestId></Error>"
                ).encode()
        self.send_response_only(int(kind))
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _proxy(self) -> None:
        owner = cast(_ProxyServer, self.server).owner
        body = self._read_body()
        kind = owner._draw(self.command, self.path)
        if owner.latency_s > 0:
            time.sleep(owner.latency_s)
        if kind in _ERRORS:
            self._error(kind)
            return
        if kind == "reset":
            self._abort(graceful=False)
            return
        resp = self._forward(body)
        no_body = self.command == "HEAD" or resp.status in (204, 304)
        length = resp.getheader("Content-Length")
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in _HOP:
                self.send_header(name, value)
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            resp.read()
            return
        src: BinaryIO | http.client.HTTPResponse = resp
        if length is None:  # a chunked upstream response: buffer it
            src = io.BytesIO(resp.read())
            length = str(len(src.getvalue()))
        self.send_header("Content-Length", length)
        self.end_headers()
        left = int(length) // 2 if kind == "truncate" else int(length)
        while left > 0 and (chunk := src.read(min(left, _CHUNK))):
            self.wfile.write(chunk)
            left -= len(chunk)
        if kind == "truncate":
            if self._upstream is not None:
                self._upstream.close()  # its response was not read to the end
                self._upstream = None
            self._abort(graceful=True)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _proxy

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None


class LocalHTTP:
    """A local directory served read-only over HTTP/1.1 on 127.0.0.1 (GET and HEAD, single
    byte ranges answered 206); a context manager. `requests` counts requests by method,
    `paths` by "METHOD /path"; the paths in `denied` ("folder/name") are answered 403.

        with LocalHTTP(directory) as http:
            fsspec.filesystem("http").cat_file(f"{http.url}/name", start=0, end=10)
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.requests: Counter[str] = Counter()
        self.paths: Counter[str] = Counter()
        self.denied: set[str] = set()
        self.url = ""
        self._lock = threading.Lock()
        self._server: _FileServer | None = None

    def start(self) -> LocalHTTP:
        """Start serving (what `with` does)."""
        self._server = _FileServer(("127.0.0.1", 0), _FileHandler, self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        _serve(self._server, "local-http")
        return self

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            _close(self._server)
            self._server = None

    def __enter__(self) -> LocalHTTP:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def reset_counters(self) -> None:
        """Zero `requests` and `paths`."""
        with self._lock:
            self.requests.clear()
            self.paths.clear()

    def _count(self, method: str, path: str) -> None:
        with self._lock:
            self.requests[method] += 1
            self.paths[f"{method} {path}"] += 1

    def _file(self, url_path: str) -> Path | None:
        """The served file at `url_path`; None when it is missing or outside the root."""
        relative = urllib.parse.unquote(urllib.parse.urlsplit(url_path).path).lstrip("/")
        path = (self.root / relative).resolve()
        return path if path.is_file() and path.is_relative_to(self.root) else None


class _FileServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 owner: LocalHTTP) -> None:
        self.owner = owner
        super().__init__(addr, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-body (fsspec's `exists` GETs, then closes)


class _FileHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {"Accept-Ranges": "bytes", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _serve(self) -> None:
        owner = cast(_FileServer, self.server).owner
        owner._count(self.command, self.path)
        if urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/") in \
                owner.denied:
            self._reply(403, 0, {})
            return
        path = owner._file(self.path)
        if path is None:
            body = b"not found\n"
            self._reply(404, len(body), {"Content-Type": "text/plain"})
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        stat = path.stat()
        size = stat.st_size
        start, end, status = 0, size, 200
        # an ETag of the file's time of writing and size, as nginx makes one
        headers = {"Content-Type": "application/octet-stream",
                   "ETag": f'"{stat.st_mtime_ns:x}-{size:x}"'}
        if match := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip()):
            start = int(match[1])
            end = min(size, int(match[2]) + 1) if match[2] else size
            if start >= size or start >= end:
                self._reply(416, 0, {"Content-Range": f"bytes */{size}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self._reply(status, end - start, headers)
        if self.command == "HEAD":
            return
        with path.open("rb") as handle:
            handle.seek(start)
            left = end - start
            while left > 0 and (chunk := handle.read(min(left, _CHUNK))):
                self.wfile.write(chunk)
                left -= len(chunk)

    do_GET = do_HEAD = _serve
