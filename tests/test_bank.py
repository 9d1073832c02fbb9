"""Session bank, RAM tier only: identity, lookup, forks, pins, eviction; exact state."""

from __future__ import annotations

import mlx.core as mx
import pytest

import segserve.bank.bank
import segserve.bank.index
import segserve.kv.segment
from segserve.bank import Bank, BankError, SessionNotFound, bank_namespace
from segserve.kv.segment import Snapshot
from tests.bank_fakes import assert_rows_match, chain, checked, extend, fake_segment

SEG_BYTES_PER_ROW = 2 * 2 * 2 * 8 * 2  # layers * (K+V) * heads * dim * float16


def nb(rows: int) -> int:
    return rows * SEG_BYTES_PER_ROW


def make_bank(max_bytes: int = 1 << 30, ns: str = "ns") -> Bank:
    return checked(Bank(ns, max_bytes))


T1 = list(range(100, 110))  # system + first user message
T2 = list(range(200, 206))
T3 = list(range(300, 304))


def test_session_put_and_lookup_exact_state() -> None:
    b = make_bank()
    snap = chain(T1, T2)
    sid = b.put("s1", snap)
    assert sid == "s1"
    b.check_invariants()
    st = b.stats()
    assert (st.sessions, st.entries, st.segments) == (1, 1, 2)
    assert st.bytes_by_tier == {"ram": nb(16), "ssd": 0}
    prompt = T1 + T2 + T3
    r = b.lookup(prompt, session_id="s1")
    assert (r.kind, r.tier, r.reused_tokens, r.restore_rows_from_ssd) == ("session", "ram", 16, 0)
    assert (r.session_id, r.turn, r.miss_reason) == ("s1", 0, None)
    # The returned refs are the stored segments themselves: nothing was copied.
    assert all(a is b_ for a, b_ in zip(r.snapshot.segments, snap.segments, strict=True))
    assert_rows_match(r.snapshot, prompt)
    b.check_invariants()


def test_prefix_lookup_ending_inside_a_segment_is_a_view() -> None:
    b = make_bank()
    snap = chain(T1, T2)
    b.put(None, snap)
    r = b.lookup(T1 + T2[:3] + [9, 9])
    assert (r.kind, r.reused_tokens) == ("prefix", 13)
    last = r.snapshot.segments[-1]
    assert last.rows == 3 and last.base is snap.segments[1] and last.nbytes == 0
    assert_rows_match(r.snapshot, T1 + T2[:3])
    # A view reuses its base's bytes: pinning it protects the base, counted once.
    b.pin(r.snapshot)
    assert b.protected_bytes() == nb(16) and b.evictable_bytes() == 0
    b.unpin(r.snapshot)
    assert b.protected_bytes() == 0 and b.evictable_bytes() == nb(16)
    b.check_invariants()


def test_last_prompt_token_is_never_reused_by_default() -> None:
    b = make_bank()
    b.put("s", chain(T1))
    assert b.lookup(T1).reused_tokens == 9
    assert b.lookup(T1, max_reuse=10).reused_tokens == 10
    miss = b.lookup(T1[:1])
    assert (miss.kind, miss.tier, miss.reused_tokens) == ("miss", "none", 0)
    assert miss.miss_reason == "prompt too short to reuse"
    assert b.lookup([]).miss_reason == "no stored prefix"


def test_misses_are_values_not_exceptions() -> None:
    b = make_bank()
    r = b.lookup([1, 2, 3], session_id="nope")
    assert (r.kind, r.miss_reason, r.snapshot) == ("miss", "session not found", Snapshot())
    st = b.stats()
    assert (st.misses, st.last_miss_reason, st.hits_by_kind) == (1, "session not found", {})
    with pytest.raises(SessionNotFound):
        b.delete("nope")
    with pytest.raises(SessionNotFound):
        b.fork("nope")
    with pytest.raises(SessionNotFound):
        b.info("nope")


def test_salt_and_namespace_isolate_entries() -> None:
    b = make_bank()
    b.put("s", chain(T1, T2), salt="tenant-a")
    prompt = T1 + T2 + [1]
    assert b.lookup(prompt, salt="tenant-a").reused_tokens == 16
    assert b.lookup(prompt, salt="tenant-b").kind == "miss"
    assert b.lookup(prompt).kind == "miss"  # no salt is its own tenant
    assert b.lookup(prompt, session_id="s", salt="tenant-b").miss_reason == "session not found"
    with pytest.raises(SessionNotFound):
        b.info("s")
    assert [i.id for i in b.list_sessions(salt="tenant-a")] == ["s"]
    assert b.list_sessions() == []
    # Same session id under two salts: two sessions.
    b.put("s", chain(T3))
    assert b.info("s").tokens == 4 and b.info("s", salt="tenant-a").tokens == 16
    b.check_invariants()
    other = make_bank(ns="other-model")
    other.put("s", chain(T1, T2), salt="tenant-a")
    assert other.lookup(prompt, salt="tenant-a").reused_tokens == 16


def test_namespace_builder_covers_every_part() -> None:
    base = dict(
        model="m", revision="r", dtype="float16", quantization="q4", kv_layout="1",
        tokenizer="t", chat_template="c",
    )  # fmt: skip
    seen = {bank_namespace(**base)}
    for k in base:
        seen.add(bank_namespace(**{**base, k: base[k] + "x"}))
    assert len(seen) == len(base) + 1


def test_digest_match_alone_never_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    # Make every chain hash collide: only the stored-token comparison can tell entries apart.
    for mod in (segserve.kv.segment, segserve.bank.index, segserve.bank.bank):
        monkeypatch.setattr(mod, "chain_digest", lambda parent, toks: "same")
    b = make_bank()
    b.put("a", Snapshot((fake_segment(T1),)))
    other = [t + 1 for t in T1]
    assert b.lookup(other + [5]).kind == "miss"
    assert b.lookup(T1[:4] + other).reused_tokens == 4  # a true partial match still works
    assert b.lookup(T1 + [5]).reused_tokens == 10
    with pytest.raises(BankError, match="names other tokens"):
        b.put("b", Snapshot((fake_segment(other),)))
    b.check_invariants()
    assert b.stats().entries == 1


def test_put_refuses_a_digest_that_names_other_tokens() -> None:
    b = make_bank()
    seg = fake_segment(T1)
    b.put("a", Snapshot((seg,)))
    forged = fake_segment([t + 1 for t in T1])
    object.__setattr__(forged, "digest", seg.digest)
    with pytest.raises(BankError, match="does not continue the chain"):
        b.put("b", Snapshot((forged,)))
    b.check_invariants()
    assert b.stats().entries == 1


def test_put_validates_the_chain() -> None:
    b = make_bank()
    with pytest.raises(BankError, match="empty"):
        b.put("a", Snapshot())
    stray = fake_segment(T2, 10, parent="f" * 32)  # does not start at the root
    with pytest.raises(BankError, match="chain"):
        b.put("a", Snapshot((stray,)))
    assert b.stats().segments == 0
    b.check_invariants()


def test_fork_shares_segments_and_adds_only_new_bytes() -> None:
    b = make_bank()
    s1 = chain(T1)
    b.put("main", s1)
    s2 = extend(s1, T2)
    b.put("main", s2)
    assert b.ram_bytes() == nb(16)
    fid = b.fork("main", turn=0, new_id="fork")
    assert fid == "fork" and b.ram_bytes() == nb(16)
    assert b.info("fork").turns == 1 and b.info("main").turns == 2
    b.check_invariants()
    s2b = extend(s1, T3)
    b.put("fork", s2b)
    assert b.ram_bytes() == nb(16) + nb(4)  # only the fork's new turn
    st = b.stats()
    assert (st.segments, st.entries, st.sessions) == (3, 4, 2)
    r = b.lookup(T1 + T3 + [7], session_id="fork")
    assert (r.kind, r.reused_tokens, r.turn) == ("session", 14, 1)
    assert r.snapshot.segments[0] is s1.segments[0]
    b.delete("main")
    assert b.ram_bytes() == nb(14)  # T2 freed, shared T1 kept
    b.check_invariants()
    b.delete("fork")
    assert b.ram_bytes() == 0 and b.stats().segments == 0
    b.check_invariants()


def test_session_rewind_matches_an_earlier_turn() -> None:
    b = make_bank()
    s1 = chain(T1)
    b.put("s", s1)
    b.put("s", extend(s1, T2))
    r = b.lookup(T1 + [1, 2, 3], session_id="s")
    assert (r.kind, r.reused_tokens, r.turn) == ("session", 10, 1)
    assert b.lookup(T1 + T2[:2] + [0], session_id="s").reused_tokens == 12


def test_pinned_snapshots_are_never_evicted() -> None:
    b = make_bank(max_bytes=nb(20))
    a = chain(T1)
    b.put("a", a)
    b.pin(a)
    b.put("b", chain(T3))
    assert (b.protected_bytes(), b.evictable_bytes()) == (nb(10), nb(4))
    freed = b.ensure_free(nb(20))
    assert freed == nb(4) and b.ram_bytes() == nb(10)
    assert b.stats().evictions_by_reason == {"dropped: no cold tier": 1}
    assert b.lookup(T1 + [1]).reused_tokens == 10
    b.unpin(a)
    with pytest.raises(BankError):
        b.unpin(a)
    assert b.ensure_free(nb(20)) == nb(10)
    assert b.stats().sessions == 0
    b.check_invariants()


def test_eviction_is_lru_and_tail_first() -> None:
    b = make_bank()
    base = chain(T1)
    b.put("x", extend(base, T2))
    b.put("y", extend(base, T3))
    b.lookup(T1 + T2 + [0], session_id="x")  # x is now the most recent
    # Free 4 rows: y's own turn goes first (LRU), the shared T1 stays.
    assert b.release(nb(1)) == nb(4)
    assert [i.id for i in b.list_sessions()] == ["x"]
    assert b.ram_bytes() == nb(16)
    # Next: x's tail before the prefix.
    assert b.release(nb(1)) == nb(16)  # x's T2 then the now-unshared T1 (session gone)
    b.check_invariants()


def test_cap_enforced_on_put_drops_latest_turns_first() -> None:
    b = make_bank(max_bytes=nb(16))
    s1 = chain(T1)
    b.put("s", s1)
    s2 = extend(s1, T2)
    b.put("s", s2)
    assert b.ram_bytes() == nb(16)
    b.put("s", extend(s2, T3))  # over the cap: the LRU tail goes, which is this session's
    assert b.ram_bytes() <= nb(16)
    info = b.info("s")
    assert info.turns == 2 and info.tokens == 16
    b.check_invariants()


def test_bfloat16_segments_are_accounted() -> None:
    b = make_bank()
    snap = chain(T1, dtype=mx.bfloat16)
    b.put("s", snap)
    assert b.ram_bytes() == nb(10)
    assert_rows_match(b.lookup(T1 + [1]).snapshot, T1)


def test_sessions_listing_and_info() -> None:
    b = make_bank()
    b.put("a", chain(T1))
    b.put("b", chain(T2, T3))
    infos = b.list_sessions()
    assert [i.id for i in infos] == ["b", "a"]
    assert infos[0] == type(infos[0])("b", 1, 10, 2, nb(10), "ram")
    assert b.stats().entries == 2


def test_turn_index_is_none_for_an_unknown_session() -> None:
    """The engine asks which turn a session is at before storing the next; an unknown id
    (or another salt's) is an ordinary answer, not an error."""
    b = make_bank()
    b.put("s", chain(T1))
    b.put("s", chain(T1, T2))
    assert b.turn_index("s") == 1
    assert b.turn_index("s", salt="other") is None
    assert b.turn_index("nobody") is None


def test_the_bank_is_the_schedulers_store() -> None:
    """`Bank` satisfies the scheduler's store protocol as it is (checked by mypy here; the
    bank itself imports nothing from the server)."""
    from segserve.server.scheduling import SnapshotStore

    store: SnapshotStore = make_bank()
    hit = store.lookup(T1 + [1], session_id=None, salt=None, max_reuse=len(T1))
    assert (hit.kind, hit.reused_tokens, hit.restore_rows_from_ssd) == ("miss", 0, 0)
    assert store.put(None, chain(T1), salt=None) is not None
    assert store.release(store.evictable_bytes()) == nb(len(T1))
