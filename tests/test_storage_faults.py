"""clsys.storage against a misbehaving S3: resets, 500/503, truncated bodies (tests/s3_fault_proxy.py
in front of the moto server). Transient faults must not change a single byte of what is read or
written; permanent errors must stop at once, naming the URL and never a secret."""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from botocore.exceptions import IncompleteReadError, ResponseStreamingError
from conftest import use_endpoint
from s3_fault_proxy import Fault, FaultProxy

from clsys import storage
from clsys.shards.reader import load_shards, read_shard
from clsys.data.streaming import ShardLoader
from clsys.shards.writer import PUBLISHING, ShardWriter

TRANSIENT = ["reset", "500", "503", "truncate"]
SIZES = [1_000, 0, 12 * 2**20, 300_000]  # 12 MiB: upload_file sends it in 5 MiB parts (see the fixture)


def texts_of(samples: list[dict]) -> dict:
    """A collate for the loader's worker processes (module level: they get it pickled)."""
    return {"txt": [x["txt"] for x in samples]}


@pytest.fixture(autouse=True)
def fresh_clients():
    """Set up before monkeypatch, so torn down after it: later tests get clients of the restored env."""
    yield
    storage.forget_s3_clients()


@pytest.fixture
def proxied(s3_server, monkeypatch):
    """``proxied(*faults)`` starts a FaultProxy in front of the test server and points storage at it."""
    monkeypatch.setattr(storage.base, "MULTIPART_BYTES", 5 * 2**20)  # S3's smallest part: multipart at test sizes
    proxies = []

    def start(*faults: Fault) -> FaultProxy:
        proxies.append(FaultProxy(s3_server, list(faults)).start())
        use_endpoint(monkeypatch, proxies[-1].endpoint)
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.stop()


def payload(size: int, seed: int) -> bytes:
    return (seed.to_bytes(4, "big") * (size // 4 + 1))[:size] if size < 4096 else os.urandom(size)


@pytest.mark.parametrize("kind", TRANSIENT)
def test_objects_survive_a_fault_kind_byte_for_byte(kind, s3_bucket, proxied, tmp_path):
    # SlowDown makes botocore's adaptive mode throttle the client (to about a request a second), so
    # fewer of those; most responses that truncate could cut are GETs' (PUTs answer with no body).
    proxy = proxied(Fault(kind, "ANY", every={"503": 6, "truncate": 2}.get(kind, 3)))
    blobs = {storage.join(s3_bucket, f"obj-{size}"): payload(size, size) for size in SIZES}
    for i, (url, data) in enumerate(blobs.items()):
        if i % 2:  # both write paths: put_object, and s3transfer (multipart for the big one)
            storage.write_bytes(url, data)
        else:
            (tmp_path / "up").write_bytes(data)
            storage.upload_file(str(tmp_path / "up"), url)
    for url, data in blobs.items():
        assert storage.read_bytes(url) == data, url
        with storage.open_read(url) as f:  # the way shards are read: small read(n) calls
            assert b"".join(iter(lambda: f.read(65_536), b"")) == data, url
        storage.download_file(url, str(tmp_path / "down"))
        assert (tmp_path / "down").read_bytes() == data, url
    assert proxy.injected[kind] >= 3, proxy.injected


def test_botocore_detects_a_truncated_body_and_the_reader_resumes_it(s3_bucket, proxied):
    url, data = storage.join(s3_bucket, "blob"), os.urandom(3_000_000)
    storage.write_bytes(url, data)
    proxy = proxied(Fault("truncate", "GET"))  # every GET, resumed ones too, gets half its body
    loc = storage.parse(url)
    body = storage.s3_client().get_object(Bucket=loc.bucket, Key=loc.path)["Body"]
    with pytest.raises((IncompleteReadError, ResponseStreamingError)):
        while body.read(65_536):
            pass
    assert storage.read_bytes(url) == data  # each resumed GET brings half of what is left
    assert proxy.injected["truncate"] >= 10


def test_a_read_that_never_progresses_gives_up_naming_the_url(s3_bucket, proxied, monkeypatch):
    url = storage.join(s3_bucket, "stuck")
    storage.write_bytes(url, b"x" * 10_000)
    monkeypatch.setattr(storage.base, "BACKOFF_S", 0.001)
    proxied(Fault("truncate", "GET", keep=0.0))  # headers, then not one byte
    with pytest.raises(storage.StorageError, match=f"{url}: reading failed {storage.base.ATTEMPTS} times in a row at "
                                                   "byte 0 of 10000; last error"):
        storage.read_bytes(url)


def test_an_object_replaced_mid_read_is_an_error_not_a_splice(s3_bucket, proxied):
    url = storage.join(s3_bucket, "moving")
    storage.write_bytes(url, os.urandom(200_000))
    proxied(Fault("truncate", "GET"))
    with storage.open_read(url) as f:
        f.read(1000)  # the first response carries 100 000 bytes
        storage.write_bytes(url, os.urandom(200_000))
        with pytest.raises(storage.StorageError, match=f"{url}: the object was replaced while it was being read"):
            f.read()


def write_stream(url: str, tmp_path) -> None:
    writer = ShardWriter(url, str(tmp_path), max_bytes=32_768)  # 12 shards of 10 samples
    for i in range(120):
        writer.write(f"s{i:04d}", f"sentence number {i} " * 4, {"i": i})
    writer.close()
    writer.write_manifest({})


def test_shard_loader_through_faults_yields_the_clean_batches(s3_bucket, proxied, tmp_path):
    url = storage.join(s3_bucket, "stream")
    write_stream(url, tmp_path)

    def batches():
        # 2 loader worker processes, each with its own client (made from the environment).
        loader = ShardLoader(url, rank=0, ranks=1, micro_batch=8, collate=texts_of,
                             seed=5, loader_workers=2, shuffle_buffer=16)
        it = iter(loader)
        return [next(it) for _ in range(20)]  # into the second epoch (15 batches each)

    clean = batches()
    # Resets and 500s cost botocore's backoff (half a second on average): fewer of those.
    proxy = proxied(Fault("truncate", "GET", 3), Fault("reset", "GET", 8), Fault("500", "GET", 11))
    assert batches() == clean
    assert proxy.injected["truncate"] >= 5 and proxy.injected["reset"] >= 2, proxy.injected


def test_shards_are_uploaded_while_the_next_ones_are_written(s3_bucket, proxied, tmp_path, monkeypatch):
    """A full shard is uploaded by a background thread: with every PUT held back 0.3 s, several uploads are
    under way at once (never more than PUBLISHING), ``close`` returns with all of them done, and the stream
    reads back whole, in order. (The uploads are timed by wrapping the real function, which still runs.)"""
    spans: list[tuple[float, float]] = []
    publish = storage.publish_staged

    def timed(staged: str, url: str) -> None:
        start = time.monotonic()
        publish(staged, url)
        spans.append((start, time.monotonic()))

    monkeypatch.setattr(storage, "publish_staged", timed)
    proxied(Fault("slow", "PUT", 1, delay=0.3))
    url = storage.join(s3_bucket, "stream")
    write_stream(url, tmp_path)  # 12 shards, closed, then the manifest
    assert len(spans) == 12
    at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert 1 < at_once <= PUBLISHING, spans
    keys = [sample["__key__"] for shard in load_shards(url) for sample in read_shard(shard)]  # sha256s checked
    assert keys == [f"s{i:04d}" for i in range(120)]
    assert not list(tmp_path.iterdir()), "staged shards left behind"


def test_a_failed_upload_stops_the_writer_naming_the_shard(s3_server, tmp_path):
    writer = ShardWriter("s3://no-such-bucket-here/stream", str(tmp_path), max_bytes=32_768)
    with pytest.raises(storage.StorageError,
                       match=r"^s3://no-such-bucket-here/stream/shard-0000\d\d\.tar: the bucket does not exist"):
        for i in range(120):
            writer.write(f"s{i:04d}", f"sentence number {i} " * 4, {"i": i})
        writer.close()
    # The uploads under way when the error came ended before it was raised (no thread left, no staged file).
    assert not [t for t in threading.enumerate() if t.name.startswith("shard-publish")]
    assert not list(tmp_path.iterdir()), "staged shards left behind"


def test_streams_sharing_a_staging_folder_keep_their_shards_apart(s3_bucket, tmp_path):
    """data_prep wiki's two streams stage in one temporary folder and both have a ``shard-000000.tar`` open
    at once (no shuffle window): each must upload its own bytes (they once shared one staged file)."""
    writers = {name: ShardWriter(storage.join(s3_bucket, "w", name), str(tmp_path), max_bytes=32_768)
               for name in ("sentences", "documents")}
    for i in range(100):
        for name, writer in writers.items():
            writer.write(f"{name[0]}{i:04d}", f"{name} number {i} " * 5, {"i": i})
    for name, writer in writers.items():
        writer.close()
        writer.write_manifest({})
        keys = [s["__key__"] for shard in load_shards(storage.join(s3_bucket, "w", name)) for s in read_shard(shard)]
        assert keys == [f"{name[0]}{i:04d}" for i in range(100)]


def test_checkpoint_tree_round_trips_through_faults(s3_bucket, proxied, tmp_path):
    from clsys.engine.checkpoint import complete_checkpoints

    src = tmp_path / "ckpt"
    for rel, size in [("ds/mp_rank_00_model_states.pt", 6 * 2**20), ("ds/zero_pp_rank_0_optim_states.pt", 300_000),
                      ("rank-00000.pt", 2_000), ("hf/config.json", 500), ("hf/tokenizer.json", 0)]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(payload(size, size))
    proxy = proxied(Fault("reset", "PUT", 3), Fault("500", "POST", 2), Fault("503", "PUT", 7),
                    Fault("truncate", "GET", 3), Fault("slow", "ANY", 5, delay=0.05))
    run = storage.join(s3_bucket, "run")
    url = storage.join(run, "checkpoints", "step-00000010")
    storage.upload_dir(str(src), url)
    storage.write_json(storage.join(url, "clsys_state.json"), {"step": 10, "world_size": 1})
    storage.write_bytes(storage.join(url, "COMPLETE"), b"")
    assert complete_checkpoints(run) == [(10, url)]
    storage.download_dir(url, str(tmp_path / "back"))
    (tmp_path / "back" / "COMPLETE").unlink()
    assert json.loads((tmp_path / "back" / "clsys_state.json").read_text()) == {"step": 10, "world_size": 1}
    (tmp_path / "back" / "clsys_state.json").unlink()
    cmp = filecmp.dircmp(src, tmp_path / "back")
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files), cmp.report_full_closure()
    assert all(filecmp.cmp(p, tmp_path / "back" / p.relative_to(src), shallow=False) for p in src.rglob("*") if p.is_file())
    assert set(proxy.injected) == {"reset", "500", "503", "truncate", "slow"}, proxy.injected


def test_missing_objects_fail_at_once_naming_the_url(s3_bucket, proxied, tmp_path):
    proxied()
    missing = storage.join(s3_bucket, "no/such/object")
    for op in (storage.read_bytes, storage.open_read, lambda u: storage.download_file(u, str(tmp_path / "x"))):
        start = time.monotonic()
        with pytest.raises(storage.StorageError, match=f"^{missing}: no such object"):
            op(missing)
        assert time.monotonic() - start < 2, "a permanent error went through a retry loop"
    assert not storage.exists(missing)
    with pytest.raises(storage.StorageError, match="^s3://no-such-bucket-here/k: the bucket does not exist"):
        storage.read_bytes("s3://no-such-bucket-here/k")


def test_wrong_credentials_name_the_url_and_never_the_secret(s3_auth_server, monkeypatch, tmp_path):
    auth = s3_auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", auth["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", auth["secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = storage.join(auth["bucket_url"], "signed")
    (tmp_path / "f").write_bytes(b"payload")
    with FaultProxy(auth["endpoint"], [Fault("reset", "ANY", 3)]) as proxy:
        # Signed for the proxy's host:port, verified upstream: forwarding keeps signatures valid.
        use_endpoint(monkeypatch, proxy.endpoint)
        storage.write_bytes(url, b"payload")
        assert storage.read_bytes(url) == b"payload"
        wrong = "WrongSecretKeyThatMustNotLeak0123456789"
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
        use_endpoint(monkeypatch, proxy.endpoint)
        for op in (storage.read_bytes, lambda u: storage.upload_file(str(tmp_path / "f"), u)):
            start = time.monotonic()
            with pytest.raises(storage.StorageError) as err:
                op(url)
            assert time.monotonic() - start < 5
            msg = str(err.value)
            assert msg.startswith(f"{url}: the secret key is wrong") and "[SignatureDoesNotMatch]" in msg, msg
            assert wrong not in msg and auth["secret_access_key"] not in msg
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        use_endpoint(monkeypatch, proxy.endpoint)
        with pytest.raises(storage.StorageError, match=f"^{url}: the access key is not valid"):
            storage.read_bytes(url)


def test_the_proxy_runs_as_a_process(s3_server, s3_bucket, monkeypatch):
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "s3_fault_proxy.py"),
                             "--upstream", s3_server, "--port", "0", "--faults", "truncate:GET:2,500:PUT:2,reset:GET:3"],
                            stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().removeprefix("listening on ").strip()
        assert endpoint.startswith("http://127.0.0.1:"), endpoint
        use_endpoint(monkeypatch, endpoint)
        url, data = storage.join(s3_bucket, "via-process"), os.urandom(100_000)
        for _ in range(2):
            storage.write_bytes(url, data)
            assert storage.read_bytes(url) == data
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    injected = json.loads(out.strip().splitlines()[-1])["injected"]
    assert injected.keys() == {"truncate", "500", "reset"}, injected
