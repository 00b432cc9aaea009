"""A stream over one S3 object that survives broken connections (``clsys.storage.open_read``).

botocore retries requests, not a GetObject body that breaks while it is read: this reader resumes it
with a ranged GET from the byte where it stopped.
"""
from __future__ import annotations

import io
import time

from clsys.storage import base
from clsys.storage.base import Location, StorageError, backoff_s
from clsys.storage.s3.client import s3_call, s3_client


class S3Reader(io.IOBase):
    """An S3 object's body that survives a broken connection: it resumes where it stopped.

    botocore retries a request until a response arrives, but a body that breaks while the caller
    reads it (reset, read timeout, fewer bytes than Content-Length) is past its reach. Then we ask
    for the rest with ``Range: bytes=<offset>-`` and ``If-Match: <ETag>`` (a replaced object is an
    error, never a splice of two objects), after a backoff. ``base.ATTEMPTS`` failures in a row without
    a byte of progress give up. A reader of part of the object (``start``, ``end``: a ranged GET) asks
    only for that part, the first time and on every resume.
    """

    def __init__(self, url: str, loc: Location, start: int = 0, end: int | None = None):
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError
        from urllib3.exceptions import ProtocolError

        self.url, self.loc = url, loc
        self.stream_errors = (IncompleteReadError, ResponseStreamingError, ReadTimeoutError, ProtocolError, OSError)
        self.end = end
        resp = self._get(start, {"Range": self._range(start)} if start or end is not None else {})
        # size: where this reader's bytes end (the object's end, or the range's)
        self.body, self.etag, self.size = resp["Body"], resp["ETag"], start + resp["ContentLength"]
        self.offset, self.failures = start, 0

    def _range(self, start: int) -> str:
        return f"bytes={start}-{'' if self.end is None else self.end - 1}"

    def _get(self, start: int, condition: dict) -> dict:
        resp = s3_call(self.url, s3_client().get_object, Bucket=self.loc.bucket, Key=self.loc.path, **condition)
        # A server that ignored Range would hand us the object from byte 0: refuse to splice that.
        if "Range" in condition and not resp.get("ContentRange", "").startswith(f"bytes {start}-"):
            resp["Body"].close()
            raise StorageError(f"{self.url}: the server ignored a ranged GET from byte {start}")
        return resp

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        """``size`` bytes (all that is left if negative), fewer only at the end of the object."""
        parts, got = [], 0
        while size is None or size < 0 or got < size:
            want = 1 << 20 if size is None or size < 0 else min(size - got, 1 << 20)
            try:
                # Bounded reads, so that a failure loses at most the chunk being read. Reading on
                # to b"" lets botocore check Content-Length (and the checksum, on a whole object).
                chunk = self.body.read(want)
            except self.stream_errors as err:
                self._resume(err)
                continue
            if not chunk:
                if self.offset >= self.size:
                    break
                self._resume(EOFError(f"body ended at byte {self.offset} of {self.size}"))
                continue
            parts.append(chunk)
            got += len(chunk)
            self.offset += len(chunk)
            self.failures = 0
        return b"".join(parts)

    def _resume(self, err: Exception) -> None:
        self.failures += 1
        if self.failures >= base.ATTEMPTS:
            raise StorageError(f"{self.url}: reading failed {base.ATTEMPTS} times in a row at byte {self.offset} of "
                               f"{self.size}; last error: {type(err).__name__}: {err}") from None
        time.sleep(backoff_s(self.failures))
        self.body.close()
        self.body = self._get(self.offset, {"Range": self._range(self.offset), "IfMatch": self.etag})["Body"]

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()
