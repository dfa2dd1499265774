"""The scheduler's verdict on an intent (processors/frontend/verdict.py), from the records that answer it."""
import pytest

from processors.frontend.verdict import ACCEPTED, REFUSED, verdict_of
from streams.events import new_event


def refused(intent="i1", reason="duplicate_job_id"):
    return new_event("IntentRefused", {"intent_type": "JobSubmitted", "intent_event_id": intent, "job_id": "e1.web",
                                       "reason": reason, "message": "job e1.web exists with another spec"},
                     entitlement="e1", entity_id="e1.web", producer="scheduler")


def published(cause="i1", state="pending", last_reason=""):
    return new_event("JobStatePublished", {"job_id": "e1.web", "name": "web", "state": state, "spec_version": 1,
                                           "desired_tasks": 1, "tasks": [], "last_reason": last_reason,
                                           "deleted": False, "task_parts": 0, "task_count": 0, "incarnation": 1},
                     entitlement="e1", entity_id="e1.web", producer="scheduler", causation_id=cause)


@pytest.mark.parametrize("ev,verdict,reason,final", [
    (refused(), REFUSED, "duplicate_job_id", True),
    (published(), ACCEPTED, "", True),
    (published(state="rejected", last_reason="unknown_entitlement: no entitlement e9"), REFUSED,
     "unknown_entitlement", True),
    # a refusal of an intent about a live job also shows in its last_reason: not taken for an acceptance at once
    (published(state="running", last_reason="duplicate_job_id: exists"), ACCEPTED, "", False),
    # an allocation's rejection is no refusal of the intent
    (published(state="pending", last_reason="no_feasible_machine: 0 of 4"), ACCEPTED, "", True),
])
def test_verdict_of(ev, verdict, reason, final):
    got = verdict_of("i1", ev)
    assert (got.verdict, got.reason, got.final) == (verdict, reason, final)


@pytest.mark.parametrize("ev", [refused(intent="other"), published(cause="other"), published(cause=None)])
def test_records_about_other_intents_say_nothing(ev):
    assert verdict_of("i1", ev) is None
