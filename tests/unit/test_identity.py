"""Node identity: key file handling and libp2p-compatible node ids (DESIGN.md section 4)."""

from __future__ import annotations

import os
import stat

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from protocol.identity import (
    Identity,
    IdentityError,
    node_id_from_public_key,
    public_key_from_node_id,
    verify_signature,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_key_file_created_on_first_use_with_mode_0600(tmp_path):
    path = tmp_path / "nested" / "dir" / "node.key"
    ident = Identity.load_or_create(path)
    assert path.is_file()
    assert _mode(path) == 0o600
    assert path.read_bytes() == ident.seed
    assert len(ident.seed) == 32


def test_key_file_reused_on_second_load(tmp_path):
    path = tmp_path / "node.key"
    first = Identity.load_or_create(path)
    content = path.read_bytes()
    second = Identity.load_or_create(path)
    assert second.node_id == first.node_id
    assert second.public_key == first.public_key
    assert path.read_bytes() == content  # never rewritten


def test_two_fresh_key_files_give_different_node_ids(tmp_path):
    a = Identity.load_or_create(tmp_path / "a.key")
    b = Identity.load_or_create(tmp_path / "b.key")
    assert a.node_id != b.node_id


def test_group_readable_key_file_is_refused_with_chmod_hint(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    with pytest.raises(IdentityError) as info:
        Identity.load_or_create(path)
    msg = str(info.value)
    assert "chmod 600" in msg
    assert str(path) in msg
    assert path.read_bytes()  # left alone


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_key_file_of_wrong_length_is_refused(tmp_path, size):
    path = tmp_path / "node.key"
    path.write_bytes(b"\x01" * size)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="32"):
        Identity.load_or_create(path)


def test_node_id_equals_libp2p_peer_id_of_same_key():
    for _ in range(5):
        seed = os.urandom(32)
        expected = ID.from_pubkey(create_new_key_pair(seed).public_key).to_base58()
        ident = Identity.from_seed(seed)
        assert ident.node_id == expected
        assert ident.node_id.startswith("12D3KooW")


def test_loaded_key_file_gives_libp2p_peer_id(tmp_path):
    path = tmp_path / "node.key"
    ident = Identity.load_or_create(path)
    expected = ID.from_pubkey(create_new_key_pair(path.read_bytes()).public_key).to_base58()
    assert Identity.load_or_create(path).node_id == expected == ident.node_id


def test_public_key_from_node_id_round_trips():
    ident = Identity.generate()
    assert public_key_from_node_id(ident.node_id) == ident.public_key
    assert node_id_from_public_key(public_key_from_node_id(ident.node_id)) == ident.node_id


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "hello",  # 'l' is not a base58 character
        "0OIl",
        "not a node id",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha2-256 (RSA-style) peer id
        "12D3KooW",  # truncated
    ],
)
def test_public_key_from_node_id_refuses_garbage(garbage):
    with pytest.raises(IdentityError):
        public_key_from_node_id(garbage)


def test_public_key_from_node_id_refuses_truncated_real_id():
    node_id = Identity.generate().node_id
    with pytest.raises(IdentityError):
        public_key_from_node_id(node_id[:-1])
    with pytest.raises(IdentityError):
        public_key_from_node_id(node_id + "1")


@pytest.mark.parametrize("size", [0, 31, 33])
def test_node_id_from_public_key_refuses_wrong_length(size):
    with pytest.raises(IdentityError, match="32"):
        node_id_from_public_key(b"\x00" * size)


def test_signatures_verify_only_for_the_signed_data_and_key():
    ident, other = Identity.generate(), Identity.generate()
    sig = ident.sign(b"payload")
    assert verify_signature(ident.public_key, sig, b"payload")
    assert not verify_signature(ident.public_key, sig, b"payloaD")
    assert not verify_signature(other.public_key, sig, b"payload")
    bad_sig = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify_signature(ident.public_key, bad_sig, b"payload")
    # A malformed key or signature is "not valid", not a crash.
    assert not verify_signature(b"\x00" * 31, sig, b"payload")
    assert not verify_signature(ident.public_key, sig[:-1], b"payload")
