"""Why the scheduler did what it did: the reason constants its events carry (TaskStateChanged, TaskCommanded and
ServiceDiscoveryUpdated ``reason``, a task's ``reason``, a job's ``last_reason``, IntentRefused ``reason``, a job's
``last_ignored``). The table in README.md says where each appears. Reasons of other components the scheduler passes
on: ``processors/rules.py`` (intents), ``processors/agent/hostprofile.py`` (``host_profile_failed``),
``processors/taskcontrol`` (acks ignored, the limiter).
"""
from __future__ import annotations

from processors import rules

# Why a task is (re)placed, stopped or restarted.
REASON_SUBMITTED = "submitted"  # the job was submitted: a new task
REASON_RESIZED = "resized"  # JobResized: a task added or retired
REASON_JOB_STOPPED = "job_stopped"  # JobStopped: every task is stopped and freed
REASON_ROLLING_UPDATE = "rolling_update"  # JobSpecChanged: replaced by the new spec version
REASON_ALLOCATED = "allocated"  # TaskStateChanged →ALLOCATED: the allocator placed it
REASON_PLACED = "placed"  # TaskCommanded START after a placement
REASON_TASK_RUNNING = "task_running"  # discovery enabled: the agent reports it RUNNING
REASON_CRASHED = "crashed"  # the agent reports it FAILED (non-zero exit, or could not start)
REASON_EXITED = "exited"  # the agent reports it STOPPED on its own (exit 0)
REASON_RESTART_POLICY = "restart_policy"  # TaskCommanded RESTART: crashed or exited, restarted in place
REASON_COMMAND_REPEATED = "command_repeated"  # TaskCommanded again: left STARTING/STOPPING with no report (timer)
REASON_LOST_PLACEMENT = "lost_placement"  # STOP where an answer the shard lost had placed the task (steps.ask_again)
REASON_RESTART_LIMIT = "restart_limit"  # left FAILED/STOPPED: MAX_RESTARTS restarts used up
REASON_MACHINE_FAILED = "machine_failed"  # its machine went DOWN, or a FAILURE/POWER unavailability
REASON_MACHINE_UNHEALTHY = "machine_unhealthy"  # its machine went UNHEALTHY (missed heartbeats)
REASON_MACHINE_MAINTENANCE = "machine_maintenance"  # its machine went into MAINTENANCE, or moved off for it
# Planned maintenance (UnavailabilityStarted MAINTENANCE with a deadline; see "Maintenance" below).
REASON_MAINTENANCE_STOP = "maintenance_stop"  # its controller chose STOP: down until the maintenance ends
REASON_MAINTENANCE_DEADLINE = "maintenance_deadline"  # still on the machine at the deadline: stopped
REASON_MAINTENANCE_ENDED = "maintenance_ended"  # UnavailabilityEnded: a task stopped for it starts again
REASON_NOT_UNDER_NOTICE = "not_under_notice"  # a choice for a task no open notice of the job names (ignored)
REASON_CHOICE_TOO_LATE = "choice_too_late"  # a choice for a task the deadline stopped already (ignored)
# Why an intent was refused: an IntentRefused event (reason, message) and, for a job, its published last_reason.
REASON_DUPLICATE_JOB_ID = "duplicate_job_id"  # JobSubmitted for a job id that exists with another spec
REASON_UNKNOWN_ENTITLEMENT = "unknown_entitlement"  # JobSubmitted to an entitlement never created
REASON_UNKNOWN_JOB = "unknown_job"  # resize/update/stop of a job this shard never had, or stopped and gone
REASON_INVALID_SPEC = rules.INVALID_SPEC  # a spec or resize breaking a rule (processors/rules.py)
REASON_TOO_MANY_TASKS = rules.TOO_MANY_TASKS  # a job (submitted, resized, updated) beyond the maximum tasks per job
REASON_INVALID_ENTITLEMENT = rules.INVALID_ENTITLEMENT  # EntitlementCreated/Updated breaking a rule (e.g. quota < 0)
REASON_JOB_NOT_ACTIVE = "job_not_active"  # resize/update of a job that is stopping or rejected; a submission of a
#                                           job id whose previous incarnation is still stopping
REASON_STALE_SPEC_VERSION = "stale_spec_version"  # JobSpecChanged not newer than the job's spec version
REASON_ENTITLEMENT_MISMATCH = "entitlement_mismatch"  # an intent keyed to another entitlement than the job's
REASON_STALE_GENERATION = "stale_generation"  # JobSpecReconciled not newer than the one the job holds
REASON_STALE_SUBMISSION = "stale_submission"  # JobSpecReconciled for another incarnation (submission) of the job
REASON_MUST_VACATE = "must_vacate"  # a KEEP/STOP choice under a notice whose machines must be left (a loan revoked)
# Why an agent report was ignored (job last_ignored).
REASON_STALE_REPORT = "stale_report"  # about another machine or spec version than the task's (a lagging agent)
REASON_ILLEGAL_REPORT = "illegal_report"  # a transition the lifecycle table refuses from the task's state
REASON_NOT_AN_AGENT_STATE = "not_an_agent_state"  # PENDING/ALLOCATED/STOPPING/UNKNOWN: not an agent's to say
REASON_UNKNOWN_TASK = "unknown_task"  # no such task in the job (e.g. retired and freed already)
REASON_REBALANCE = "rebalance"  # a MOVE of a running task planned by the ReBalancer (op_reason, task reason)
# Why a move of a ReBalancer plan is refused (IntentRefused.reason of the RebalancePlanned, per job).
REASON_MOVE_JOB_NOT_RUNNING = "job_not_running"  # the job is stopping, rejected or updating
REASON_MOVE_NOT_ON_SOURCE = "not_on_source"  # the task is no longer on the plan's source machine
REASON_MOVE_TASK_NOT_RUNNING = "task_not_running"
REASON_MOVE_TASK_BUSY = "task_busy"  # another operation (update, move, restart, stop) is wanted on it
REASON_MOVE_UNDER_MAINTENANCE = "under_maintenance"  # its machine is under a planned maintenance of the job
# Why the shard sent a record to ``deadletter`` (DeadLetterRecorded.reason; the other reason there is
# ``streams.deadletter.PROCESSING_FAILED``, a decision that raised or an output the broker refused).
JOB_UNREADABLE = "job_unreadable"  # it names a job whose stored form the shard cannot read (ShardTables.load)
