"""Structured logs shared by every process: one JSON object per line on stderr.

Invariant: every line parses as JSON with at least `ts`, `level`, `logger` and `msg`
(exceptions add `exc`), whatever the message contains.
"""

from __future__ import annotations

import json
import logging
import os
import sys


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str | None = None) -> None:
    """JSON lines on stderr at `level` (default: $PRIME_LOG_LEVEL, else INFO)."""
    level = level or os.environ.get("PRIME_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
