"""Secrets taken out of a config before it leaves the process: the copy sent to trackers (W&B, MLflow) and
the ``config.yaml`` a run keeps as its record.

Two kinds of value are replaced by :data:`REDACTED`:
- values under a key named like a secret (``password``, ``api_key``, ``hf_token``, ``secret``, ...), at any
  depth: reward functions' free-form ``kwargs`` is where a judge's API key lands;
- the credentials inside a URI (``https://user:pass@host``, ``...?token=...``): the rest of the URI stays,
  so a record still says which server a run logged to.
A key is secret-like when its last ``_``/``-`` separated words name a secret; ``max_new_tokens`` or
``pad_token_id`` are not (see :data:`SECRET_KEY`).
"""
from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
SECRET_KEY = re.compile(r"(?:^|[_\-.])(?:password|passwd|pwd|passphrase|secret|secret_key|token|api_key|apikey|"
                        r"access_key|private_key|credentials?|auth|authorization|bearer)$", re.IGNORECASE)
_URI_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^/@:\s]*):(?P<secret>[^/@\s]+)@")
_URI_QUERY_SECRET = re.compile(r"(?P<key>[?&;](?:[\w\-]*?)(?:password|passwd|pwd|secret|token|api_?key|"
                               r"access_?key|sig|signature|auth)=)(?P<secret>[^&;#\s]+)", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(str(key)))


def redact_text(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` and secret query values redacted."""
    text = _URI_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    return _URI_QUERY_SECRET.sub(lambda m: f"{m['key']}{REDACTED}", text)


def redact(value: Any, key: str = "") -> Any:
    """A copy of the plain-data ``value`` (dicts, lists, scalars: :func:`megarlhf.config.to_dict`'s form)
    with secrets redacted; ``key`` is the name ``value`` is held under."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    if is_secret_key(key) and value not in (None, ""):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    return value
