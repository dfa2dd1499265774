"""Who may do what through the API. Pure: ``decide(user, action, entitlement) -> Decision``.

A user holds a role per entitlement (``viewer`` < ``operator`` < ``owner``) and may be a region administrator.
Each action needs a role on the entitlement it touches, or the region-admin role (``ACTIONS``, one table). A
region administrator may do everything. Every answer carries a reason constant, which the API returns with its
403 (``{"error": reason, "message": ...}``) and which the tests check by name.

| action                  | needs                | what it is                                              |
|-------------------------|----------------------|---------------------------------------------------------|
| entitlement.view        | viewer               | see an entitlement, its jobs' states, its machines      |
| job.view                | viewer               | job status, job list, the jobs stream                   |
| machine.view            | viewer               | machines the entitlement holds (free machines: any user) |
| replay.view             | viewer               | the audit timeline of one entitlement (all: admin)      |
| rebalance.view          | viewer               | the ReBalancer's plans for the entitlement and their moves |
| job.submit              | operator             | submit a job to the entitlement                         |
| job.update / job.resize / job.stop | operator  | change a job of the entitlement                         |
| entitlement.update      | owner                | host profile, machine type, DC pin of the entitlement   |
| entitlement.quota       | region admin         | create an entitlement, change its quota                 |
| machine.fail / machine.recover | region admin  | operator actions on machines                            |
| machine.power_loss / .power_restore | region admin | a fault domain's power lost or back (a power controller's) |
| maintenance.plan / maintenance.end | region admin | planned maintenance                                  |
| region.view             | region admin         | region-wide reads: every machine, the whole replay      |
| intents.view            | viewer               | a job's intents (who wants what) and its reconciled spec |
| intents.declare         | operator             | declare a push, canary, sizing or resources intent      |
| srm.view                | viewer               | the autoscaler's picture of a job and its decisions     |
| loans.view              | viewer               | loans to or from the entitlement (all loans: admin)     |
| entitlement.elastic     | region admin         | make an entitlement elastic (it borrows quota)          |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from streams.topics import is_free_pool_key

VIEWER = "viewer"
OPERATOR = "operator"
OWNER = "owner"
ROLES = (VIEWER, OPERATOR, OWNER)  # each includes the rights of those before it
RANK: Mapping[str, int] = MappingProxyType({r: i + 1 for i, r in enumerate(ROLES)})
REGION_ADMIN = "region-admin"  # not a role on an entitlement: a flag of the user

ACTIONS: Mapping[str, str] = MappingProxyType({
    "entitlement.view": VIEWER,
    "job.view": VIEWER,
    "machine.view": VIEWER,
    "replay.view": VIEWER,
    "rebalance.view": VIEWER,
    "job.submit": OPERATOR,
    "job.update": OPERATOR,
    "job.resize": OPERATOR,
    "job.stop": OPERATOR,
    "entitlement.update": OWNER,
    "entitlement.quota": REGION_ADMIN,
    "entitlement.move": REGION_ADMIN,  # to another scheduler shard: the region's balance, not the entitlement's
    "machine.fail": REGION_ADMIN,
    "machine.recover": REGION_ADMIN,
    "machine.power_loss": REGION_ADMIN,
    "machine.power_restore": REGION_ADMIN,
    "maintenance.plan": REGION_ADMIN,
    "maintenance.end": REGION_ADMIN,
    "region.view": REGION_ADMIN,
    "intents.view": VIEWER,
    "intents.declare": OPERATOR,
    "srm.view": VIEWER,
    "loans.view": VIEWER,
    "entitlement.elastic": REGION_ADMIN,
})

# What each action is, in a user's words (a refusal says what was refused, not the table's name of it).
WORDS: Mapping[str, str] = MappingProxyType({
    "entitlement.view": "seeing an entitlement",
    "job.view": "seeing its jobs",
    "machine.view": "seeing its machines",
    "replay.view": "reading its events (replay)",
    "rebalance.view": "seeing its ReBalancer plans",
    "job.submit": "submitting a job",
    "job.update": "updating a job",
    "job.resize": "resizing a job",
    "job.stop": "stopping a job",
    "entitlement.update": "changing an entitlement's host profile, machine type or DC",
    "entitlement.quota": "creating an entitlement or changing its quota",
    "machine.fail": "failing a machine (machine fail)",
    "machine.recover": "recovering a machine (machine recover)",
    "maintenance.plan": "planning maintenance",
    "maintenance.end": "ending maintenance",
    "region.view": "reading the whole region",
    "intents.view": "seeing a job's intents",
    "intents.declare": "declaring an intent",
    "srm.view": "seeing the autoscaler's picture",
    "loans.view": "seeing loans",
    "entitlement.elastic": "making an entitlement elastic",
    "entitlement.move": "moving an entitlement to another scheduler shard",
    "machine.power_loss": "announcing a power loss (machine power-loss)",
    "machine.power_restore": "announcing power back (machine power-restore)",
})

# Reasons (Decision.reason).
ALLOWED_ADMIN = "region_admin"  # allowed: the user is a region administrator
ALLOWED_ROLE = "role"  # allowed: the user's role on the entitlement suffices
DENIED_NO_ROLE = "no_role_on_entitlement"  # the user holds no role on that entitlement
DENIED_ROLE_TOO_LOW = "role_too_low"  # a role, but not enough (a viewer submitting a job)
DENIED_NEEDS_ADMIN = "needs_region_admin"  # only a region administrator may (quota, machines, maintenance)
DENIED_NO_ENTITLEMENT = "entitlement_required"  # an entitlement-scoped action without one (not an admin)
DENIED_UNKNOWN_ACTION = "unknown_action"  # a programming error, refused rather than allowed


@dataclass(frozen=True)
class User:
    name: str
    roles: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # entitlement -> role
    region_admin: bool = False


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    message: str


def decide(user: User, action: str, entitlement: str | None) -> Decision:
    """Whether ``user`` may do ``action`` on ``entitlement`` (None: region-wide). Pure."""
    need = ACTIONS.get(action)
    if need is None:
        return Decision(False, DENIED_UNKNOWN_ACTION, f"unknown action {action!r}")
    if user.region_admin:
        return Decision(True, ALLOWED_ADMIN, f"{user.name} is a region administrator")
    what = WORDS.get(action, action)
    if need == REGION_ADMIN:
        return Decision(False, DENIED_NEEDS_ADMIN,
                        f"{what} is for region administrators; {user.name} is not one")
    if entitlement is None:
        return Decision(False, DENIED_NO_ENTITLEMENT,
                        f"{what} without naming an entitlement covers the whole region: name one ({user.name} is "
                        f"no region administrator)")
    role = user.roles.get(entitlement)
    if role is None:
        return Decision(False, DENIED_NO_ROLE, f"{user.name} has no role on entitlement {entitlement!r}")
    if RANK.get(role, 0) < RANK[need]:
        return Decision(False, DENIED_ROLE_TOO_LOW,
                        f"{what} in entitlement {entitlement!r} needs the {need} role; {user.name} is {role}")
    return Decision(True, ALLOWED_ROLE, f"{user.name} is {role} of {entitlement!r}")


def visible(user: User, entitlement: str | None) -> bool:
    """Whether ``user`` may see things of ``entitlement`` (None or a free pool's key, ``streams.topics.free_pool_key``:
    free machines, which every user may see). Pure."""
    if user.region_admin or entitlement is None or is_free_pool_key(entitlement):
        return True
    return entitlement in user.roles
