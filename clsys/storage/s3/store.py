"""The S3 backend (``s3://bucket/key``, any S3-compatible server): the endpoint and credentials come from the
standard AWS chain; botocore retries every request (``client.py``), ``S3Reader`` resumes a body that breaks
while it is read, large uploads go in parts, and compare-and-swap is a conditional request (``If-None-Match: *``,
``If-Match``) with the ETag as the version tag."""
from __future__ import annotations

from typing import BinaryIO, Iterator

from clsys.storage import base
from clsys.storage.base import Backend, Location, StorageError
from clsys.storage.s3.client import MISSING, s3_call, s3_client, s3_error, s3_or_none
from clsys.storage.s3.reader import S3Reader

# The condition of a conditional request did not hold (412), another conditional write to the key was in
# flight (409, AWS), or the object a write or delete was conditioned on is gone.
CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", *MISSING)


class S3(Backend):
    parallel_writes = True  # boto3's clients are thread-safe

    def open_read(self, url: str, loc: Location, start: int, end: int | None) -> BinaryIO:
        return S3Reader(url, loc, start, end)

    def size(self, url: str, loc: Location) -> int:
        return s3_call(url, s3_client().head_object, Bucket=loc.bucket, Key=loc.path)["ContentLength"]

    def exists(self, url: str, loc: Location) -> bool:
        return s3_or_none(url, s3_client().head_object, MISSING, Bucket=loc.bucket, Key=loc.path) is not None

    def write_bytes(self, url: str, loc: Location, data: bytes) -> None:
        s3_call(url, s3_client().put_object, Bucket=loc.bucket, Key=loc.path, Body=data)

    def upload_file(self, local_path: str, url: str, loc: Location) -> None:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=base.MULTIPART_BYTES, multipart_chunksize=base.MULTIPART_BYTES)
        s3_call(url, s3_client().upload_file, local_path, loc.bucket, loc.path, Config=cfg)

    def download_file(self, url: str, loc: Location, local_path: str) -> None:
        from boto3.s3.transfer import TransferConfig

        # s3transfer restarts a download part whose body breaks (botocore does not), ATTEMPTS times.
        cfg = TransferConfig(num_download_attempts=base.ATTEMPTS)
        try:
            s3_call(url, s3_client().download_file, loc.bucket, loc.path, local_path, Config=cfg)
        except OSError as err:  # the local side: a full disk
            raise StorageError(f"{url}: downloading to {local_path} failed: {err.strerror or err}") from None

    def list_sizes(self, url: str, loc: Location) -> Iterator[tuple[str, int]]:
        prefix = loc.path + "/" if loc.path else ""
        paginator = s3_client().get_paginator("list_objects_v2")
        pages = s3_call(url, lambda: list(paginator.paginate(Bucket=loc.bucket, Prefix=prefix)))
        for page in pages:
            for obj in page.get("Contents", []):
                yield f"s3://{loc.bucket}/{obj['Key']}", obj["Size"]

    def delete(self, url: str, loc: Location) -> None:
        s3_call(url, s3_client().delete_object, Bucket=loc.bucket, Key=loc.path)

    def check_reachable(self, url: str, loc: Location) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            s3_client().head_bucket(Bucket=loc.bucket)
        except ClientError as err:
            # HEAD responses have no body, so a missing bucket arrives as a bare "404" (not NoSuchBucket).
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
                raise StorageError(f"{url}: the bucket '{loc.bucket}' does not exist [NoSuchBucket]") from None
            raise s3_error(url, err) from None
        except BotoCoreError as err:
            raise s3_error(url, err) from None

    def read_versioned(self, url: str, loc: Location) -> tuple[bytes, str] | None:
        resp = s3_or_none(url, s3_client().get_object, MISSING, Bucket=loc.bucket, Key=loc.path)
        return None if resp is None else (resp["Body"].read(), resp["ETag"])

    def write_if(self, url: str, loc: Location, data: bytes, version: str | None) -> str | None:
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        resp = s3_or_none(url, s3_client().put_object, CONDITION_FAILED, Bucket=loc.bucket, Key=loc.path, Body=data,
                          **condition)
        return None if resp is None else resp["ETag"]

    def delete_if(self, url: str, loc: Location, version: str) -> bool:
        return s3_or_none(url, s3_client().delete_object, CONDITION_FAILED, Bucket=loc.bucket, Key=loc.path,
                          IfMatch=version) is not None

