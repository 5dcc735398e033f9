"""auth.py on its own: the keys file, token-bucket quotas (on a fake clock), key strength."""

import pytest

from minisarathi.server import auth
from minisarathi.server.auth import (
    Key,
    KeyStore,
    Quota,
    add_key,
    hash_secret,
    new_secret,
    read_keys_file,
    secret_bits,
)
from minisarathi.testing import FakeClock


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(auth.time, "monotonic", fake)
    return fake


def test_keys_add_stores_only_the_hash_and_the_key_authenticates(tmp_path):
    path = tmp_path / "keys.toml"
    alice = add_key(path, "alice", rpm=60, tpm=1000)
    bob = add_key(path, "bob")
    text = path.read_text()
    assert alice not in text and bob not in text and hash_secret(alice) in text
    store = KeyStore.from_file(path)
    assert store.authenticate(alice) == Key("alice", hash_secret(alice), rpm=60, tpm=1000)
    assert store.authenticate(bob).name == "bob" and store.authenticate(bob).rpm is None
    assert store.authenticate("ms-wrong") is None and store.authenticate(alice + " ") is None
    with pytest.raises(ValueError, match="already has a key named 'alice'"):
        add_key(path, "alice")
    with pytest.raises(ValueError, match="NAME"):
        add_key(path, "no spaces")


@pytest.mark.parametrize(
    "limits, rule",
    [
        ({"rpm": -1}, "rpm must be a positive integer, got -1"),
        ({"tpm": 0}, "tpm must be a positive integer"),
        ({"max_tokens": 1.5}, "max_tokens must be a positive integer"),
        ({"priority": 2**31}, "priority must be an integer in [-2147483648, "),
        ({"colour": 1}, "unknown key field 'colour'"),
    ],
)
def test_keys_add_checks_the_key_before_touching_the_file(tmp_path, limits, rule):
    path = tmp_path / "keys.toml"
    add_key(path, "alice", priority=-3)
    before = path.read_bytes()
    with pytest.raises(ValueError) as info:
        add_key(path, "bob", **limits)
    assert rule in str(info.value) and path.read_bytes() == before
    assert KeyStore.from_file(path).quotas["alice"].key.priority == -3
    with pytest.raises(ValueError):
        add_key(tmp_path / "new.toml", "bob", **limits)
    assert not (tmp_path / "new.toml").exists()


@pytest.mark.parametrize(
    "content, rule",
    [
        ('[[keys]]\nname = "a"\n', "sha256"),
        ('[[keys]]\nname = "a b"\nsha256 = "' + "0" * 64 + '"\n', "name"),
        ('[[keys]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nrpm = 0\n', "rpm must be a positive integer"),
        ('[[keys]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\ncolour = 1\n', "unknown field 'colour'"),
        (
            '[[keys]]\nname = "a"\nsha256 = "'
            + "0" * 64
            + '"\n[[keys]]\nname = "a"\nsha256 = "'
            + "1" * 64
            + '"\n',
            "unique",
        ),
        ("keys = 3\n", "[[keys]]"),
        ("[[keys]\n", "not valid TOML"),
    ],
)
def test_bad_keys_files_are_refused_naming_file_entry_and_rule(tmp_path, content, rule):
    path = tmp_path / "keys.toml"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        read_keys_file(path)
    assert str(path) in str(info.value) and rule in str(info.value)


def test_missing_keys_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        KeyStore.from_file(tmp_path / "nope.toml")


def test_request_quota_refills_continuously(clock):
    quota = Quota(Key("k", "0" * 64, rpm=2))
    assert quota.admit(10) is None and quota.admit(10) is None
    assert quota.admit(10) == pytest.approx(30.0)  # one request per 30 s comes back
    clock.now += 29.0
    assert quota.admit(10) == pytest.approx(1.0)
    clock.now += 1.0
    assert quota.admit(10) is None
    assert quota.counters["requests"] == 3 and quota.counters["rate_limited"] == 2


def test_token_quota_charges_at_admission_and_refunds_at_finish(clock):
    quota = Quota(Key("k", "0" * 64, tpm=600))  # 10 tokens per second
    assert quota.admit(500) is None  # prompt 100 + max_tokens 400
    assert quota.admit(200) == pytest.approx(10.0)  # 100 left: 100 more needed
    quota.finish(500, prompt_tokens=100, completion_tokens=50)  # 350 unused come back
    assert quota.admit(200) is None
    assert quota.admit(10_000) == float("inf")  # more than a minute's worth: never
    assert quota.counters["prompt_tokens"] == 100 and quota.counters["completion_tokens"] == 50


def test_concurrency_quota(clock):
    quota = Quota(Key("k", "0" * 64, concurrent=1))
    assert quota.admit(1) is None
    assert quota.admit(1) is not None
    quota.finish(1, 1, 0)
    assert quota.admit(1) is None


def test_reload_keeps_bucket_levels_and_drops_removed_keys(tmp_path, clock):
    path = tmp_path / "keys.toml"
    secret = add_key(path, "alice", rpm=2)
    store = KeyStore.from_file(path)
    key = store.authenticate(secret)
    assert store.quota(key).admit(1) is None and store.quota(key).admit(1) is None
    other = add_key(path, "bob")
    store.reload()
    assert store.current(key) == key and store.quota(key).admit(1) is not None  # still empty
    assert store.authenticate(other).name == "bob"
    path.write_text("")
    store.reload()
    assert store.current(key) is None and store.authenticate(secret) is None
    path.write_text("[[keys]\n")
    with pytest.raises(ValueError):
        store.reload()


def test_an_undecodable_secret_is_a_wrong_key_not_an_error():
    """An `Authorization: Bearer \\xff` header reaches the store as a lone surrogate (aiohttp's
    surrogateescape): it used to raise UnicodeEncodeError, a 500 with a traceback."""
    store = KeyStore.single("ms-right")
    assert store.authenticate("\udcff") is None and store.authenticate("ms-right").name == "default"


def test_secret_bits_tell_a_weak_key_from_a_made_one():
    assert secret_bits("hunter2") < 40
    assert secret_bits("a" * 27) < auth.MIN_SECRET_BITS <= secret_bits("a" * 28)  # 28 x log2(26)
    assert all(secret_bits(new_secret()) >= 256 for _ in range(20))
    assert secret_bits("0123456789abcdef" * 2) >= auth.MIN_SECRET_BITS  # 128 random bits in hex
