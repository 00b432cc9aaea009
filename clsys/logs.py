"""The one logging configuration of clsys's commands and of the processes they start (Ray workers).

Every module logs to ``logging.getLogger(__name__)``, a command's module to ``module_logger(__name__, __spec__)``:
records form the ``clsys`` hierarchy (``clsys.engine.loop``, ``clsys.storage.lease``, …) and the ``data_prep`` one.
``configure`` gives both roots their level (a command's ``--log-level``, else ``CLSYS_LOG_LEVEL``, else INFO) and
one console handler. A message carries its own prefix ("[clsys] ", "data_prep pairs: "): the lines read as they
always have. Records below WARNING go to the command's progress stream: stdout for the trainer (Ray forwards a
worker's stdout with its "(RayTrainWorker pid=…)" prefix), stderr where stdout is the command's result (evaluation
tables, data_prep's summaries); warnings and errors go to stderr. The driver hands its level to Ray workers in their
environment (``clsys.engine.launch``), and each worker configures itself with this same function.
"""
from __future__ import annotations

import logging
import os
import sys
from importlib.machinery import ModuleSpec

LEVEL_ENV = "CLSYS_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROOTS = ("clsys", "data_prep")


class ConsoleHandler(logging.Handler):
    """Writes a record to ``sys.stdout`` or ``sys.stderr`` as they are when it comes, not when the handler was made:
    Ray's workers and pytest replace them."""

    def __init__(self, progress_stream: str) -> None:
        super().__init__()
        self.progress_stream = progress_stream
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else getattr(sys, self.progress_stream)
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def module_logger(name: str, spec: ModuleSpec | None) -> logging.Logger:
    """The logger of the module whose ``__name__`` and ``__spec__`` these are, for a module that also runs as a
    command: run as ``python -m clsys.pretrain`` its ``__name__`` is ``__main__``, outside the hierarchy that
    ``configure`` gives a level and a handler, while its ``__spec__`` still names it. Without a spec (a module
    run by its file's path), ``__name__``."""
    return logging.getLogger(spec.name if spec is not None else name)


def resolve_level(option: str | None = None) -> str:
    """The level to use: ``option`` (a command's --log-level), else ``CLSYS_LOG_LEVEL``, else INFO."""
    level = (option or os.environ.get(LEVEL_ENV) or "INFO").upper()
    if level not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={level}: one of {', '.join(LEVELS)}")
    return level


def configure(level: str | None = None, progress_stream: str = "stdout") -> str:
    """Set the ``clsys`` and ``data_prep`` loggers' level (``resolve_level(level)``) and their one console handler,
    whose records below WARNING go to ``progress_stream`` ("stdout" or "stderr"). Calling it again replaces
    both, so a process configured twice (a driver that also runs a worker function) writes each line once.
    The records do not reach the root logger: in a Ray Train worker it holds a console handler of Ray's, which
    would print every warning a second time. Returns the level."""
    level = resolve_level(level)
    for name in ROOTS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
            logger.removeHandler(handler)
        logger.addHandler(ConsoleHandler(progress_stream))
        logger.setLevel(level)
        logger.propagate = False
    return level


def add_level_option(parser) -> None:
    """The ``--log-level`` option every entry point has (``argparse`` parser)."""
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS, default=None,
                        help=f"DEBUG adds the loader's and the engine's decisions (default: ${LEVEL_ENV}, else INFO)")
