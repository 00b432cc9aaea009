"""TensorBoard for long runs: event files synced to the run's storage, and served from there.

``python -m clsys.tensorboard RUN_URL [--port 6006] [--host 127.0.0.1] [--refresh 30] [--cache DIR]``

Rank 0 writes its event files to a local folder (TensorBoard's writer appends to files; object
stores have no append). For a run on object storage, ``EventSync`` copies the files that grew to
``<run>/tensorboard/`` every ``train.tensorboard_sync_s`` seconds from a background thread, at every
checkpoint (so the curves cover what a resumed run starts from) and once more at the end.

The command pulls ``<run>/tensorboard/`` (or, given a run root, every ``<root>/<name>/tensorboard/``,
one TensorBoard run per name) into a local cache, serves it on 127.0.0.1, and pulls what changed
every ``--refresh`` seconds; TensorBoard itself reloads the cache every few seconds. A local run
folder is served in place.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

from clsys import logs, storage
from clsys.metrics.event_sync import LOG_FOLDER

log = logs.module_logger(__name__, __spec__)

def _log_objects(url: str) -> dict[str, tuple[str, int]]:
    """Event objects to serve: local relative path -> (object URL, size).

    A run URL maps ``<run>/tensorboard/F`` to ``F``; a run root maps ``<root>/<name>/tensorboard/F``
    to ``<name>/F`` so that TensorBoard shows one run per name.
    """
    objects = {}
    for prefix in (storage.join(url, LOG_FOLDER), url):
        base = storage.parse(prefix).path.rstrip("/")
        for obj, size in storage.list_sizes(prefix):
            parts = storage.parse(obj).path[len(base):].lstrip("/").split("/")
            if prefix == url:  # a run root: keep only <name>/tensorboard/...
                if len(parts) < 3 or parts[1] != LOG_FOLDER:
                    continue
                parts = [parts[0], *parts[2:]]
            objects["/".join(parts)] = (obj, size)
        if objects:
            break
    return objects


def pull(url: str, cache: str, pulled: dict[str, int]) -> int:
    """Download the event files that are new or grew since the last pull; returns how many."""
    count = 0
    for rel, (obj, size) in _log_objects(url).items():
        if pulled.get(rel) == size:
            continue
        local = os.path.join(cache, rel)
        storage.download_file(obj, f"{local}.part")
        have = os.path.getsize(local) if os.path.exists(local) else 0
        if 0 < have < size:
            # Event files only grow, and TensorBoard keeps reading an open file from where it
            # stopped: append the new tail to that same file (a replaced file would go unnoticed).
            with open(f"{local}.part", "rb") as new, open(local, "ab") as old:
                new.seek(have)
                shutil.copyfileobj(new, old)
            os.remove(f"{local}.part")
        else:
            os.replace(f"{local}.part", local)
        pulled[rel] = size
        count += 1
    return count


def serve(logdir: str, host: str, port: int) -> str:
    from tensorboard import program

    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", logdir, "--host", host, "--port", str(port), "--reload_interval", "5"])
    return board.launch()  # serves from a background thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.tensorboard", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run (or a run root) as a local folder, file:// or s3:// URL")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--refresh", type=float, default=30.0, help="seconds between pulls from object storage")
    parser.add_argument("--cache", default=None, help="local folder for pulled event files (default: a temp folder)")
    logs.add_level_option(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level)

    run = args.run if "://" in args.run else os.path.abspath(args.run)
    try:
        if storage.is_local(run):
            local_run = storage.parse(run).path
            logdir = os.path.join(local_run, LOG_FOLDER)
            logdir = logdir if os.path.isdir(logdir) else local_run
            url = serve(logdir, args.host, args.port)
            log.info(f"[clsys] TensorBoard for {run} at {url}")
            threading.Event().wait()
        cache = args.cache or tempfile.mkdtemp(prefix="clsys-tensorboard-")
        pulled: dict[str, int] = {}
        count = pull(run, cache, pulled)
        if not pulled:
            print(storage.redact(f"error: no TensorBoard event files under {run} (looked in {LOG_FOLDER}/ and "
                                 f"*/{LOG_FOLDER}/)"), file=sys.stderr)
            return 2
        url = serve(cache, args.host, args.port)
        log.info(storage.redact(f"[clsys] TensorBoard for {run} at {url} ({count} files pulled into {cache}, "
                                f"refreshed every {args.refresh:g} s)"))
        while True:
            time.sleep(args.refresh)
            try:
                pull(run, cache, pulled)
            except storage.StorageError as err:
                log.warning(storage.redact(f"[clsys] pull from {run} failed, retrying: {err}"))
    except storage.StorageError as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
