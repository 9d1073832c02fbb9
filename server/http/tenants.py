"""Who a request is: API keys, tenants, and the cache scope a request may see.

Owns: `KeyTable` (the keys from `--api-key`, `SEGSERVE_API_KEY` and `--api-key-file`, each
mapped to a tenant; a request presents its key as `Authorization: Bearer KEY` or, as
Anthropic's clients do, `x-api-key: KEY`, on any route), `bank_salt` (the session bank's salt for a tenant + `X-Cache-Salt`),
`check_cache_salt`, and `safe_header_value` (what may be echoed into a response header).

The model (README "Tenants"): a tenant is one API key's tenant name together with one
`X-Cache-Salt` value. A key line `TENANT KEY` gives that key a tenant of its own; a bare
`KEY` (and `--api-key`) belongs to the default tenant "". Everything the bank stores or
reports per request (reused rows, sessions, SSD block ids) is scoped by `bank_salt`, so a
tenant cannot reuse, list, inspect, fork or delete another tenant's entries, and the
bytes its own requests add do not depend on what others stored. Clients that share a key
(or bare keys) and a salt are one tenant and see each other's sessions.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_SAFE_HEADER = re.compile(r"^[\x21-\x7e]{1,256}$")
MAX_SALT_CHARS = 256


class KeyFileError(ValueError):
    """The API key file is missing or malformed; the message never contains a key."""


@dataclass(frozen=True, slots=True)
class KeyTable:
    entries: tuple[tuple[bytes, str], ...] = ()  # (key, tenant)

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def tenant_for(self, presented: bytes) -> str | None:
        """The presented key's tenant, or None. Every key is compared (constant time)."""
        found: str | None = None
        for key, tenant in self.entries:
            if hmac.compare_digest(presented, key) and found is None:
                found = tenant
        return found


def load_keys(api_key: str | None, key_file: str | None) -> KeyTable:
    entries: list[tuple[bytes, str]] = []
    if api_key:
        entries.append((api_key.encode(), ""))
    if key_file:
        path = Path(key_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
        for no, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise KeyFileError(f"{path} line {no}: expected 'KEY' or 'TENANT KEY'")
            tenant, key = ("", fields[0]) if len(fields) == 1 else (fields[0], fields[1])
            if tenant and not _TENANT.match(tenant):
                raise KeyFileError(f"{path} line {no}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
            if not key.isascii() or not key.isprintable():
                raise KeyFileError(f"{path} line {no}: a key is printable ASCII")
            entries.append((key.encode(), tenant))
        if not entries:
            raise KeyFileError(f"{path} holds no key")
    return KeyTable(tuple(entries))


def check_cache_salt(raw: str | None) -> str | None:
    """The `X-Cache-Salt` header value (None or "" = no salt), or ValueError."""
    if not raw:
        return None
    if len(raw) > MAX_SALT_CHARS:
        raise ValueError(f"X-Cache-Salt must be at most {MAX_SALT_CHARS} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in raw):
        raise ValueError("X-Cache-Salt must not hold control characters")
    return raw


def bank_salt(tenant: str, salt: str | None) -> str | None:
    """The bank's salt for a request: the default tenant keeps the plain salt (so stored
    sessions of a single-key server stay where they were); a named tenant's salt starts
    with a newline, which no header value can hold, so it never equals a plain salt."""
    if not tenant:
        return salt
    return f"\ntenant={tenant}\n{salt or ''}"


def safe_header_value(value: str | None) -> str | None:
    """`value` if it can be echoed into a header as is (visible ASCII, no spaces,
    1-256 characters), else None: a client-chosen id is never written raw into a header."""
    if value is None or not _SAFE_HEADER.match(value):
        return None
    return value


def log_safe(value: object, limit: int = 128) -> str:
    """One access-log field: control characters, spaces, backslashes and non-ASCII
    escaped, so a client-chosen value (user, session id) cannot forge or split log lines."""
    text = str(value)
    out = text[:limit].encode("unicode_escape").decode("ascii").replace(" ", "\\x20")
    return out + ("..." if len(text) > limit else "")
