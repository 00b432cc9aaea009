"""A fault-injecting reverse proxy for S3 tests: put it between a client and an S3-compatible server.

It listens on 127.0.0.1, forwards every request unchanged (method, path, query, headers, body:
the Host and Authorization headers stay as the client sent them, so SigV4 signatures, which cover
the Host the client connected to, still verify upstream) and relays the response, except that
some requests get a fault instead:

    reset     after the request line and headers (an upload is cut off mid-body), close the
              connection with a TCP RST and no response
    500       answer 500 InternalError (S3's XML error body) without forwarding
    503       answer 503 SlowDown (S3's XML error body) without forwarding
    truncate  forward, then send the status and headers (full Content-Length) but only part of
              the body (``Fault.keep``, half by default), and close; responses without a body
              pass untouched and are not counted
    slow      forward after a delay (``Fault.delay`` seconds)
    lost      forward (the server applies the request), then close the connection with a TCP RST
              instead of relaying the response: the client cannot tell whether the request took
              effect, and retries it

The schedule is deterministic: ``Fault("truncate", "GET", every=3)`` hits the 3rd, 6th, 9th, …
request whose method matches (``ANY`` matches all), at most ``Fault.times`` times when that is set.
Rules count independently and the first rule that fires wins. With ``every >= 2`` a rule never hits
a retried request twice in a row (unless other requests interleave), so clients that retry make
progress.

In-process::

    with FaultProxy("http://127.0.0.1:5000", [Fault("truncate", "GET", 3), Fault("503", "PUT", 4)]) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        ...
        assert proxy.injected["truncate"] > 0

As a process (e.g. in front of a moto server, for Ray workers started with AWS_ENDPOINT_URL)::

    python tests/s3_fault_proxy.py --upstream http://127.0.0.1:5000 --port 0 \\
        --faults "truncate:GET:3,503:PUT:4,reset:GET:5,500:ANY:7"

It prints ``listening on http://127.0.0.1:PORT`` once it accepts connections, and on SIGTERM or
Ctrl-C a JSON line with the injected fault counts. Bodies are buffered in memory (test-sized
objects); request bodies need a Content-Length (botocore always sends one); the upstream must
be plain http. Standard library only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import signal
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KINDS = ("reset", "500", "503", "truncate", "slow", "lost")
_ERRORS = {
    "500": ("InternalError", "We encountered an internal error. Please try again."),
    "503": ("SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    method: str = "ANY"
    every: int = 1
    delay: float = 0.5  # seconds, for "slow"
    keep: float = 0.5  # the fraction of the body "truncate" sends
    times: int = 0  # inject at most this many times; 0: no limit

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.every < 1:
            raise ValueError(f"fault {self.kind}: every must be >= 1")


def parse_faults(spec: str) -> list[Fault]:
    """``"truncate:GET:3,503:PUT:4"`` -> faults; each item is ``kind[:method[:every]]``."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        kind, method, every = parts + ["ANY", "1"][len(parts) - 1:]
        faults.append(Fault(kind, method.upper(), int(every)))
    return faults


class FaultProxy:
    """The proxy server; ``start()`` serves in a daemon thread, ``stop()`` shuts it down."""

    def __init__(self, upstream: str, faults: list[Fault] = (), port: int = 0):
        url = urllib.parse.urlsplit(upstream)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"{upstream}: the upstream must be an http:// URL")
        self.upstream = (url.hostname, url.port or 80)
        self.faults = list(faults)
        self.injected: Counter[str] = Counter()  # faults actually injected, per kind
        self.requests = 0
        self._seen = [0] * len(self.faults)  # matching requests so far, per rule
        self._fired = [0] * len(self.faults)  # times each rule was chosen
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pick(self, method: str) -> Fault | None:
        """Advance every matching rule's count; return the first rule whose turn it is."""
        with self._lock:
            self.requests += 1
            chosen = None
            for i, fault in enumerate(self.faults):
                if fault.method in ("ANY", method):
                    self._seen[i] += 1
                    spent = fault.times and self._fired[i] >= fault.times
                    if chosen is None and self._seen[i] % fault.every == 0 and not spent:
                        chosen = fault
                        self._fired[i] += 1
            return chosen

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1


def _make_handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1: keep-alive like a real endpoint, and "Expect: 100-continue" (which botocore
        # sends with file uploads) is answered instead of making the client wait a second for it.
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: tests read counters, not logs
            pass

        def _handle(self):
            fault = proxy._pick(self.command)
            kind = fault.kind if fault else None
            if kind == "reset":  # before reading the body: an upload is cut off mid-way
                proxy._count(kind)
                return self._reset()
            if "Transfer-Encoding" in self.headers:  # botocore always sends Content-Length
                self.close_connection = True
                return self.send_error(501, "chunked request bodies are not supported")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if kind in _ERRORS:
                proxy._count(kind)
                return self._send_error(int(kind), *_ERRORS[kind])
            if kind == "slow":
                proxy._count(kind)
                time.sleep(fault.delay)
            status, reason, headers, data = self._forward(body)
            if kind == "lost":
                proxy._count(kind)
                return self._reset()
            sent = math.ceil(len(data) * fault.keep) if kind == "truncate" else len(data)
            cut = sent < len(data)  # a body too short to cut passes whole
            if cut:
                proxy._count(kind)
            self.send_response_only(status, reason)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data[:sent])
            if cut:
                self.close_connection = True  # the client sees EOF before Content-Length bytes

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        def _forward(self, body: bytes):
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
            try:
                # skip_*: send exactly the client's headers, which the signature covers.
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    conn.putheader(name, value)
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
                headers = [(k, v) for k, v in resp.getheaders()
                           if k.lower() not in ("transfer-encoding", "connection", "content-length")]
                # A HEAD response announces the object's length without a body; keep it as sent.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                return resp.status, resp.reason, headers + [("Content-Length", length)], data
            finally:
                conn.close()

        def _send_error(self, status: int, code: str, message: str) -> None:
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>").encode()
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _reset(self) -> None:
            # SO_LINGER 0 makes close() send RST; rfile holds a reference to the socket, so it
            # must be closed as well before the descriptor really goes.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.rfile.close()
            self.close_connection = True

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description="Fault-injecting reverse proxy for S3 tests (127.0.0.1 only).")
    ap.add_argument("--upstream", required=True, help="S3 endpoint to forward to, e.g. http://127.0.0.1:5000")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    ap.add_argument("--faults", default="", help='e.g. "truncate:GET:3,503:PUT:4,reset:GET:5,500:ANY:7"')
    args = ap.parse_args()
    proxy = FaultProxy(args.upstream, parse_faults(args.faults), args.port)
    # SIGTERM -> KeyboardInterrupt, so both end in the same place and print the counts.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"listening on {proxy.endpoint}", flush=True)
    try:
        proxy._server.serve_forever()
    except KeyboardInterrupt:
        pass
    proxy._server.server_close()
    print(json.dumps({"requests": proxy.requests, "injected": dict(proxy.injected)}), flush=True)


if __name__ == "__main__":
    main()
