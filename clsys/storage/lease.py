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
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid

from clsys import storage
from clsys.storage import compare_and_swap

LEASE = "LEASE"


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
            if storage.parse_json(found[0], self.url).get("holder") == self.record["holder"]:
                return found[1]  # this driver's write went through; only its response was lost
        return version

    def _stale_version(self, poll_s: float | None) -> str | None:
        """Watch the lease someone holds: the version to take over once it has gone unrenewed for its
        time-to-live; None when it disappears; LeaseHeld as soon as it is renewed."""
        watched, since = None, 0.0
        while (found := compare_and_swap.read_versioned(self.url)) is not None:
            holder = storage.parse_json(found[0], self.url)
            ttl = float(holder.get("ttl_s", self.ttl_s))
            who = f"pid {holder.get('pid')} on {holder.get('host')}"
            if watched is None:
                print(f"[clsys] {self.url} is held by {who}; watching it for up to {ttl:g} s "
                      f"(its cluster.lease_ttl_s) to see whether that driver is alive", flush=True)
                watched, since = found[1], time.monotonic()
            elif found[1] != watched:
                raise LeaseHeld(f"{self.url}: the run is in use by another driver ({who}, started "
                                f"{holder.get('started')}), which renews its lease: let it finish, or choose "
                                f"another train.name")
            elif time.monotonic() - since > ttl:
                print(f"[clsys] {self.url}: not renewed for {ttl:g} s, so {who} is gone; taking the lease over",
                      flush=True)
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
                print(f"[clsys] warning: renewing {self.url} failed: {err}", file=sys.stderr, flush=True)
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
    holder = storage.parse_json(taken[0], lease.url) if taken else {}
    print(f"error: {lease.url}: this driver lost its lease (not renewed for {lease.ttl_s:g} s) to pid "
          f"{holder.get('pid')} on {holder.get('host')}; stopping at once so that only one driver writes the run",
          file=sys.stderr, flush=True)
    os._exit(1)
