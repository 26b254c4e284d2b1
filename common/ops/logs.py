"""Structured logs: one line per event, as JSON or as `key=value` text.

    from common.ops.logs import event
    event(log, "session_opened", session=sid, prompt_tokens=12)

gives, with `--log-format json`,

    {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "logger": "specexec.node", "role": "target",
     "event": "session_opened", "session": "9f2c...", "prompt_tokens": 12}

and with `--log-format text` (the default)

    2025-01-01T12:00:00.123Z INFO specexec.node [target] session_opened session=9f2c... prompt_tokens=12

Session ids are always logged; prompt and completion text only with `--log-prompts` (gateway), and
token ids never.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")

# Set by `configure`: whether the gateway may put prompt and completion text in its logs.
LOG_PROMPTS = False


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event: `name` is the message, `fields` become separate keys (JSON) or key=value pairs."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"event_fields": fields})


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, str | int | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if self.role:
            out["role"] = self.role
        fields = getattr(record, "event_fields", None)
        if fields is not None:
            out["event"] = record.getMessage()
            for key, value in fields.items():
                out.setdefault(key, _plain(value))
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        head = f"{_timestamp(record)} {record.levelname} {record.name}"
        if self.role:
            head += f" [{self.role}]"
        line = f"{head} {record.getMessage()}"
        fields = getattr(record, "event_fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(value: Any) -> str:
    value = _plain(value)
    if isinstance(value, str) and value and not any(c.isspace() or c in '"=' for c in value):
        return value
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class LogSettings:
    fmt: str = "text"
    level: str = "info"
    log_prompts: bool = False
    startup: dict[str, Any] = field(default_factory=dict)  # the effective configuration, logged once


def configure(settings: LogSettings, role: str) -> None:
    """Route every logger to stderr in the chosen format, then log the effective configuration."""
    global LOG_PROMPTS
    if settings.fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {settings.fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if settings.fmt == "json" else TextFormatter(role))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    LOG_PROMPTS = settings.log_prompts
    event(logging.getLogger("specexec.config"), "config", **settings.startup)
