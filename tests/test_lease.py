"""One driver per run: the compare-and-swap writes the lease is built on, and the lease between real
processes on file:// and on a real S3 server (moto on 127.0.0.1, which enforces If-None-Match and
If-Match as S3 does), also when a conditional write's response is lost (tests/s3_fault_proxy.py).
tests/test_pretrain.py starts a second `python -m clsys.pretrain` beside a
running one and sees it refused."""
from __future__ import annotations

import signal
import subprocess
import sys
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
    assert second is not None and storage.read_bytes(url) == b"two"
    assert compare_and_swap.write_if(url, b"three", first) is None, "replaced a version that was no longer current"
    assert compare_and_swap.delete_if(url, first) is False and storage.exists(url)
    assert compare_and_swap.delete_if(url, second) is True and compare_and_swap.read_versioned(url) is None
    assert compare_and_swap.write_if(url, b"four", second) is None, "replaced an object that was gone"


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
        assert storage.read_json(storage.join(run_url, LEASE))["holder"] == taker.record["holder"]
        holder.send_signal(signal.SIGCONT)
        assert holder.wait(timeout=10) == 1
        assert f"this driver lost its lease (not renewed for 3 s) to pid {taker.record['pid']}" in holder.stderr.read()
        taker.release()
        assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is None
    finally:
        holder.kill()
        holder.wait()


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
def test_a_renewal_whose_response_is_lost_keeps_the_lease(retries, lossy_s3, monkeypatch, capsys):
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
    assert ("warning: renewing" in capsys.readouterr().err) == (retries == 0)
    stored = storage.read_json(storage.join(run_url, LEASE))
    assert stored["holder"] == lease.record["holder"] and stored["renewals"] >= 4
    lease.release()
    assert compare_and_swap.read_versioned(storage.join(run_url, LEASE)) is None


def test_a_lease_created_with_a_lost_response_is_taken_at_once(lossy_s3, capsys):
    """The create (If-None-Match: *) is applied, its response lost, and the retry gets 412: the lease
    the driver finds is its own, which it must not watch for a time-to-live as if another held it."""
    run_url, proxy = lossy_s3(Fault("lost", "PUT", times=1))
    lease = Lease(run_url, 5.0, on_lost=lambda lease: pytest.fail("the lease was lost"))
    started = time.monotonic()
    lease.acquire(poll_s=0.1)
    assert time.monotonic() - started < 2.5 and proxy.injected["lost"] == 1
    assert "is held by" not in capsys.readouterr().out
    assert storage.read_json(storage.join(run_url, LEASE))["holder"] == lease.record["holder"]
    lease.release()
