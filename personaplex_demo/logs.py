"""Logging for every process of the app (the main one and, via procs/launcher.py, each child): one
format, and no secret (a Hub token, the TURN key) in any line. Standard library only."""

from __future__ import annotations

import logging
import os
import re

SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "CLOUDFLARE_TURN_KEY_API_TOKEN")
# Hugging Face user tokens and bearer headers, in case one reaches a message some other way.
_SECRET_PATTERNS = (
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
)
_MIN_SECRET_LEN = 4  # shorter values are not real credentials; masking them would garble logs


def configure_logging(level: int = logging.INFO, prefix: str = "", fmt: str | None = None) -> None:
    """`logging.basicConfig` (a no-op where handlers exist) with the app's format (`prefix`: a child
    process's name), or `fmt`, then a `SecretFilter` on each of the root logger's handlers."""
    process = f"{prefix} " if prefix else ""
    logging.basicConfig(level=level, format=fmt or f"%(asctime)s %(levelname)s {process}%(name)s: %(message)s")
    install_secret_filter()


def redact_secrets(text: str) -> str:
    """`text` with the values of the secret environment variables (and anything shaped like a
    Hugging Face token or a bearer credential) replaced by `***`."""
    for var in SECRET_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if len(value) >= _MIN_SECRET_LEN:
            text = text.replace(value, "***")
    text = _SECRET_PATTERNS[0].sub("***", text)
    return _SECRET_PATTERNS[1].sub(r"\1***", text)


class SecretFilter(logging.Filter):
    """Redacts secrets from a record's message, exception text and stack before any handler
    formats it. Attach it to handlers (`install_secret_filter`): logger-level filters do not see
    records that propagate from child loggers."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_secrets(message)
        if redacted != message or record.args:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_secrets(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_secrets(record.stack_info)
        return True


def install_secret_filter(logger_: logging.Logger | None = None) -> None:
    """Add one `SecretFilter` to every handler of `logger_` (default: the root logger)."""
    target = logger_ or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, SecretFilter) for f in handler.filters):
            handler.addFilter(SecretFilter())
