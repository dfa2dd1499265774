"""The API's users: a YAML file mapping users to token hashes, roles per entitlement and the region-admin flag.

    users:
      admin:                       # made by `ropewalk up` (its token in <secrets>/token, for the local CLI)
        token_sha256: 5e1c...      # SHA-256 of the token, hex; the token itself is never stored
        region_admin: true
      alice:
        token_sha256: 9a07...
        roles: {e1: owner, e2: viewer}

``ropewalk user add NAME [--role E=ROLE ...] [--region-admin]`` prints a new user's token once and stores its hash;
``user grant`` / ``user revoke`` / ``user remove`` / ``user list`` change or show the file (0600, in the secrets
directory: ``<run dir>/secrets/users.yaml``). The API reads it again whenever it changes, so no restart is needed.

**Why an unsalted SHA-256.** A token is 32 random bytes (``secrets.token_urlsafe(32)``: 256 bits). Salting and slow
hashes defend low-entropy secrets (passwords) against dictionary and precomputed attacks; a uniformly random
256-bit token has no dictionary, and finding a preimage of its SHA-256 is infeasible, so a stolen users file gives
nothing to log in with. A fast hash also lets the API find the user by the hash of the presented token in one
dictionary lookup (no per-user comparison whose timing could leak).
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import yaml

from infra.private import write_private
from processors.api.authz import ROLES, User
from processors import rules

TOKEN_PREFIX = "rwt_"
USERS_FILE = "users.yaml"
TOKEN_FILE = "token"  # the local region administrator's token (read by the CLI)
ADMIN_USER = "admin"
HEADER = ("# Ropewalk API users (processors/api/users.py). Tokens are stored as SHA-256 hashes;\n"
          "# `ropewalk user add NAME` prints a new user's token once.\n")


class UsersError(ValueError):
    pass


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Users:
    by_hash: Mapping[str, User]
    by_name: Mapping[str, User]

    def authenticate(self, token: str) -> User | None:
        return self.by_hash.get(token_hash(token))


def parse(doc, source: str = USERS_FILE) -> Users:  # noqa: C901
    """The users of a parsed users file, or UsersError naming the wrong entry. Pure."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict) or not isinstance(doc.get("users", {}), dict):
        raise UsersError(f"{source}: expected a mapping with `users:`")
    by_hash, by_name = {}, {}
    for name, entry in (doc.get("users") or {}).items():
        where = f"{source}: users.{name}"
        if not isinstance(name, str) or rules.name_problem(name, "user", "invalid_user") is not None:
            raise UsersError(f"{where}: a user name is letters, digits, '-' and '_'")
        if not isinstance(entry, dict):
            raise UsersError(f"{where}: expected a mapping")
        digest = entry.get("token_sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise UsersError(f"{where}.token_sha256: expected 64 lowercase hex digits")
        roles = entry.get("roles") or {}
        if not isinstance(roles, dict):
            raise UsersError(f"{where}.roles: expected a mapping entitlement: role")
        for ent, role in roles.items():
            if role not in ROLES:
                raise UsersError(f"{where}.roles.{ent}: expected one of {', '.join(ROLES)}, got {role!r}")
        admin = entry.get("region_admin", False)
        if not isinstance(admin, bool):
            raise UsersError(f"{where}.region_admin: expected true or false")
        if digest in by_hash:
            raise UsersError(f"{where}: the same token as user {by_hash[digest].name}")
        user = User(name=name, roles=MappingProxyType({str(e): r for e, r in roles.items()}), region_admin=admin)
        by_hash[digest] = user
        by_name[name] = user
    return Users(MappingProxyType(by_hash), MappingProxyType(by_name))


def load(path: Path) -> Users:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return parse({}, str(path))
    try:
        return parse(yaml.safe_load(text), str(path))
    except yaml.YAMLError as exc:
        raise UsersError(f"{path}: not YAML ({exc})") from None


def _read_doc(path: Path) -> dict:
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        doc = {}
    parse(doc, str(path))  # refuse to edit a broken file
    doc.setdefault("users", {})
    return doc


def _write_doc(path: Path, doc: dict) -> None:
    parse(doc, str(path))
    write_private(Path(path), HEADER + yaml.safe_dump(doc, sort_keys=True))


def add_user(path: Path, name: str, roles: Mapping[str, str] | None = None, region_admin: bool = False,
             token: str | None = None) -> str:
    """Add user ``name`` (refused if it exists) and return its token (the only time it is seen)."""
    doc = _read_doc(path)
    if name in doc["users"]:
        raise UsersError(f"user {name!r} exists; `ropewalk user remove {name}` first, or `user grant`")
    token = token or new_token()
    entry = {"token_sha256": token_hash(token), "roles": dict(roles or {})}
    if region_admin:
        entry["region_admin"] = True
    doc["users"][name] = entry
    _write_doc(path, doc)
    return token


def grant(path: Path, name: str, entitlement: str, role: str | None) -> None:
    """Give ``name`` ``role`` on ``entitlement`` (None: take its role there away)."""
    doc = _read_doc(path)
    entry = doc["users"].get(name)
    if entry is None:
        raise UsersError(f"no user {name!r}")
    roles = dict(entry.get("roles") or {})
    if role is None:
        roles.pop(entitlement, None)
    else:
        roles[entitlement] = role
    entry["roles"] = roles
    _write_doc(path, doc)


def remove_user(path: Path, name: str) -> None:
    doc = _read_doc(path)
    if doc["users"].pop(name, None) is None:
        raise UsersError(f"no user {name!r}")
    _write_doc(path, doc)


def ensure_admin(secrets_dir: Path) -> bool:
    """The region administrator ``admin`` with its token in ``<secrets>/token`` (both made once). Returns whether
    it was made now."""
    path, token_file = Path(secrets_dir) / USERS_FILE, Path(secrets_dir) / TOKEN_FILE
    users = load(path)
    if ADMIN_USER in users.by_name and token_file.exists():
        return False
    token = new_token()
    doc = _read_doc(path)
    doc["users"][ADMIN_USER] = {"token_sha256": token_hash(token), "roles": {}, "region_admin": True}
    _write_doc(path, doc)
    write_private(token_file, token + "\n")
    return True


def read_token(secrets_dir: Path) -> str | None:
    try:
        return (Path(secrets_dir) / TOKEN_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None
    except PermissionError:
        return None


__all__ = ["Users", "UsersError", "load", "parse", "add_user", "grant", "remove_user", "ensure_admin", "read_token",
           "new_token", "token_hash"]
