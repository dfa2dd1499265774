"""The API's users file (processors/api/users.py): tokens kept as hashes, roles checked, edits refused when wrong."""
import os
import stat

import pytest
import yaml

from processors.api import users as u
from processors.api.authz import User


def test_add_stores_the_hash_not_the_token_and_authenticates(tmp_path):
    path = tmp_path / "users.yaml"
    token = u.add_user(path, "alice", {"e1": "owner"})
    text = path.read_text()
    assert token not in text and u.token_hash(token) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    users = u.load(path)
    assert users.authenticate(token) == User("alice", {"e1": "owner"}, False)
    assert users.authenticate(token + "x") is None and users.authenticate("") is None


def test_grant_revoke_remove(tmp_path):
    path = tmp_path / "users.yaml"
    token = u.add_user(path, "bob")
    u.grant(path, "bob", "e1", "viewer")
    u.grant(path, "bob", "e2", "operator")
    u.grant(path, "bob", "e1", None)
    assert dict(u.load(path).authenticate(token).roles) == {"e2": "operator"}
    u.remove_user(path, "bob")
    assert u.load(path).authenticate(token) is None
    with pytest.raises(u.UsersError, match="no user"):
        u.grant(path, "bob", "e1", "viewer")


def test_ensure_admin_once(tmp_path):
    assert u.ensure_admin(tmp_path) is True
    token = u.read_token(tmp_path)
    assert u.load(tmp_path / u.USERS_FILE).authenticate(token).region_admin
    assert stat.S_IMODE(os.stat(tmp_path / u.TOKEN_FILE).st_mode) == 0o600
    assert u.ensure_admin(tmp_path) is False and u.read_token(tmp_path) == token  # kept across `up`s


@pytest.mark.parametrize("doc,error", [
    ({"users": []}, "expected a mapping with `users:`"),
    ({"users": {"a b": {"token_sha256": "0" * 64}}}, "users.a b: a user name"),
    ({"users": {"a": {"token_sha256": "xyz"}}}, "users.a.token_sha256: expected 64 lowercase hex"),
    ({"users": {"a": {"token_sha256": "0" * 64, "roles": {"e1": "god"}}}}, "users.a.roles.e1: expected one of"),
    ({"users": {"a": {"token_sha256": "0" * 64, "region_admin": "yes"}}}, "users.a.region_admin: expected true"),
    ({"users": {"a": {"token_sha256": "0" * 64}, "b": {"token_sha256": "0" * 64}}}, "the same token as user a"),
])
def test_a_wrong_users_file_names_the_entry(doc, error):
    with pytest.raises(u.UsersError, match=error.replace(".", r"\.").replace("`", ".")):
        u.parse(doc)


def test_a_broken_file_is_not_edited(tmp_path):
    path = tmp_path / "users.yaml"
    path.write_text(yaml.safe_dump({"users": {"a": {"token_sha256": "bad"}}}))
    with pytest.raises(u.UsersError):
        u.add_user(path, "b")
    assert "bad" in path.read_text()
