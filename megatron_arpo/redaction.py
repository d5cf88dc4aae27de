"""Keeping secrets out of logs, config dumps (`config show`, the wandb config) and tool error texts.

Two kinds of secret are recognised:
- values under secret-looking config keys (`*key*`, `*token*`, `*secret*`, `*password*`, ...; keys
  ending in `_env` hold the NAME of an environment variable and are kept): `redact(data)`;
- credentials inside URLs anywhere in a string (a retriever URL, a proxy, a database DSN):
  `redact_url(text)` masks the password of `scheme://user:password@host/...` (keeping the user name),
  a token used as the user name (`https://ghp_...@host`) and secret query parameters (`?api_key=`,
  `&token=`, `key=`, `sig=`, ...) with `***`.

`install_log_redaction()` adds a filter to every handler of the root logger that applies `redact_url`
to the final message, the exception text and the stack text of each record, whoever logged it.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

REDACTED = "***"
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential")
# Config keys that contain a secret word but hold no secret.
_NOT_SECRET = {"prompt_key", "tokenizer"}
# scheme://user:password@ -- the user part stops at the first ':', '/', '@' or whitespace; the password
# runs to the first '@' that a host follows (so it may hold an unencoded '@' or '/'), never past '?' or '#'.
_HOST_AHEAD = r"(?=[^\s@/]*(?:[/\s?#]|$))"
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@?#]*:)(?P<password>[^\s?#]*?)@" + _HOST_AHEAD)
# scheme://TOKEN@host -- a user name alone is masked when it looks like a token (see _looks_like_token).
_URL_USER = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s:/@?#]+)@" + _HOST_AHEAD)
# ?api_key=... / &token=... / ;sig=...: the value of a query parameter whose name holds a secret word.
_QUERY_SECRET = re.compile(r"(?P<head>[?&;][A-Za-z0-9_.\-]*?(?:key|token|secret|password|passwd|pwd|credential|auth|sig)"
                           r"[A-Za-z0-9_.\-]*=)(?P<value>[^&;#\s'\"]+)", re.IGNORECASE)


def _looks_like_token(user: str) -> bool:
    """A URL user name that is a credential (``ghp_...``, ``hf_...``, a key), not a login like ``git``:
    at least 20 characters, or at least 8 with a digit in them."""
    return len(user) >= 20 or (len(user) >= 8 and any(c.isdigit() for c in user))


def redact_url(text: str) -> str:
    """`text` with the credentials of every URL masked as `***`: the password of `scheme://user:password@host`,
    a token used as the user name (`https://TOKEN@host`), and secret query parameters (`?api_key=...`)."""
    if "://" not in text and "=" not in text:
        return text
    if "@" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{REDACTED}@", text)
        text = _URL_USER.sub(lambda m: f"{m.group('head')}{REDACTED if _looks_like_token(m.group('user')) else m.group('user')}@",
                             text)
    if "=" in text:
        text = _QUERY_SECRET.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    return text


def is_secret_key(name: str) -> bool:
    lowered = name.lower()
    if lowered in _NOT_SECRET or lowered.endswith("_env"):
        return False  # *_env holds the NAME of an environment variable, not its value
    return any(word in lowered for word in _SECRET_WORDS)


def redact(data: Any) -> Any:
    """A copy with every string under a secret-looking key masked and URL passwords removed (recursively)."""
    if isinstance(data, Mapping):
        return {k: (REDACTED if isinstance(v, str) and is_secret_key(str(k)) else redact(v)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact(v) for v in data]
    if isinstance(data, str):
        return redact_url(data)
    return data


class RedactUrlPasswords(logging.Filter):
    """Handler filter: URL passwords never reach the output, in the message or in a traceback."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler's own error reporting
            return True
        redacted = redact_url(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_url(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_url(record.stack_info)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add the URL-password filter to every handler of `logger` (default: root) that lacks it."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactUrlPasswords) for f in handler.filters):
            handler.addFilter(RedactUrlPasswords())
