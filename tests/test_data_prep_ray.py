"""data_prep wiki --ray (and, last, data_prep pairs --ray, an actor killed too): a real local Ray cluster (2 CPUs, all on 127.0.0.1)
that each run joins through RAY_ADDRESS, as under `ray job submit`; multistream dumps and their indexes in a real
moto S3 server (127.0.0.1), read by the tasks with ranged reads; shards written to it. The output must be the
one-process run's (pairs: the run's with as many worker processes as the cluster has CPUs), byte for byte."""
from __future__ import annotations

import bz2
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from clsys import storage
from conftest import loopback_ray_cluster
from data_prep.ray_pool import FAULT_ENV
from test_data_prep import SAMPLE, run_cli, small_dump
from test_data_prep_multistream import write_multistream
from test_data_prep_languages import DUMPS, LANGS
from test_data_prep_pairs import FORMATS, big_input, stream_files, write_parquet
from test_data_prep_workers import big_jsonl, wait_for

SHARD_MB = "0.05"  # several shards a stream, so that their order matters


@pytest.fixture(scope="module")
def ray_env(s3_server):
    """The cluster, started after the S3 server: its workers take the server's credentials from the
    environment they start with (the driver passes them only its endpoint and region)."""
    with loopback_ray_cluster(head_cpus=2) as (_, env):
        yield env


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    storage.s3_client().create_bucket(Bucket=name)
    return f"s3://{name}"


def upload_multistream(xml: bytes, name: str, bucket: str, folder: Path, pages_per_block: int) -> tuple[str, str]:
    """``xml`` as a multistream dump and its index, uploaded as ``NAME-pages-articles-multistream.xml.bz2``
    and ``NAME-pages-articles-multistream-index.txt.bz2``; their URLs."""
    folder.mkdir()
    dump, index, _ = write_multistream(xml, folder, pages_per_block)
    urls = (f"{bucket}/dumps/{name}-pages-articles-multistream.xml.bz2",
            f"{bucket}/dumps/{name}-pages-articles-multistream-index.txt.bz2")
    for path, url in zip((dump, index), urls):
        storage.upload_file(str(path), url)
    return urls


def objects(prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, by its name below it."""
    return {url[len(prefix):]: storage.read_bytes(url) for url in storage.list_prefix(prefix)}


@pytest.fixture(scope="module")
def english(bucket, tmp_path_factory) -> tuple[str, str, dict[str, bytes]]:
    """60 pages of the bundled sample in blocks of 7 pages (9 blocks), and the one-process run's output
    (no index: the dump streamed from S3 in one piece)."""
    xml = small_dump(bz2.decompress(SAMPLE.read_bytes()), 0, 60)
    dump, index = upload_multistream(xml, "enwiki-20261101", bucket, tmp_path_factory.mktemp("en") / "d", 7)
    result = run_cli("--input", dump, "--out", f"{bucket}/serial-en", "--shard-size-mb", SHARD_MB)
    assert result.returncode == 0, result.stderr
    return dump, index, objects(f"{bucket}/serial-en")


@pytest.mark.parametrize("by_block", [True, False], ids=["index", "no_index"])
def test_ray_from_s3_equals_serial(by_block, english, bucket, ray_env):
    """With the index, tasks read their bz2 block from S3; without, a streaming task reads the dump and tasks
    parse batches of its pages."""
    dump, index, serial = english
    out = f"{bucket}/ray-en-{by_block}"
    result = run_cli("--input", dump, *(("--index", index) if by_block else ()), "--out", out,
                     "--shard-size-mb", SHARD_MB, "--ray", env=ray_env)
    assert result.returncode == 0, result.stderr
    assert f"2 tasks at a time on the Ray cluster at {ray_env['RAY_ADDRESS']}" in result.stderr
    assert "dumps 1/1" in result.stderr  # the progress line
    ray = objects(out)
    shards = [name for name in ray if name.startswith("/sentences/shard-")]
    assert len(shards) > 2 and ray == serial
    (source,) = json.loads(ray["/sentences/manifest.json"])["sources"]
    assert (source["status"], source["pages_read"]) == ("complete", 60)


@pytest.mark.parametrize("how,by_block", [("raise", True), ("exit", True), ("raise", False), ("exit", False)],
                         ids=["raise", "exit", "raise_reading_no_index", "exit_reading_no_index"])
def test_failed_task_is_retried(how, by_block, english, bucket, ray_env, tmp_path):
    """One task fails (a storage error its retries did not outlive; its worker process dying): Ray runs it
    again, and the output is still the one-process run's. Without the index the first task is the one
    that reads the dump (the others parse what it yields): it fails, is run again from the start, and no
    batch arrives twice."""
    dump, index, serial = english
    marker = tmp_path / "fault"
    out = f"{bucket}/retried-{how}-{by_block}"
    result = run_cli("--input", dump, *(("--index", index) if by_block else ()), "--out", out,
                     "--shard-size-mb", SHARD_MB, "--ray", env={**ray_env, FAULT_ENV: f"{how}:{marker}"})
    assert result.returncode == 0, result.stderr
    assert marker.exists()  # the fault did fire
    assert objects(out) == serial


def test_corrupt_block_is_reported_as_in_one_process(english, bucket, ray_env):
    """Damaged bz2 data inside the 4th block: its 7 pages are lost and reported (status corrupt at the
    block's offset, exit 3), the other blocks kept; the Ray run writes what one process does with the index."""
    dump, index, _ = english
    offsets = sorted({int(line.split(":")[0]) for line in bz2.decompress(storage.read_bytes(index)).decode().splitlines()})
    data = bytearray(storage.read_bytes(dump))
    middle = (offsets[3] + offsets[4]) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    bad = dump.replace("/dumps/", "/corrupt/")
    storage.write_bytes(bad, bytes(data))
    outs = {how: f"{bucket}/corrupt-{how}" for how in ("serial", "ray")}
    for how, out in outs.items():
        result = run_cli("--input", bad, "--index", index, "--out", out, "--shard-size-mb", SHARD_MB,
                         *(("--ray",) if how == "ray" else ()), env=ray_env if how == "ray" else None)
        assert result.returncode == 3, result.stderr
        assert f"{bad}: corrupt bz2 data" in result.stderr and f"block at byte {offsets[3]}" in result.stderr
        assert "lost 7 pages" in result.stderr and "Traceback" not in result.stderr
    ray = objects(outs["ray"])
    assert ray == objects(outs["serial"])
    (source,) = json.loads(ray["/sentences/manifest.json"])["sources"]
    assert (source["status"], source["byte_offset"], source["pages_lost"], source["pages_read"]) == \
           ("corrupt", offsets[3], 7, 53)


def test_several_languages_in_one_ray_run(english, bucket, ray_env, tmp_path):
    """English, Chinese, Japanese and Arabic multistream dumps in one run: one stream pair per language,
    each as the one-process run writes it."""
    en_dump, en_index, _ = english
    dumps, indexes = [en_dump], [en_index]
    for lang in ("zh", "ja", "ar"):
        dump, index = upload_multistream(DUMPS[LANGS[lang]], f"{lang}wiki-20261101",
                                         bucket, tmp_path / lang, 2)
        dumps.append(dump)
        indexes.append(index)
    serial = run_cli("--input", *dumps, "--out", f"{bucket}/serial-all")
    assert serial.returncode == 0, serial.stderr
    ray = run_cli("--input", *dumps, "--index", *indexes, "--out", f"{bucket}/ray-all", "--ray", env=ray_env)
    assert ray.returncode == 0, ray.stderr
    written = objects(f"{bucket}/ray-all")
    assert written == objects(f"{bucket}/serial-all")
    assert {name.split("/")[1] for name in written} == {"ar", "en", "ja", "zh"}
    for lang in ("ar", "en", "ja", "zh"):
        manifest = json.loads(written[f"/{lang}/sentences/manifest.json"])
        assert manifest["languages"] == [lang] and manifest["samples"] > 0


def test_dumps_without_index_are_read_at_once(bucket, ray_env, tmp_path):
    """Four languages without an index (English: the whole bundled sample, six batches; one of them cut short):
    each dump is read by a streaming task of its own, the four started together (Ray's task records), and the
    output, the truncation report included, is the one-process run's."""
    from ray.util.state import list_tasks

    dumps = [f"{bucket}/plain/enwiki-20261101-pages-articles.xml.bz2"]
    storage.upload_file(str(SAMPLE), dumps[0])
    for lang in ("zh", "ja", "ar"):
        xml = DUMPS[LANGS[lang]]
        if lang == "ja":  # the XML breaks off after its first page
            xml = xml[:xml.index(b"</page>") + 20]
        dumps.append(f"{bucket}/plain/{LANGS[lang]}")
        (tmp_path / lang).write_bytes(bz2.compress(xml))
        storage.upload_file(str(tmp_path / lang), dumps[-1])
    serial = run_cli("--input", *dumps, "--out", f"{bucket}/plain-serial")
    started = time.time() * 1000
    ray = run_cli("--input", *dumps, "--out", f"{bucket}/plain-ray", "--ray", env=ray_env)
    assert serial.returncode == ray.returncode == 3, (serial.stderr, ray.stderr)
    written = objects(f"{bucket}/plain-ray")
    assert written == objects(f"{bucket}/plain-serial")
    (source,) = json.loads(written["/ja/sentences/manifest.json"])["sources"]
    assert (source["status"], source["pages_read"]) == ("truncated", 1)

    readers = [task for task in list_tasks(address=ray_env["RAY_API_SERVER_ADDRESS"], detail=True, limit=10_000,
                                           filters=[("func_or_class_name", "=", "_stream_task")])
               if task.creation_time_ms >= started]
    assert len(readers) == 4
    # At once: every reader was started before any of them ended (one after another, each would start
    # only once the previous language is written).
    assert max(task.creation_time_ms for task in readers) < min(task.end_time_ms for task in readers)


def test_pairs_ray_equals_two_worker_processes(ray_env, tmp_path):
    """data_prep pairs --ray: a streaming task per input cuts it into parts (a JSONL file of ~3 MB into 1 MiB
    parts, a Parquet file into its row groups, read by the actors that parse them), dealt to an actor per CPU
    of the cluster, each writing its own shards; the shards and manifests are those of a run with as many worker
    processes (2), byte for byte."""
    big_input(tmp_path / "big.jsonl", rows=30_000)
    write_parquet(tmp_path / "table.parquet", FORMATS["parquet"][2])
    outs = {}
    for how in (("--workers", "2"), ("--ray",)):
        outs[how] = tmp_path / f"out{len(how)}"
        result = subprocess.run([sys.executable, "-m", "data_prep", "pairs", "--input", tmp_path / "big.jsonl",
                                 tmp_path / "table.parquet", "--out", outs[how], "--shuffle-window-mb", "0.05",
                                 "--block-records", "64", "--shard-size-mb", "0.5", *how],
                                cwd=Path(__file__).parents[1], env={**os.environ, **(ray_env if "--ray" in how else {})},
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert f"data_prep pairs: 2 tasks at a time on the Ray cluster at {ray_env['RAY_ADDRESS']}" in result.stderr
    assert stream_files(outs[("--workers", "2")]) == stream_files(outs[("--ray",)])


def test_pairs_ray_a_killed_actor_stops_the_run_in_one_line(ray_env, tmp_path):
    """kill -9 of the actor building a shard (its pid ends the staged file's name): the run stops within seconds
    with one line naming the actor (exit 1), no traceback, no manifest."""
    big_jsonl(tmp_path / "big.jsonl", 15)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "data_prep", "pairs", "--ray", "--input", tmp_path / "big.jsonl",
                             "--out", out, "--shard-size-mb", "1", "--shuffle-window-mb", "0"],
                            cwd=Path(__file__).parents[1], env={**os.environ, **ray_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        staged = wait_for(lambda: sorted((out / "pairs" / "big").glob("*.tmp-*")))
        actor = int(staged[0].name.rpartition("-")[2])
        os.kill(actor, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert re.search(rf"^data_prep pairs: error: worker [12] of 2 \(a Ray actor, pid {actor} on 127\.0\.0\.1\) "
                     r"died: its process was killed \(kill -9, or the OOM killer", err, re.M), err
    assert "Traceback" not in err, err
    assert list(out.rglob("manifest.json")) == []
