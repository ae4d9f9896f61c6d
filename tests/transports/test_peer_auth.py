"""The peer-secret handshake's core (transports/peer_auth.py), without a transport: both sides prove they hold the
secret, a wrong secret, a replayed or reflected proof and a malformed message are refused, and a rotation's two
secrets are both accepted until the grace ends."""

from __future__ import annotations

import pytest

from edgepath.transports.peer_auth import (
    BAD_PROOF,
    MALFORMED,
    SECRET_MIN_BYTES,
    UNKNOWN_SECRET,
    ConnectorHandshake,
    ListenerHandshake,
    PeerKeys,
    PeerRefused,
    secret_id,
)

A, B, C = (bytes([n]) * 32 for n in (1, 2, 3))


def exchange(connector: PeerKeys, listener: PeerKeys, now: float = 0.0) -> None:
    """The three messages; raises PeerRefused where either side refuses."""
    c, s = ConnectorHandshake(connector, now), ListenerHandshake(listener, now)
    s.verify(c.proof(s.answer(c.opening())))


def test_the_same_secret_on_both_sides_passes_both_proofs() -> None:
    exchange(PeerKeys(A), PeerKeys(A))


def test_a_connector_with_another_secret_is_refused_at_its_opening() -> None:
    with pytest.raises(PeerRefused) as refused:
        exchange(PeerKeys(B), PeerKeys(A))
    assert refused.value.reason == UNKNOWN_SECRET


def test_a_listener_that_fakes_its_answer_is_refused_by_the_connector() -> None:
    # a listener that knows the id of the connector's secret (it is sent in the clear) but not the secret itself
    connector = ConnectorHandshake(PeerKeys(A), 0.0)
    opening = connector.opening()
    forged = opening[:16] + secret_id(A) + bytes(32)
    with pytest.raises(PeerRefused) as refused:
        connector.proof(forged)
    assert refused.value.reason == BAD_PROOF


def test_a_proof_recorded_in_one_exchange_proves_nothing_in_the_next() -> None:
    keys = PeerKeys(A)
    first_c, first_s = ConnectorHandshake(keys, 0.0), ListenerHandshake(keys, 0.0)
    recorded = first_c.proof(first_s.answer(first_c.opening()))
    first_s.verify(recorded)
    # the replayer sends the recorded opening again (the nonce it cannot change without the secret), then the proof
    replayed = ListenerHandshake(keys, 0.0)
    replayed.answer(first_c.opening())
    with pytest.raises(PeerRefused) as refused:
        replayed.verify(recorded)  # the listener's fresh nonce is in the proof it expects
    assert refused.value.reason == BAD_PROOF


def test_a_listeners_proof_reflected_back_as_a_connectors_is_refused() -> None:
    keys = PeerKeys(A)
    victim = ListenerHandshake(keys, 0.0)
    attacker = ConnectorHandshake(keys, 0.0)  # stands for what an attacker would send, not what it knows
    answer = victim.answer(attacker.opening())
    reflected = answer[-32:]  # the listener's own MAC over this very exchange, sent back
    with pytest.raises(PeerRefused) as refused:
        victim.verify(reflected)
    assert refused.value.reason == BAD_PROOF


@pytest.mark.parametrize(
    ("step", "message"),
    [("answer", b"short"), ("verify", b"\0" * 31)],
)
def test_a_message_of_the_wrong_size_is_malformed(step: str, message: bytes) -> None:
    listener = ListenerHandshake(PeerKeys(A), 0.0)
    if step == "verify":
        listener.answer(ConnectorHandshake(PeerKeys(A), 0.0).opening())
    with pytest.raises(PeerRefused) as refused:
        getattr(listener, step)(message)
    assert refused.value.reason == MALFORMED


def test_after_a_rotation_both_secrets_are_accepted_until_the_grace_ends_then_only_the_new() -> None:
    listener = PeerKeys(A)
    assert listener.rotate(B, now=100.0, grace=60.0)
    exchange(PeerKeys(A), listener, now=159.0)  # a peer not rotated yet
    exchange(PeerKeys(B), listener, now=159.0)  # a peer rotated already
    with pytest.raises(PeerRefused):
        exchange(PeerKeys(A), listener, now=160.0)
    exchange(PeerKeys(B), listener, now=160.0)
    with pytest.raises(PeerRefused):
        exchange(PeerKeys(C), listener, now=120.0)  # a secret it never held


def test_a_connector_in_its_grace_finds_a_listener_still_on_the_old_secret() -> None:
    connector = PeerKeys(A)
    connector.rotate(B, now=0.0, grace=60.0)
    exchange(connector, PeerKeys(A), now=30.0)  # it offers both: the listener picks the one it holds
    exchange(connector, PeerKeys(B), now=30.0)


def test_rotating_to_the_same_secret_changes_nothing() -> None:
    keys = PeerKeys(A)
    assert not keys.rotate(A, now=0.0, grace=60.0)
    assert keys.accepted(1.0) == [A]


def test_a_short_secret_is_refused_saying_how_long_one_must_be() -> None:
    with pytest.raises(ValueError, match=f"at least {SECRET_MIN_BYTES}"):
        PeerKeys(b"x" * (SECRET_MIN_BYTES - 1), "the test's secret")
