"""The run's TensorBoard event files on its storage: rank 0 writes them to a local folder (TensorBoard's writer
appends to files; object stores have no append), and ``EventSync`` copies the files that grew to
``<run>/tensorboard/`` every ``train.tensorboard_sync_s`` seconds from a background thread, at every checkpoint
(so the curves cover what a resumed run starts from) and once more at the end. ``python -m clsys.tensorboard``
serves them from there.
"""
from __future__ import annotations

import logging
import os
import threading

from clsys import storage

log = logging.getLogger(__name__)

LOG_FOLDER = "tensorboard"


class EventSync:
    """Mirror a local folder to ``url``: new and grown files only, every ``every_s`` seconds and at close."""

    def __init__(self, local_dir: str, url: str, every_s: float):
        self.local_dir, self.url = local_dir, url
        self.uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last copied
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def _run(self, every_s: float) -> None:
        while not self.done.wait(every_s):
            try:
                self.sync()
            except storage.StorageError as err:  # keep training; the next round tries again
                log.warning(storage.redact(f"[clsys] TensorBoard sync to {self.url} failed, retrying later: {err}"))

    def sync(self) -> int:
        """Copy what changed since the last call; returns the number of files copied."""
        copied = 0
        with self.lock:
            for folder, _, files in os.walk(self.local_dir):
                for name in sorted(files):
                    path = os.path.join(folder, name)
                    stat = os.stat(path)
                    rel = os.path.relpath(path, self.local_dir)
                    if self.uploaded.get(rel) != (stat.st_size, stat.st_mtime_ns):
                        storage.upload_file(path, storage.join(self.url, rel))
                        self.uploaded[rel] = (stat.st_size, stat.st_mtime_ns)
                        copied += 1
        return copied

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.sync()
