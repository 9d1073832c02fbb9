"""Tenant isolation: what one tenant stores is invisible to another, SSD dedupe included.

The probe from the issue: tenant B sends a prompt and watches the SSD bytes on `/health`;
with blocks deduplicated across salts, +0 bytes meant "tenant A sent this prompt". Block
ids are now planned per scope, so B's bytes are the same whatever A stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from segserve.bank import Bank, ColdTier
from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.http.tenants import bank_salt, check_cache_salt, load_keys
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.bank_fakes import chain, checked
from tests.conftest import make_tiny_model, tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

T1 = list(range(100, 120))
T2 = list(range(200, 220))


def _cold_bank(root: Path) -> Bank:
    cold = ColdTier(root, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=8)
    return checked(Bank("ns", 1 << 30, cold=cold))


def test_bank_same_rows_under_two_salts_cost_the_same_as_new_rows(tmp_path: Path) -> None:
    b = _cold_bank(tmp_path)
    b.put("a", chain(T1), salt="tenant-a")
    d0 = b.stats().bytes_by_tier["ssd"]
    b.put("b1", chain(T1), salt="tenant-b")  # what A stored
    d1 = b.stats().bytes_by_tier["ssd"]
    b.put("b2", chain(T2), salt="tenant-b")  # what nobody stored
    d2 = b.stats().bytes_by_tier["ssd"]
    assert d1 - d0 == d2 - d1 > 0
    b.put("a2", chain(T1), salt="tenant-a")  # within one tenant, rows are still stored once
    assert b.stats().bytes_by_tier["ssd"] == d2
    assert b.flush()
    assert len(list((tmp_path / "blocks").glob("*/*.blk"))) == 3 * 3
    b.check_invariants()
    b.close()


def test_named_tenant_salts_never_equal_a_plain_salt() -> None:
    assert bank_salt("", "x") == "x" and bank_salt("", None) is None
    assert bank_salt("alice", None) != bank_salt("bob", None)
    assert bank_salt("alice", "x") != "x"
    with pytest.raises(ValueError):  # a plain salt can never look like a tenant's
        check_cache_salt("\ntenant=alice\nx")


# ---- over HTTP ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    settings = load_settings({"max_tokens_default": "4", "bank_dir": "none"}, environ={})
    cold = ColdTier(tmp_path_factory.mktemp("bank"), max_disk_bytes=1 << 30, min_free_disk_bytes=0)
    store = Bank("tenants-test", 1 << 30, cold=cold)
    runtime = tiny_runtime(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5), context=1024), settings, store=store)
    yield runtime
    runtime.engine.stop()
    runtime.close()


@pytest.fixture(scope="module")
def client(rt: Runtime) -> Iterator[httpx.Client]:
    with serve_in_thread(create_app(rt.serving)) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        yield c


def _ssd(client: httpx.Client, headers: dict[str, str] | None = None) -> int:
    return int(client.get("/health", headers=headers).json()["bank"]["bytes_by_tier"]["ssd"])


def _complete(client: httpx.Client, prompt: list[int], headers: dict[str, str]) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, headers=headers)
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return usage


def test_cross_salt_probe_sees_no_dedupe_difference(client: httpx.Client) -> None:
    secret = [300 + i for i in range(40)]
    guess_right, guess_wrong = secret, [301 + i for i in range(40)]
    a, b = {"X-Cache-Salt": "tenant-a"}, {"X-Cache-Salt": "tenant-b"}
    _complete(client, secret, a)
    before = _ssd(client)
    right = _complete(client, guess_right, b)
    after_right = _ssd(client)
    wrong = _complete(client, guess_wrong, b)
    after_wrong = _ssd(client)
    assert right["prompt_tokens_details"]["cached_tokens"] == 0
    assert right["completion_tokens"] == wrong["completion_tokens"]
    assert after_right - before == after_wrong - after_right > 0


def test_sessions_are_scoped_to_the_salt(client: httpx.Client) -> None:
    a, b = {"X-Cache-Salt": "tenant-a"}, {"X-Cache-Salt": "tenant-b"}
    _complete(client, [500 + i for i in range(12)], {**a, "X-Session-Id": "a-private"})
    assert any(s["id"] == "a-private" for s in client.get("/v1/sessions", headers=a).json()["data"])
    assert all(s["id"] != "a-private" for s in client.get("/v1/sessions", headers=b).json()["data"])
    assert all(s["id"] != "a-private" for s in client.get("/v1/sessions").json()["data"])  # no salt
    for method, path in [("GET", "/v1/sessions/a-private"), ("DELETE", "/v1/sessions/a-private"),
                         ("POST", "/v1/sessions/a-private/fork")]:
        r = client.request(method, path, headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    assert client.get("/v1/sessions/a-private", headers=a).json()["turns"] == 1
    long_salt = {"X-Cache-Salt": "s" * 300}
    assert client.get("/v1/sessions", headers=long_salt).status_code == 400


def test_key_tenants_are_apart_and_health_is_minimal_without_a_key(rt: Runtime, tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\nalice key-alice\nbob key-bob  # bob's key\nshared-key\n")
    keys = load_keys(None, str(keyfile))
    alice = {"Authorization": "Bearer key-alice"}
    bob = {"Authorization": "Bearer key-bob"}
    with serve_in_thread(create_app(rt.serving, keys=keys)) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        open_health = c.get("/health")
        assert open_health.status_code == 200
        assert open_health.json() == {"status": "ok", "alive": True, "ready": True}
        full = c.get("/health", headers=alice).json()
        assert {"model", "bank", "admission", "kv"} <= set(full)
        assert c.get("/health", headers={"Authorization": "Bearer wrong"}).json().keys() == {"status", "alive", "ready"}
        assert c.get("/v1/models").status_code == 401
        assert c.get("/metrics").status_code == 401

        prompt = [700 + i for i in range(30)]
        _complete(c, prompt, {**alice, "X-Session-Id": "same-name"})
        assert [s["id"] for s in c.get("/v1/sessions", headers=alice).json()["data"]] == ["same-name"]
        assert c.get("/v1/sessions", headers=bob).json()["data"] == []
        assert c.delete("/v1/sessions/same-name", headers=bob).status_code == 404
        usage = _complete(c, prompt, {**bob, "X-Session-Id": "same-name"})  # bob's own session
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert c.get("/v1/sessions/same-name", headers=alice).json()["turns"] == 1
        # Bare keys are the default tenant: the salt-only scope of a server without tenants.
        shared = {"Authorization": "Bearer shared-key", "X-Cache-Salt": "tenant-a"}
        assert any(s["id"] == "a-private" for s in c.get("/v1/sessions", headers=shared).json()["data"])
