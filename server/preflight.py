"""Checks that run before the model loads, each failing with one line that names the flag
or variable the value came from.

Owns: `preflight(settings, label)` → `Preflight` (the bound listening socket, the API key
table, the connection cap) or `PreflightError`. Sizes and types were already checked by
`segserve.config.settings.load_settings`; here: what needs the machine: a percent budget against
device memory, the model path, `--chat-template` and `--tool-parser`, the API key file, a
bind beyond loopback without a key (refused unless `--allow-unauthenticated`), the
KV-event endpoint (beyond loopback only when allowed), the bank directory (creatable, not
locked by another server) and the port (bound now and handed to uvicorn, so "address in
use" is known in a second, not after the model loaded).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from segserve.config.settings import Settings
from segserve.server.http.tenants import KeyFileError, KeyTable, load_keys

# A hub id ("org/name" or a bare legacy "name"); anything else must exist on disk.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class PreflightError(ValueError):
    """One line: '<flag or variable>: <what is wrong>'."""


@dataclass(frozen=True, slots=True)
class Preflight:
    sock: socket.socket
    keys: KeyTable


def preflight(settings: Settings, label: Callable[[str], str]) -> Preflight:
    _check_budget(settings, label)
    _check_model(settings.model, label("model"))
    _check_chat(settings, label)
    try:
        keys = load_keys(settings.api_key, settings.api_key_file)
    except KeyFileError as exc:
        raise PreflightError(f"{label('api_key_file')}: {exc}") from None
    _check_exposure(settings, keys, label)
    _check_kv_events(settings, keys, label("kv_events_endpoint"))
    _check_bank_dir(settings, label("bank_dir"))
    sock = bind(settings.host, settings.port, label)
    return Preflight(sock, keys)


def _check_budget(settings: Settings, label: Callable[[str], str]) -> None:
    raw = settings.memory_budget
    if raw is None or not raw.strip().endswith("%"):
        return  # plain sizes were checked with the settings
    from segserve.config.sizes import parse_memory_budget
    from segserve.server.runner import device_memory

    key = label("memory_budget")
    try:
        parse_memory_budget(raw, device_total_bytes=device_memory().total_bytes, what=key)
    except ValueError as exc:
        raise PreflightError(f"{key}: {exc}") from None


def _check_model(model: str | None, key: str) -> None:
    if model is None:
        return
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise PreflightError(f"{key}: {model} is a directory without config.json")
        if path.is_file() and not os.access(path, os.R_OK):
            raise PreflightError(f"{key}: {model} is not readable")
        return
    looks_like_path = (
        model.startswith(("/", ".", "~")) or model.endswith(".gguf") or not _HUB_ID.match(model)
    )
    if looks_like_path:
        raise PreflightError(f"{key}: no such file or directory: {model}")


def _check_chat(settings: Settings, label: Callable[[str], str]) -> None:
    """`--tool-parser` names a known family; `--chat-template` reads and compiles."""
    from segserve.server.chat.template import TemplateLoadError, load_template_file
    from segserve.server.chat.tool_calls import family_from_name

    try:
        family_from_name(settings.tool_parser)
    except ValueError as exc:
        raise PreflightError(f"{label('tool_parser')}: {exc}") from None
    if settings.chat_template is not None:
        try:
            load_template_file(Path(settings.chat_template).expanduser())
        except TemplateLoadError as exc:
            raise PreflightError(f"{label('chat_template')}: {exc}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _check_exposure(settings: Settings, keys: KeyTable, label: Callable[[str], str]) -> None:
    """A server reachable beyond this machine needs a key unless told otherwise: a container
    image binds 0.0.0.0, and a forgotten key there is an open server, not a warning."""
    if keys.enabled or settings.allow_unauthenticated or is_loopback(settings.host):
        return
    raise PreflightError(
        f"{label('host')}: binding {settings.host} without an API key would let anyone who can "
        f"reach it use the server; set SEGSERVE_API_KEY or --api-key-file, or give "
        f"--allow-unauthenticated true (SEGSERVE_ALLOW_UNAUTHENTICATED=true) to serve without one"
    )


def _check_kv_events(settings: Settings, keys: KeyTable, key: str) -> None:
    """The KV-event endpoint is well formed, its extra installed, and its unauthenticated
    sockets stay on loopback when tenants are configured (`segserve.server.kv_events`)."""
    endpoint = settings.kv_events_endpoint
    if not endpoint:
        return
    try:
        from segserve.server.kv_events import exposure_error
    except ImportError as exc:
        raise PreflightError(
            f"{key}: needs pyzmq and msgspec (pip install 'segserve[kv-events]'): {exc}"
        ) from None
    try:
        why = exposure_error(
            endpoint, tenants=any(tenant for _, tenant in keys.entries),
            allow_remote=settings.kv_events_allow_remote, token_ids=settings.kv_events_token_ids,
        )
    except ValueError as exc:
        raise PreflightError(f"{key}: {exc}") from None
    if why is not None:
        raise PreflightError(f"{key}: {why}")


def _check_bank_dir(settings: Settings, key: str) -> None:
    root = settings.cold_tier_dir()
    if root is None:
        return
    try:
        lock = root / "lock"
        replica = settings.bank_replica()
        if replica is not None:  # a shared dir: each replica locks its own part of it
            from segserve.bank.shared import SharedLayout

            lock = SharedLayout(root, replica).lock_path
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PreflightError(f"{key}: cannot use {root}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise PreflightError(
            f"{key}: {root} is in use by another running server (give another directory, "
            "or 'none' for a RAM-only bank)"
        ) from None
    finally:
        os.close(fd)  # closing drops the lock: the bank takes it for good when it opens


def bind(host: str, port: int, label: Callable[[str], str]) -> socket.socket:
    """The listening socket, bound as uvicorn would bind it (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(f"{label('host')}: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PreflightError(
                f"{label('port')}: port {port} on {host} is already in use"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise PreflightError(f"{label('host')}: {host} is not an address of this machine") from None
        raise PreflightError(
            f"{label('port')}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    sock.set_inheritable(True)
    return sock
