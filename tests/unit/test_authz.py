"""Who may do what through the API: processors/api/authz.py as a table (user, action, entitlement) -> verdict."""
from types import MappingProxyType

import pytest

from processors.api import authz as a
from processors.api.authz import User, decide, visible
from streams.topics import free_pool_key

ADMIN = User("root", region_admin=True)
ALICE = User("alice", MappingProxyType({"e1": a.OWNER, "e2": a.VIEWER}))
BOB = User("bob", MappingProxyType({"e1": a.OPERATOR}))
EVE = User("eve")  # authenticated, no role anywhere

CASES = [
    # user, action, entitlement, allowed, reason
    (ADMIN, "entitlement.quota", "e9", True, a.ALLOWED_ADMIN),
    (ADMIN, "machine.fail", None, True, a.ALLOWED_ADMIN),
    (ADMIN, "region.view", None, True, a.ALLOWED_ADMIN),
    (ADMIN, "job.stop", "e2", True, a.ALLOWED_ADMIN),
    (ALICE, "job.submit", "e1", True, a.ALLOWED_ROLE),  # owner ⊇ operator
    (ALICE, "entitlement.update", "e1", True, a.ALLOWED_ROLE),  # host profile etc.: the owner's
    (ALICE, "entitlement.quota", "e1", False, a.DENIED_NEEDS_ADMIN),  # a quota change needs the region admin
    (ALICE, "job.view", "e2", True, a.ALLOWED_ROLE),
    (ALICE, "job.stop", "e2", False, a.DENIED_ROLE_TOO_LOW),  # a viewer of e2
    (ALICE, "job.submit", "e3", False, a.DENIED_NO_ROLE),
    (ALICE, "replay.view", "e3", False, a.DENIED_NO_ROLE),
    (ALICE, "replay.view", None, False, a.DENIED_NO_ENTITLEMENT),
    (ALICE, "region.view", None, False, a.DENIED_NEEDS_ADMIN),
    (ALICE, "maintenance.plan", None, False, a.DENIED_NEEDS_ADMIN),
    (BOB, "job.resize", "e1", True, a.ALLOWED_ROLE),
    (BOB, "job.update", "e1", True, a.ALLOWED_ROLE),
    (BOB, "entitlement.update", "e1", False, a.DENIED_ROLE_TOO_LOW),  # operator < owner
    (BOB, "job.view", "e2", False, a.DENIED_NO_ROLE),  # a user of e1 sees nothing of e2
    (ALICE, "rebalance.view", "e2", True, a.ALLOWED_ROLE),  # the ReBalancer's plans: a viewer's
    (BOB, "rebalance.view", "e2", False, a.DENIED_NO_ROLE),
    (BOB, "machine.recover", None, False, a.DENIED_NEEDS_ADMIN),
    (EVE, "job.view", "e1", False, a.DENIED_NO_ROLE),
    (EVE, "entitlement.view", "e1", False, a.DENIED_NO_ROLE),
    (EVE, "no.such.action", "e1", False, a.DENIED_UNKNOWN_ACTION),
    (ADMIN, "no.such.action", None, False, a.DENIED_UNKNOWN_ACTION),  # unknown is refused even to an admin
]


@pytest.mark.parametrize("user,action,entitlement,allowed,reason", CASES,
                         ids=[f"{u.name}-{act}-{e}" for u, act, e, _, _ in CASES])
def test_decide(user, action, entitlement, allowed, reason):
    d = decide(user, action, entitlement)
    assert (d.allowed, d.reason) == (allowed, reason)
    assert user.name in d.message or reason == a.DENIED_UNKNOWN_ACTION


@pytest.mark.parametrize("action", sorted(a.ACTIONS))
def test_a_user_of_e1_can_do_nothing_to_e2(action):
    """Every action there is, on e2, by a user holding every role on e1 and none on e2: refused."""
    owner_of_e1 = User("mallory", MappingProxyType({"e1": a.OWNER}))
    assert not decide(owner_of_e1, action, "e2").allowed


@pytest.mark.parametrize("role", a.ROLES)
def test_each_role_includes_those_below_it(role):
    user = User("u", MappingProxyType({"e1": role}))
    allowed = {act for act, need in a.ACTIONS.items() if decide(user, act, "e1").allowed}
    assert allowed == {act for act, need in a.ACTIONS.items() if need in a.RANK and a.RANK[need] <= a.RANK[role]}


@pytest.mark.parametrize("user,entitlement,seen", [
    (ALICE, "e1", True), (ALICE, "e2", True), (ALICE, "e3", False), (EVE, "e1", False),
    (EVE, None, True), (EVE, "free/dc1", True), (EVE, free_pool_key("dc2"), True), (ADMIN, "e3", True),
    (EVE, "free", False), (EVE, "freeloaders", False)])  # named like the pool, not a pool's key
def test_visible(user, entitlement, seen):
    assert visible(user, entitlement) is seen
