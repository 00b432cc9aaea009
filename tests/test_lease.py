"""One driver per run: the compare-and-swap writes the lease is built on, and the lease between real
processes on file:// and on a real S3 server (moto on 127.0.0.1, which enforces If-None-Match and
If-Match as S3 does), also when a conditional write's response is lost (tests/s3_fault_proxy.py).
tests/test_pretrain.py starts a second `python -m clsys.pretrain` beside a
running one and sees it refused."""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import use_endpoint
from s3_fault_proxy import Fault, FaultProxy

from clsys import storage
from clsys.storage import compare_and_swap
from clsys.storage.lease import LEASE, Lease, LeaseHeld

HOLD = """
import sys, time
from clsys.storage.lease import Lease
Lease(sys.argv[1], float(sys.argv[2])).acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture(params=["file", "s3"])
def run_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/run"
    return f"{request.getfixturevalue('s3_bucket')}/run"


def test_compare_and_swap_writes(run_url):
    url = storage.join(run_url, "object")
    first = compare_and_swap.write_if(url, b"one", None)
    assert first is not None and compare_and_swap.read_versioned(url) == (b"one", first)
    assert compare_and_swap.write_if(url, b"two", None) is None, "created over an existing object"
    second = compare_and_swap.write_if(url, b"two", first)
    assert second is not None and compare_and_swap.read_versioned(url) == (b"two", second)
    assert compare_and_swap.write_if(url, b"three", first) is None, "replaced a version that was no longer current"
    assert compare_and_swap.delete_if(url, first) is False and compare_and_swap.read_versioned(url)[0] == b"two"
    third = compare_and_swap.write_if(url, b"three", second)
    assert compare_and_swap.write_if(url, b"late", first) is None, "a write two versions late replaced the object"
    assert compare_and_swap.read_versioned(url) == (b"three", third)
    assert compare_and_swap.delete_if(url, third) is True and compare_and_swap.read_versioned(url) is None
    assert compare_and_swap.write_if(url, b"four", third) is None, "replaced an object that was gone"
    assert compare_and_swap.write_if(url, b"four", second) is None, "replaced an object that was gone"
    assert compare_and_swap.write_if(url, b"again", None) is not None, "a deleted object could not be made again"
    if run_url.startswith("file://"):  # what a finished run leaves: the current generation, nothing else
        assert [n for n in os.listdir(run_url[len("file://"):]) if n.startswith("object")] == ["object.000000000005"]


def test_a_writer_stopped_between_its_read_and_its_write_is_refused(tmp_path, monkeypatch):
    """On a folder a write conditioned on generation n takes the name of generation n+1, and names below the
    newest are removed: a writer that read generation 1 and was stopped (before it wrote) while two others
    wrote 2 and 3 finds the name of 2 free again. Its write must still be refused, and leave 3 current."""
    from clsys.storage import local

    url = f"file://{tmp_path}/LEASE"
    first = compare_and_swap.write_if(url, b"one", None)
    stale = local._current(str(tmp_path / "LEASE"))  # what the stopped writer read
    third = compare_and_swap.write_if(url, b"three", compare_and_swap.write_if(url, b"two", first))
    monkeypatch.setattr(local, "_current", lambda path: stale)  # it continues from there
    assert compare_and_swap.write_if(url, b"late", first) is None, "a writer two versions late replaced the object"
    monkeypatch.undo()
    assert compare_and_swap.read_versioned(url) == (b"three", third)


INCREMENT = """
import sys
from clsys import storage
from clsys.storage import compare_and_swap
url, times = sys.argv[1], int(sys.argv[2])
for _ in range(times):
    while True:
        count, version = compare_and_swap.read_versioned(url)
        if compare_and_swap.write_if(url, str(int(count) + 1).encode(), version) is not None:
            break
"""


def test_compare_and_swap_loses_no_update_between_processes(run_url):
    """Three processes add 1 to a counter 40 times each, by read and compare-and-swap: every refused write is
    read again and retried, so the count ends at 120 only if no two writes replaced the same version (a
    folder's write made an unconditional rename ended at 83)."""
    url = storage.join(run_url, "counter")
    assert compare_and_swap.write_if(url, b"0", None) is not None
    adders = [subprocess.Popen([sys.executable, "-c", INCREMENT, url, "40"]) for _ in range(3)]
    assert [adder.wait(timeout=120) for adder in adders] == [0, 0, 0]
    assert compare_and_swap.read_versioned(url)[0] == b"120"


def test_a_folder_without_hard_links_names_the_way_out(tmp_path, monkeypatch):
    """Compare-and-swap on a folder is a hard link; a filesystem that refuses them (some FUSE and SMB mounts,
    which cannot be mounted here: os.link is made to refuse as they do) gets an error naming the setting
    that runs without a lease."""
    def refuse(source, target):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    with pytest.raises(storage.StorageError, match=r"LEASE: writing failed: Operation not permitted \(this "
                                                   r"filesystem has no hard links.*cluster.lease_ttl_s=0"):
        Lease(f"file://{tmp_path}/run", 3.0).acquire()
    assert os.listdir(tmp_path / "run") == [], "the refused write left a file behind"


def test_a_live_holder_keeps_the_run_and_a_stopped_one_loses_it(run_url):
    """A holds the lease (time-to-live 3 s, renewed every second). B finds it renewed and gives up,
    naming A. A stopped (SIGSTOP) past the time-to-live: B takes the lease over; A, continued, finds
    its renewal refused and exits at once."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, run_url, "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(LeaseHeld, match=f"in use by another driver \\(pid {holder.pid} on "):
            Lease(run_url, 3.0).acquire(poll_s=0.1)

        holder.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        taker = Lease(run_url, 30.0, on_lost=lambda lease: pytest.fail("the new holder lost the lease"))
        taker.acquire(poll_s=0.1)
        assert 3 < time.monotonic() - started < 15
        assert _lease_holder(run_url) == taker.record["holder"]
        holder.send_signal(signal.SIGCONT)
        assert holder.wait(timeout=10) == 1
        assert f"this driver lost its lease (not renewed for 3 s) to pid {taker.record['pid']}" in holder.stderr.read()
        taker.release()
        assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is None
    finally:
        holder.kill()
        holder.wait()


STALL_IN_RENEWAL = """
import os, signal, sys, time
from clsys.storage.lease import Lease
Lease(sys.argv[1], float(sys.argv[2])).acquire()
flush = os.fsync
def flush_then_stop(fd):  # the disk (or an NFS server) stalls while the renewal's bytes go out
    flush(fd)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1)  # the stop reaches every thread of the process, this one too, before it goes on
os.fsync = flush_then_stop
print("held", flush=True)
signal.pause()
"""


def test_a_holder_stopped_inside_its_renewal_write_loses_the_run(tmp_path):
    """The attacker's timing for a run folder on a filesystem: the holder is stopped halfway through
    its compare-and-swap (its renewal written, not yet in place), the point where a lock-based write
    holds the lock. The new driver must still take the lease over within the time-to-live, and the old
    one, continued, must find its renewal refused and exit."""
    run_url = f"file://{tmp_path}/run"
    holder = subprocess.Popen([sys.executable, "-c", STALL_IN_RENEWAL, run_url, "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        deadline = time.monotonic() + 10
        while _process_state(holder.pid) != "T":  # stopped by itself, inside its first renewal
            assert time.monotonic() < deadline and holder.poll() is None, "the holder never renewed"
            time.sleep(0.05)
        taker = Lease(run_url, 30.0, on_lost=lambda lease: pytest.fail("the new holder lost the lease"))
        acquiring = threading.Thread(target=taker.acquire, kwargs={"poll_s": 0.1}, daemon=True)
        acquiring.start()
        acquiring.join(timeout=20)
        assert not acquiring.is_alive(), "the new driver hangs behind the stopped one"
        assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is not None
        holder.send_signal(signal.SIGCONT)
        assert holder.wait(timeout=10) == 1
        assert f"this driver lost its lease (not renewed for 3 s) to pid {taker.record['pid']}" in holder.stderr.read()
        assert _lease_holder(run_url) == taker.record["holder"]
        taker.release()
        assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is None
    finally:
        holder.kill()
        holder.wait()


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def _lease_holder(run_url: str) -> str:
    found = compare_and_swap.read_versioned(storage.join(run_url, LEASE))
    return storage.parse_json(found[0], "LEASE")["holder"]


@pytest.fixture
def lossy_s3(s3_server, s3_bucket, monkeypatch):
    """``lossy_s3(fault)``: a run folder on the test server behind a FaultProxy injecting ``fault``."""
    proxies = []

    def start(fault: Fault) -> tuple[str, FaultProxy]:
        proxies.append(FaultProxy(s3_server, [fault]).start())
        use_endpoint(monkeypatch, proxies[-1].endpoint)
        return f"{s3_bucket}/run", proxies[-1]

    yield start
    for proxy in proxies:
        proxy.stop()
    storage.forget_s3_clients()  # later tests get clients of the restored endpoint


@pytest.mark.parametrize("retries", [storage.base.ATTEMPTS, 0])
def test_a_renewal_whose_response_is_lost_keeps_the_lease(retries, lossy_s3, monkeypatch, caplog):
    """Every third PUT (the create and the check of conditions pass) is applied by the server but its
    response never arrives: botocore sends the same If-Match PUT again and gets 412, as the lease it
    matched has just been replaced, by this very write. With no retries the renewal fails instead, and
    the next one gets the 412. Either way the driver must see its own record there and keep the run."""
    monkeypatch.setattr(storage.base, "ATTEMPTS", retries)  # botocore's max_attempts; before the client is made
    run_url, proxy = lossy_s3(Fault("lost", "PUT", every=3))
    lost = []
    lease = Lease(run_url, 1.5, on_lost=lost.append)  # renewed every 0.5 s
    lease.acquire()
    time.sleep(3)
    assert not lost, "a driver stopped for a renewal whose response was lost"
    assert proxy.injected["lost"] >= 2
    assert any(r.levelno == logging.WARNING and "warning: renewing" in r.getMessage()
               for r in caplog.records) == (retries == 0)
    stored = storage.parse_json(compare_and_swap.read_versioned(storage.join(run_url, LEASE))[0], LEASE)
    assert stored["holder"] == lease.record["holder"] and stored["renewals"] >= 4
    lease.release()
    assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is None


def test_a_lease_created_with_a_lost_response_is_taken_at_once(lossy_s3, caplog):
    """The create (If-None-Match: *) is applied, its response lost, and the retry gets 412: the lease
    the driver finds is its own, which it must not watch for a time-to-live as if another held it."""
    caplog.set_level(logging.INFO, logger="clsys")
    run_url, proxy = lossy_s3(Fault("lost", "PUT", times=1))
    lease = Lease(run_url, 5.0, on_lost=lambda lease: pytest.fail("the lease was lost"))
    started = time.monotonic()
    lease.acquire(poll_s=0.1)
    assert time.monotonic() - started < 2.5 and proxy.injected["lost"] == 1
    assert "is held by" not in caplog.text
    assert _lease_holder(run_url) == lease.record["holder"]
    lease.release()


def _record(**fields) -> bytes:
    """A lease record as another driver wrote it, with ``fields`` changed (None: left out)."""
    record = {"holder": "0f" * 16, "host": "node-7", "pid": 4242, "started": "2026-01-01 00:00:00 UTC",
              "ttl_s": 1.0, "renewals": 0, **fields}
    return storage.json_bytes({k: v for k, v in record.items() if v is not None})


@pytest.mark.parametrize("found,field", [
    pytest.param(b"[]", "a JSON object", id="a list"),  # was AttributeError: 'list' object has no attribute 'get'
    pytest.param(b'"a note"', "a JSON object", id="a string"),
    pytest.param(_record(pid="4242"), "pid", id="pid a string"),  # was watched, then taken over
    pytest.param(_record(host=["node-7"]), "host", id="host a list"),
    pytest.param(_record(ttl_s=None), "ttl_s", id="no ttl_s"),  # was watched for the watcher's own time-to-live
    pytest.param(_record(ttl_s=True), "ttl_s", id="ttl_s true"),
    pytest.param(_record(ttl_s=float("nan")), "ttl_s", id="ttl_s NaN"),  # was watched forever: no time exceeds NaN
    pytest.param(_record(ttl_s=float("inf")), "ttl_s", id="ttl_s Infinity"),  # was watched forever
    pytest.param(_record(ttl_s=1e12), "ttl_s", id="ttl_s beyond a day"),  # no driver could take it over
    pytest.param(_record(ttl_s=-5.0), "ttl_s", id="ttl_s negative"),  # was taken over at once, its driver maybe alive
])
def test_a_lease_record_clsys_cannot_read_is_refused_and_kept(found, field, tmp_path):
    """A LEASE that is not a record as clsys writes it (damaged, another program's, an older clsys that
    took cluster.lease_ttl_s=inf) says neither who holds the run nor how long to wait before its holder
    counts as dead. Guessing either could let two drivers write one run: the driver must stop at once
    with an error naming the lease and the field, and leave the record for a person to look at."""
    run_url = f"file://{tmp_path}/run"
    url = storage.join(run_url, LEASE)
    version = compare_and_swap.write_if(url, found, None)
    outcome = []

    def acquire() -> None:
        try:
            Lease(run_url, 3.0, on_lost=lambda lease: outcome.append("lost")).acquire(poll_s=0.05)
            outcome.append("taken")
        except Exception as err:  # noqa: BLE001 - which error it was is the assertion below
            outcome.append(err)

    acquiring = threading.Thread(target=acquire, daemon=True)
    acquiring.start()
    acquiring.join(timeout=5)  # a record of ttl_s 1 (the other cases' ttl) is taken over in ~1 s
    assert outcome, "still watching the lease after 5 s"
    assert isinstance(outcome[0], storage.StorageError), outcome
    assert str(outcome[0]).startswith(f"{url}: not a lease record clsys writes") and field in str(outcome[0])
    assert compare_and_swap.read_versioned(url) == (found, version), "the record was replaced"


def test_the_largest_time_to_live_the_config_takes_keeps_its_renewer(tmp_path):
    """``cluster.lease_ttl_s=inf`` passed the config, and the renewer then died of OverflowError (an
    unrenewed lease, taken by the next driver while this one still writes). The config refuses what the
    renewer cannot wait for, naming the key; the largest value it takes runs."""
    from clsys.config import ConfigError
    from clsys.recipes import load_config
    from clsys.storage.lease import MAX_TTL_S

    for bad in ("inf", "nan", "-1", str(MAX_TTL_S * 2)):
        with pytest.raises(ConfigError, match=r"cluster.lease_ttl_s: expected 0 \(no lease\) or a time-to-live"):
            load_config(None, [f"cluster.lease_ttl_s={bad}"])
    lease = Lease(f"file://{tmp_path}/run", load_config(None, [f"cluster.lease_ttl_s={MAX_TTL_S}"]).cluster.lease_ttl_s)
    lease.acquire()
    try:
        time.sleep(0.2)
        assert lease._renewer.is_alive(), "the renewer thread died"
    finally:
        lease.release()


def test_a_holder_whose_lease_is_overwritten_with_what_clsys_cannot_read_stops(tmp_path):
    """Another program replaces a live driver's LEASE with a JSON list. The driver's next renewal is
    refused and reads it back: it must count the lease as lost and exit (before, reading the list raised
    AttributeError in the renewer thread, which died, and the driver went on writing without a lease)."""
    run_url = f"file://{tmp_path}/run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, run_url, "1.5"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        url = storage.join(run_url, LEASE)
        assert compare_and_swap.write_if(url, b"[]", compare_and_swap.read_versioned(url)[1]) is not None
        assert holder.wait(timeout=10) == 1
        assert (f"this driver lost its lease (not renewed for 1.5 s) to a record clsys cannot read ({url}: not a "
                f"lease record clsys writes (not a JSON object but [])") in holder.stderr.read()
    finally:
        holder.kill()
        holder.wait()
