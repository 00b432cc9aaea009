"""The S3 client (one per process, retrying every request) and how its failures become StorageErrors that name
the URL: what the S3 backend (``store.py``) and its resuming reader (``reader.py``) both call through."""
from __future__ import annotations

import functools
import logging
import os
import threading

from clsys.storage import base
from clsys.storage.base import StorageError

MISSING = ("NoSuchKey", "404", "NotFound")  # the error codes of an object that is not there

_CLIENT_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _client(pid: int):
    # One client per process (boto3 clients are not fork-safe, hence the pid in the cache key).
    import boto3
    from botocore.config import Config

    del pid
    # botocore says at INFO where it found the endpoint and the credentials, once per client: in every
    # Ray worker, whose INFO lines reach the driver's console. Warnings and errors still show.
    logging.getLogger("botocore").setLevel(logging.WARNING)
    return boto3.client(
        "s3",
        config=Config(retries={"max_attempts": base.ATTEMPTS, "mode": "adaptive"}, connect_timeout=10, read_timeout=120),
    )


def s3_client():
    # Threads (data_prep's shard uploads) may ask at once: boto3's default session must not build two clients
    # at the same time.
    with _CLIENT_LOCK:
        return _client(os.getpid())


def forget_clients() -> None:
    """Build the next client afresh, from the environment as it is then (a new endpoint or credentials)."""
    _client.cache_clear()


def s3_error(url: str, err: Exception) -> StorageError:
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return StorageError(f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        hints = {
            "NoSuchBucket": "the bucket does not exist",
            "NoSuchKey": "no such object",
            "404": "no such object",
            "InvalidAccessKeyId": "the access key is not valid (check your AWS credentials)",
            "SignatureDoesNotMatch": "the secret key is wrong (check your AWS credentials)",
            "AccessDenied": "access denied",
            "403": "access denied (check your AWS credentials)",
            "PreconditionFailed": "the object was replaced while it was being read",
            "412": "the object was replaced while it was being read",
        }
        return StorageError(f"{url}: {hints.get(code, 'S3 error')} [{code}]")
    return StorageError(f"{url}: {type(err).__name__}: {err}")


def s3_call(url: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a client call (botocore retries it); a failure raises StorageError naming ``url``."""
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except (BotoCoreError, ClientError) as err:
        raise s3_error(url, err) from None
    except S3UploadFailedError as err:
        # boto3 replaces an upload's ClientError with this one; the ClientError has the error code.
        raise s3_error(url, err.__context__ if isinstance(err.__context__, ClientError) else err) from None
    except RetriesExceededError as err:  # s3transfer gave up on a download part
        raise s3_error(url, err.last_exception) from None


def s3_or_none(url: str, fn, none_codes: tuple[str, ...], **kwargs):
    """An S3 request's response, or None when it fails with one of ``none_codes``; other failures raise
    StorageError naming ``url``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in none_codes:
            return None
        raise s3_error(url, err) from None
    except BotoCoreError as err:  # botocore's retries are spent
        raise s3_error(url, err) from None
