"""Shim: the load test is `segserve.server.loadtest` (`segserve loadtest`, `python -m segserve.server.loadtest`).

Kept so that `python bench/loadtest.py ARGS` still works and for bench/speed.py, which
imports `LoadTestError` and `check_loopback_url` from here: the benchmarks in bench/ start
and stop servers themselves and only ever target this machine, unlike the load test.
"""

from __future__ import annotations

import ipaddress
import sys
from urllib.parse import urlsplit

from segserve.server.loadtest import LoadTestError, main

__all__ = ["LoadTestError", "check_loopback_url", "main"]


def check_loopback_url(url: str) -> str:
    """The base URL (no trailing `/` or `/v1`), or LoadTestError when it is not loopback."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise LoadTestError(f"--url {url!r}: expected http://HOST:PORT")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise LoadTestError(
                f"--url {url!r}: refusing non-loopback host {host!r}; this benchmark only "
                f"targets 127.0.0.0/8, localhost or ::1"
            )
    return url.rstrip("/").removesuffix("/v1")


if __name__ == "__main__":
    sys.exit(main())
