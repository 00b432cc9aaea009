"""Secrets a storage URL can carry (a token as its user name, a password, a signed query string) never
reach a console line, an error message or a file written for others to read, from the attacker's side:
the text clsys prints, in-process and from its command lines, and the files it writes of a config are
searched for each secret. The URLs point at real servers on 127.0.0.1 (an HTTP server that refuses
everything, conftest's FTP server with a token as the user name). A whole run reading its shards with a
token, and an export reading its checkpoint with one, are searched file by file in tests/test_pretrain.py
and tests/test_export_out.py."""
from __future__ import annotations

import bz2
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port, ftp_server
from test_data_prep import SAMPLE, small_dump

from clsys import storage

ROOT = Path(__file__).resolve().parents[1]
SECRETS = ("T0KEN-as-user", "w0rd-after-slash", "CREDENTIAL-1234", "SESSION-TOKEN-1234", "SIGNATURE-1234",
           "SAS-SIG-1234", "BEARER-1234", "FRAGMENT-1234")


def secret_urls(host: str) -> list[str]:
    """One object, as URLs that carry each kind of secret: a token as the user name, a presigned S3 URL,
    an Azure SAS, a token parameter, a token in the fragment."""
    path = f"{host}/dumps/enwiki-latest-pages-articles.xml.bz2"
    return [f"http://T0KEN-as-user@{path}",
            f"http://{path}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=CREDENTIAL-1234%2F20240101"
            f"&X-Amz-Security-Token=SESSION-TOKEN-1234&X-Amz-SignedHeaders=host&X-Amz-Signature=SIGNATURE-1234",
            f"http://{path}?sv=2022-11-02&sp=r&sig=SAS-SIG-1234",
            f"http://{path}?token=BEARER-1234#access_token=FRAGMENT-1234"]


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} printed in:\n{text}"


@pytest.fixture(scope="module")
def refusing_http() -> str:
    """host:port of an HTTP server on 127.0.0.1 that answers every request 403 (a presigned URL expired)."""
    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _refuse(self):
            body = b"<Error><Code>AccessDenied</Code></Error>"
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _refuse

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("url", [
    "ftp://alice:Pz9-w0rd-after-slash@127.0.0.1:21/data",
    "ftp://alice:Pz9/w0rd-after-slash@127.0.0.1:21/data",  # '/', '?', '#', '@' in a password typed unencoded
    "ftp://alice:Pz9?w0rd-after-slash@127.0.0.1:21/data",
    "sftp://alice:Pz9#w0rd-after-slash@127.0.0.1:21/data",
    "ftp://alice:Pz9@ss/w0rd-after-slash@127.0.0.1:21/data",
    "s3://alice:Pz9/w0rd-after-slash@bucket/data",
])
def test_a_password_is_refused_wherever_it_hides(url):
    with pytest.raises(storage.StorageError, match="a password in a storage URL") as err:
        storage.parse(url)
    assert "@127.0.0.1:21/data: " in str(err.value) or "@bucket/data: " in str(err.value)
    assert_no_secret(str(err.value))
    assert "Pz9" not in str(err.value) and "alice" not in str(err.value)


def test_an_s3_url_holds_no_credentials():
    """s3:// credentials come only from the AWS chain: a user name there is refused, not sent to boto3
    (whose own error would print it as part of a bucket name)."""
    with pytest.raises(storage.StorageError, match="s3:// URLs carry no credentials") as err:
        storage.parse("s3://T0KEN-as-user@bucket/data")
    assert_no_secret(str(err.value))


def test_what_is_printed_of_a_url():
    """Userinfo goes whole (a user name alone is often a token); query values and fragments go (signed
    URLs differ by provider); what locates the object stays. s3:// keys and local paths keep every
    character: '?', '#', ':' and '@' are part of their names."""
    assert storage.redact("ftp://alice@127.0.0.1:2121/data/x: no such object") == \
        "ftp://***@127.0.0.1:2121/data/x: no such object"
    dump = "http://h:1/dumps/enwiki-latest-pages-articles.xml.bz2"
    shown = storage.redact(f"error: {secret_urls('h:1')[1]}: AccessDenied")
    assert shown == (f"error: {dump}?X-Amz-Algorithm=***&X-Amz-Credential=***&X-Amz-Security-Token=***"
                     f"&X-Amz-SignedHeaders=***&X-Amz-Signature=***: AccessDenied")
    assert storage.redact(secret_urls("h:1")[3]) == f"{dump}?token=***#***"
    assert storage.redact("url='http://T0KEN-as-user@h/x'") == "url='http://***@h/x'"
    assert storage.redact(storage.redact(shown)) == shown
    for kept in ("s3://bucket/run/a?b#c:d@e", "file:///tmp/a?b#c:d@e", "/tmp/a?b", "gs://bucket/a:b@c",
                 "hf://datasets/org/name@main/x"):
        assert storage.redact(f"{kept}: no such object") == f"{kept}: no such object"


@pytest.mark.timeout(30)
def test_a_url_after_a_long_run_of_word_characters_is_found_and_redacted():
    """A hostile name of a million word characters before a URL: the scheme is the run from its first ASCII letter
    (as a plain pattern finds it), and the text is scanned once (a plain pattern tried the run from each of its
    letters: 20,000 characters took 3 s, a million did not finish; the timeout is that hang's guard)."""
    for run in ("a" * 1_000_000, "é" * 1_000_000, "_1" * 500_000):
        assert storage.redact(f"{run}ftp://T0KEN-as-user@h/x?sig=S3CRET") == f"{run}ftp://***@h/x?sig=***"
        assert storage.redact(run) == run
    assert storage.redact("_ftp://T0KEN@h/x éhttp://T0KEN@h/y") == "_ftp://***@h/x éhttp://***@h/y"


@pytest.mark.parametrize("which", range(4))
def test_storage_errors_name_the_url_without_its_secrets(refusing_http, which, tmp_path):
    url = secret_urls(refusing_http)[which]
    ops = {"read_bytes": storage.read_bytes, "size": storage.size, "open_read": storage.open_read,
           "download_file": lambda u: storage.download_file(u, str(tmp_path / "x")),
           "list_sizes": lambda u: list(storage.list_sizes(u)), "write_bytes": lambda u: storage.write_bytes(u, b"x")}
    for name, op in ops.items():
        with pytest.raises(storage.StorageError) as err:
            op(url)
        assert str(err.value).startswith("http"), (name, str(err.value))
        assert_no_secret(str(err.value))


@pytest.fixture
def ftp_token(tmp_path, monkeypatch) -> str:
    """An FTP server whose user name is a token, its password given through fsspec's configuration (as
    docs/operations/storage.md says; commands started from here inherit it); yields its URL, with the token."""
    folder = tmp_path / "ftp"
    folder.mkdir()
    monkeypatch.setenv("FSSPEC_FTP_PASSWORD", "ftp-Pz9")
    with ftp_server(folder, "T0KEN-as-user", "ftp-Pz9") as url:
        yield url.replace("ftp://", "ftp://T0KEN-as-user@")


def console(*args: str, fails: bool) -> str:
    """The console of a clsys command (stdout and stderr together), which must fail or succeed as said."""
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (result.returncode != 0) == fails, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_command_lines_never_print_a_url_secret(refusing_http, ftp_token, tmp_path):
    """Each command line given each kind of secret URL where it takes one: the dumps data_prep reads
    (refused by the server), the folder it writes a stream to (twice: the second run skips unchanged
    shards, naming them), the shards and the checkpoint a training run starts from, the run TensorBoard
    pulls."""
    for url in secret_urls(refusing_http):
        assert_no_secret(console("-m", "data_prep", "wiki", "--input", url, "--out", str(tmp_path / "out"), fails=True))
    dump = tmp_path / "small.xml.bz2"
    dump.write_bytes(bz2.compress(small_dump(bz2.decompress(SAMPLE.read_bytes()), 0, 5)))
    for _ in range(2):
        shown = console("-m", "data_prep", "wiki", "--input", str(dump), "--out", f"{ftp_token}/wiki", fails=False)
        assert_no_secret(shown)
    assert "upload skipped" in shown and "ftp://***@127.0.0.1:" in shown
    runs = f"train.run_root={tmp_path / 'runs'}"
    assert_no_secret(console("-m", "clsys.pretrain", f"data.url={secret_urls(refusing_http)[1]}", runs, fails=True))
    shown = console("-m", "clsys.pretrain", "--resume", f"{ftp_token}/runs/r/checkpoints/step-1", runs, fails=True)
    assert "is not a complete checkpoint" in shown
    assert_no_secret(shown)
    shown = console("-m", "clsys.tensorboard", f"{ftp_token}/wiki", "--port", str(free_port()), fails=True)
    assert "no TensorBoard event files" in shown
    assert_no_secret(shown)


def test_a_failed_workers_error_is_printed_without_its_urls_secrets(refusing_http, capsys):
    """FailureReport prints the first line of each failed rank's error, which a library wrote with the URL
    whole (fsspec's FileNotFoundError, from the server that refuses everything), handed over as Ray Train
    does: a UserExceptionWithTraceback holding the exception and its traceback's text."""
    import fsspec
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from clsys.engine.failures import FailureReport

    failures = {}
    for rank, url in enumerate(secret_urls(refusing_http)):
        try:
            fsspec.open(url).open()
        except FileNotFoundError as err:
            failures[rank] = UserExceptionWithTraceback(err, traceback.format_exc())
    FailureReport().after_exception(None, failures)
    printed = capsys.readouterr().err  # an error record: stderr
    assert printed.count("failed: FileNotFoundError: ") == 4 and f"http://***@{refusing_http}/dumps/" in printed
    assert_no_secret(printed)


def test_the_files_written_of_a_config_hold_no_url_secret(refusing_http, tmp_path):
    """What clsys writes of a run's config for others to read, from a config whose URLs carry each kind of
    secret (the shards, the checkpoint resumed, the run root, an export's checkpoint): <run>/config.yaml,
    TensorBoard's Text and HParams panels, and the model card. Each file still names the URLs, redacted."""
    from clsys.engine.launch import save_config
    from clsys.metrics.health import TensorBoard
    from clsys.model.card import write_card
    from clsys.recipes import load_config

    urls = secret_urls(refusing_http)
    cfg = load_config(None, [f"data.url={urls[0]}", f"train.resume={urls[1]}", f"train.run_root={urls[2]}"])
    save_config(cfg, str(tmp_path / "run"))
    board = TensorBoard(str(tmp_path / "tensorboard"))
    board.config(cfg, "stsb-en-dev_spearman")
    board.close()
    (tmp_path / "export").mkdir()
    write_card(str(tmp_path / "export"), {"checkpoint": urls[3], "chosen": "the given step folder", "step": 4,
                                          "objective": "simcse", "pooling": "cls", "pooler": "trained"}, cfg.to_dict())
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 3, files  # config.yaml, one event file, README.md
    for path in files:
        written = path.read_bytes().decode("latin-1")
        assert_no_secret(written)
        assert f"http://***@{refusing_http}/dumps/" in written and "X-Amz-Signature=***" in written, path
    assert "?token=***#***" in (tmp_path / "export" / "README.md").read_text()
