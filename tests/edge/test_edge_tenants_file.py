"""The tenants file: keys as SHA-256 digests mapped to named tenants and their limits; every mistake one line
naming the file, the entry and what is allowed; a key written in by mistake is never echoed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edgepath.edge.tenancy.auth import load_keys
from edgepath.edge.tenancy.tenants_file import TenantsFileError, parse_tenants, read_tenants


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


GOOD = f"""
[tenants.acme]
keys = ["{digest("acme-1")}", "{hashlib.sha256(b"acme-2").hexdigest()}"]
slot_floor = 1
slot_cap = 4
tokens_per_minute = 2000
tokens_per_day = 100000
requests_per_minute = 60
requests_per_day = 5000
read_shared_prefix = true

[tenants.public-bot]
keys = ["{digest("bot")}"]
share_prefix = true
"""


def test_a_file_maps_each_key_to_its_tenant_and_limits() -> None:
    pairs = parse_tenants(GOOD, "t.toml")
    assert [(d, t.name) for d, t in pairs] == [
        (hashlib.sha256(b"acme-1").digest(), "acme"),
        (hashlib.sha256(b"acme-2").digest(), "acme"),
        (hashlib.sha256(b"bot").digest(), "public-bot"),
    ]
    acme, bot = pairs[0][1], pairs[2][1]
    assert (acme.slot_floor, acme.slot_cap, acme.tokens_per_minute, acme.tokens_per_day) == (1, 4, 2000, 100000)
    assert (acme.requests_per_minute, acme.requests_per_day) == (60, 5000)
    assert not acme.share_prefix and bot.share_prefix
    assert acme.read_shared_prefix and not bot.read_shared_prefix
    assert (bot.slot_cap, bot.tokens_per_minute, bot.tokens_per_day) == (0, 0, 0)  # 0: none


def test_a_tenant_with_a_floor_or_a_cap_has_an_id_in_the_state_words_and_one_with_neither_has_none() -> None:
    """The agents count floors and caps from the state words' tenant field: every tenant with either gets an id, in
    the order of the names (every edge derives the same ids from the same file)."""
    text = GOOD + f'[tenants.capped]\nkeys = ["{digest("capped")}"]\nslot_cap = 3\n'
    ids = {tenant.name: tenant.floor_id for _, tenant in parse_tenants(text, "t.toml")}
    assert ids == {"acme": 1, "capped": 2, "public-bot": 0}


def test_keys_of_one_tenant_share_its_cache_namespace_and_others_do_not(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    keys = load_keys(None, tenants_file=str(path), environ={"EDGEPATH_API_KEYS": "flat-key"})
    assert keys is not None
    one, two = keys.identify(b"acme-1"), keys.identify(b"acme-2")
    flat, bot = keys.identify(b"flat-key"), keys.identify(b"bot")
    assert one is not None and one is two and one.salt(None) == two.salt(None)
    assert flat is not None and bot is not None and flat.name.startswith("key-")
    assert len({one.salt(None), flat.salt(None), bot.salt(None)}) == 3
    assert keys.identify(b"acme-3") is None and keys.identify(b"sha256:" + digest("bot").encode()) is None
    assert [t.name for t in keys.tenants] == ["acme", "public-bot", flat.name]


SECRET = "sk-live-0123456789"
K = f'[tenants.a]\nkeys = ["{digest("k")}"]\n'  # a tenant with one good key, the rest of its fields after it


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[tenants", ("not valid TOML",)),
        ("", ("no tenant", "[tenants.NAME]")),
        ("x = 1\n[tenants.a]\nkeys=[]", ("unknown top-level", "'x'")),
        ("[tenants.a]\nslot_cap = 2", ("tenant 'a'", "'keys'", "sha256sum")),
        (f'[tenants.a]\nkeys = ["{SECRET}"]', ("tenant 'a'", "never the key itself", "a string of 18 characters")),
        (K + "slot_cap = -1", ("tenant 'a'", "'slot_cap'", "0..")),
        (K + "tokens_per_minute = 1.5", ("'tokens_per_minute'", "integer")),
        (K + "slot_cap = true", ("'slot_cap'", "integer")),
        (
            K + "slot_floor = 3\nslot_cap = 2",
            ("'slot_floor' (3)", "'slot_cap' (2)"),
        ),
        (K + 'share_prefix = "yes"', ("'share_prefix'", "true or false")),
        (K + "read_shared_prefix = 1", ("'read_shared_prefix'", "true or false")),
        (K + "share_prefix = true\nread_shared_prefix = true", ("'share_prefix' already reads", "give one of them")),
        (K + "requests_per_minute = -1", ("'requests_per_minute'", "0..1099511627776 (0: none)")),
        (K + f"tokens_per_day = {2**40 + 1}", ("'tokens_per_day'", "0..1099511627776", str(2**40 + 1))),
        (K + "quota = 5", ("unknown field", "'quota'", "tokens_per_day")),
        (f'[tenants."a b"]\nkeys = ["{digest("k")}"]', ("tenant 'a b'", "A-Z a-z 0-9")),
        (K + f'[tenants.b]\nkeys = ["{digest("k")}"]', ("tenant 'b'", "'a'")),
        ("tenants = 3", ("no tenant",)),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_the_entry_and_what_is_allowed(
    text: str, needles: tuple[str, ...]
) -> None:
    with pytest.raises(TenantsFileError) as caught:
        parse_tenants(text, "/etc/edgepath/tenants.toml")
    message = str(caught.value)
    assert message.startswith("tenants file /etc/edgepath/tenants.toml: ") and "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert SECRET not in message


def test_a_key_in_the_file_and_in_the_flat_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.a]\nkeys = ["{digest("both")}"]\n')
    with pytest.raises(TenantsFileError, match="also in the flat key list"):
        load_keys(None, tenants_file=str(path), environ={"EDGEPATH_API_KEYS": "both"})


def test_an_unreadable_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot read it"):
        read_tenants(str(tmp_path / "missing.toml"))
    (tmp_path / "latin1.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(TenantsFileError, match="not UTF-8"):
        read_tenants(str(tmp_path / "latin1.toml"))
