"""One driver per run: a lease object, ``<run>/LEASE``, that the driver holds while it trains.

Two drivers started on the same run folder (a job submitted twice, a requeued SLURM job beside the
old one) would both write its checkpoints. The lease is a small JSON object (holder id, host, pid,
time-to-live, a renewal counter) taken and renewed only by compare-and-swap: S3 conditional writes
(``If-None-Match: *`` to create, ``If-Match: <ETag>`` to renew or take over), or on a folder the next
generation file, which only one writer can create (``clsys.storage.compare_and_swap``). The holder renews it every third of ``cluster.lease_ttl_s``
and deletes it when it exits.

A driver that finds the lease held watches it: a renewal means its holder is alive, and the driver
exits with an error naming it; a lease left unrenewed for its time-to-live belongs to a driver that
died without releasing it (kill -9, a lost machine), and is taken over. Time is only ever measured
on the watcher's own clock (how long the lease's version stayed the same), so clocks that disagree
between machines do not matter. A holder whose renewal finds the lease taken over (it was stopped
longer than the time-to-live) stops at once, so that only the new holder writes the run.

A conditional write the store applied but whose response was lost (a reset connection) is sent again by
botocore and refused, the lease no longer being at the version it was conditioned on: refused by its
own success. So a refused write is followed by a read: a record with this driver's holder id (a random
uuid, which no other driver writes) is its own, and its version is the lease's.

A record that is not one clsys writes (not a JSON object, a field missing or of another type, a
time-to-live that is not a number of seconds in (0, ``MAX_TTL_S``]: damaged, another program's, or an older
clsys's that took ``cluster.lease_ttl_s=inf``) is refused with an error naming the lease and the field, and
left in place. It tells neither whether its driver is alive nor how long to watch it: taking it over
after a guessed time could let two drivers write the run, and watching a NaN or infinite time-to-live
never ends. A person who knows that no driver uses the run removes it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from clsys import storage
from clsys.storage import compare_and_swap

log = logging.getLogger(__name__)

LEASE = "LEASE"
# The longest time-to-live (a day): how long a requeued job may wait on a lease its dead driver left.
# Far longer is a run stuck for nothing, and beyond ~9e9 s the renewer's wait overflows.
MAX_TTL_S = 86400.0
# The fields of a record (as ``Lease`` writes them) and their JSON types.
FIELDS = {"holder": str, "host": str, "pid": int, "started": str, "ttl_s": (int, float), "renewals": int}


def is_ttl(value) -> bool:
    """Whether ``value`` is a lease time-to-live: seconds, > 0 and <= MAX_TTL_S (so not NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_TTL_S


def read_record(data: bytes, url: str) -> dict:
    """The lease record in ``data`` (the object at ``url``); StorageError naming ``url`` and what is wrong
    for anything but a record clsys writes (see the module's docstring)."""
    record = storage.parse_json(data, url)
    if problem := _record_problem(record):
        raise storage.StorageError(
            f"{url}: not a lease record clsys writes ({problem}), so whether a driver holds the run cannot be "
            f"told; if none does, remove it (on a folder, its {LEASE}.* files) and start again")
    return record


def _record_problem(record) -> str | None:
    """What makes the parsed JSON ``record`` other than a record clsys writes; None when nothing does."""
    if not isinstance(record, dict):
        return f"not a JSON object but {json.dumps(record)[:40]}"
    for field, kind in FIELDS.items():
        if field not in record:
            return f"it has no {field}"
        if not isinstance(record[field], kind) or isinstance(record[field], bool):
            return f"its {field} is {json.dumps(record[field])[:40]}, not of the type clsys writes"
    if not is_ttl(record["ttl_s"]):
        return f"its ttl_s is {record['ttl_s']!r}, not a time-to-live in (0, {MAX_TTL_S:g}] s"
    return None


class LeaseHeld(RuntimeError):
    """Another live driver holds the run's lease; the message names it."""


class Lease:
    def __init__(self, run_url: str, ttl_s: float, on_lost=None):
        self.url = storage.join(run_url, LEASE)
        self.ttl_s = ttl_s
        self.record = {"holder": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "ttl_s": ttl_s, "renewals": 0}
        self.version: str | None = None
        self.on_lost = on_lost or _exit_on_lost
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self, poll_s: float | None = None) -> None:
        """Take the lease, waiting out one left by a dead driver; LeaseHeld when a live driver holds it."""
        replace = None  # the version a write may replace: None creates the lease
        while (version := self._write(replace)) is None:
            replace = self._stale_version(poll_s)
        self.version = version
        self._checked_conditions()
        self._renewer = threading.Thread(target=self._renew, name="clsys-lease", daemon=True)
        self._renewer.start()

    def _write(self, replace: str | None) -> str | None:
        """Write the record if the lease is at version ``replace`` (absent: None); the lease's new version,
        or None when another driver's record is there."""
        version = compare_and_swap.write_if(self.url, storage.json_bytes(self.record), replace)
        if version is None and (found := compare_and_swap.read_versioned(self.url)) is not None:
            if self._is_own(found[0]):
                return found[1]  # this driver's write went through; only its response was lost
        return version

    def _is_own(self, data: bytes) -> bool:
        """Whether ``data`` is a record this driver wrote. Not raising: the renewer takes a StorageError for
        an unreachable store and tries again, where a record of someone else's means the lease is lost."""
        try:
            return read_record(data, self.url)["holder"] == self.record["holder"]
        except storage.StorageError:
            return False  # this driver writes only records that read back

    def _stale_version(self, poll_s: float | None) -> str | None:
        """Watch the lease someone holds: the version to take over once it has gone unrenewed for its
        time-to-live; None when it disappears; LeaseHeld as soon as it is renewed."""
        watched, since = None, 0.0
        while (found := compare_and_swap.read_versioned(self.url)) is not None:
            holder = read_record(found[0], self.url)
            ttl = holder["ttl_s"]
            who = f"pid {holder['pid']} on {holder['host']}"
            if watched is None:
                log.info(f"[clsys] {self.url} is held by {who}; watching it for up to {ttl:g} s "
                         f"(its cluster.lease_ttl_s) to see whether that driver is alive")
                watched, since = found[1], time.monotonic()
            elif found[1] != watched:
                raise LeaseHeld(f"{self.url}: the run is in use by another driver ({who}, started "
                                f"{holder['started']}), which renews its lease: let it finish, or choose "
                                f"another train.name")
            elif time.monotonic() - since > ttl:
                log.info(f"[clsys] {self.url}: not renewed for {ttl:g} s, so {who} is gone; taking the lease over")
                return watched
            time.sleep(poll_s if poll_s is not None else min(1.0, ttl / 10))
        return None

    def _checked_conditions(self) -> None:
        # A store that ignores conditional writes would let a second driver in: creating the lease
        # again must fail now that it exists.
        if compare_and_swap.write_if(self.url, storage.json_bytes(self.record), None) is not None:
            raise RuntimeError(f"{self.url}: the object store ignored a conditional write (If-None-Match), so a "
                               f"lease cannot keep a second driver out; set cluster.lease_ttl_s=0 to run without one")

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.record["renewals"] += 1
            try:
                version = self._write(self.version)
            except storage.StorageError as err:  # the store is unreachable: try again at the next beat
                log.warning(f"[clsys] warning: renewing {self.url} failed: {err}")
                continue
            if version is None:
                self.on_lost(self)
                return
            self.version = version

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.version is not None:
            compare_and_swap.delete_if(self.url, self.version)
            self.version = None


def _exit_on_lost(lease: Lease) -> None:
    taken = compare_and_swap.read_versioned(lease.url)
    try:  # whatever is there now, this driver must stop: an unreadable record is named, not raised
        holder = read_record(taken[0], lease.url) if taken else None
        to = f"pid {holder['pid']} on {holder['host']}" if holder else "another driver, which has released it since"
    except storage.StorageError as err:
        to = f"a record clsys cannot read ({err})"
    log.error(f"error: {lease.url}: this driver lost its lease (not renewed for {lease.ttl_s:g} s) to {to}; "
              f"stopping at once so that only one driver writes the run")
    os._exit(1)
