"""Per-rank logging: every line says which rank wrote it; non-main ranks are quieter by default."""

from __future__ import annotations

import logging
import sys

from nanotron.parallel.context import ParallelContext

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


def setup_logging(parallel_context: ParallelContext | None, level: str = "info", replica_level: str = "info") -> None:
    """Configure the ``nanotron`` logger. Rank 0 logs at ``level``; every other rank at ``replica_level``."""
    is_main = parallel_context is None or parallel_context.rank == 0
    where = "" if parallel_context is None else f"|{parallel_context.describe()}"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [%(levelname)s{where}] %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger("nanotron")
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level if is_main else replica_level])
    root.propagate = False
