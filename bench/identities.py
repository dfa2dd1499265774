"""What identities cost (issue 27): sealing and checking a record's proof (streams/auth.py), per event, in-process.

    python -m bench.identities [--events N] [--json]        # also part of every `ropewalk bench` run ("identities")

The path that matters is the heartbeat's at 1,000,000 machines: one heartbeat per machine every 200 s is 5,000/s,
each sealed by its machine's agent and checked by the health check. For each kind of record it measures, on the same
records in the same run, the baseline (encoding / decoding alone, what every producer and reader pays anyway) and the
same with the proof (sealing / checking), best of ``repeat`` runs; the difference is the cost of the identity. The
Ed25519 rows are the choice not made for machines and components (a key pair per machine): a signature instead of an
HMAC on the same heartbeats.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from processors.agent import decide as d
from streams import auth
from streams.events import new_event
from streams.serde import SchemaRegistry

HEARTBEATS_PER_S = 5_000  # 1,000,000 machines, one heartbeat each every 200 s (bench/env.py's setting at that size)


def _best_us(fn: Callable[[], Any], items: int, repeat: int) -> float:
    """Microseconds per item of the fastest of ``repeat`` runs of ``fn`` (which handles ``items`` items)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / items * 1e6


def measure(events: int = 20_000, repeat: int = 3) -> dict[str, Any]:
    reg = SchemaRegistry.from_dir()
    msecret, csecret = os.urandom(32), os.urandom(32)
    machines = auth.MachineSigner(lambda m: auth.machine_key(msecret, m))
    sk = auth.new_signing_key("scheduler")
    ring = auth.KeyRing(auth.PublicKey("operator", "op", b"\0" * 32), [auth.PublicKey("scheduler", sk.key_id,
                                                                                      sk.public())])
    verifier = auth.Verifier(component_secret=csecret, machine_secret=msecret, ring=ring, components=["scheduler"])
    version = reg.reader("AgentHeartbeat").version
    beats = [d.heartbeat(f"dc1-msb{i % 36:02d}-r{i % 463:03d}-m{i:07d}", 1, i, [], 1_800_000_000_000 + i)
             for i in range(events)]
    records = [hb.to_record(version) for hb in beats]
    plain = [reg.encode("AgentHeartbeat", r, validate=False) for r in records]
    sealed = [machines.seal(reg, "AgentHeartbeat", hb.to_record(version), False) for hb in beats]
    decoded = [reg.decode(v)[1] for v in sealed]
    out: dict[str, Any] = {"events": events, "repeat": repeat}

    def check_all():
        for rec, v in zip(decoded, sealed):
            verifier.check("AgentHeartbeat", rec, v)

    hb = {
        "encode_us": _best_us(lambda: [reg.encode("AgentHeartbeat", r, validate=False) for r in records], events,
                              repeat),
        "seal_us": _best_us(lambda: [machines.seal(reg, "AgentHeartbeat", hb.to_record(version), False)
                                     for hb in beats], events, repeat),
        "decode_us": _best_us(lambda: [reg.decode(v) for v in plain], events, repeat),
        "check_us": _best_us(check_all, events, repeat),
    }
    hb["sign_cost_us"] = hb["seal_us"] - hb["encode_us"]  # seal() encodes too: the identity is the difference
    hb["verify_cost_us"] = hb["check_us"]  # check() works on the decoded record: all of it is the identity's
    hb["bytes_plain"], hb["bytes_sealed"] = len(plain[0]), len(sealed[0])
    # the alternative: an Ed25519 key pair per machine, on the same heartbeats' bytes
    n_ed = max(200, events // 20)
    msgs = plain[:n_ed]
    sigs = [sk.sign(m) for m in msgs]
    pub = ring.keys[("scheduler", sk.key_id)]
    hb["ed25519_sign_us"] = _best_us(lambda: [sk.sign(m) for m in msgs], n_ed, repeat)
    hb["ed25519_verify_us"] = _best_us(lambda: [pub.verify(s, m) for s, m in zip(sigs, msgs)], n_ed, repeat)
    out["heartbeat"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in hb.items()}
    out["health_check_at_5000_per_s"] = {
        "heartbeats_per_s": HEARTBEATS_PER_S,
        "decode_core_share": round(hb["decode_us"] * HEARTBEATS_PER_S / 1e6, 4),
        "hmac_core_share": round(hb["verify_cost_us"] * HEARTBEATS_PER_S / 1e6, 4),
        "ed25519_core_share": round(hb["ed25519_verify_us"] * HEARTBEATS_PER_S / 1e6, 4),
    }
    # a job's commands: one TasksCommanded of 100 lines, signed (Ed25519) by the scheduler, checked by each agent
    sched = auth.ComponentSigner("scheduler", csecret, sk)
    cmd = new_event("TasksCommanded", {
        "job_id": "e1.web", "argv": ["sleep", "3600"], "env": {"A": "1"}, "part": 0, "parts": 1, "host_profile": "",
        "resources": {"cpu_millicores": 1000, "memory_mib": 1024},
        "commands": [{"task_id": f"e1.web/{i}", "machine_id": f"m{i}", "command": "START", "spec_version": 1,
                      "reason": "new"} for i in range(100)]}, entitlement="e1", entity_id="e1.web", producer="scheduler")
    cv = reg.reader("TasksCommanded").version
    n_cmd = max(50, events // 100)
    cmd_sealed = sched.seal(reg, "TasksCommanded", cmd.to_record(cv), False)
    cmd_rec = reg.decode(cmd_sealed)[1]

    def costs(type_: str, record, signer, sealed: bytes, decoded) -> dict[str, float]:
        """Per event of ``type_`` (``record()`` its record): encoded alone, sealed (encoded and signed) by ``signer``,
        its proof checked."""
        return {"encode_us": round(_best_us(lambda: [reg.encode(type_, record(), validate=False)
                                                     for _ in range(n_cmd)], n_cmd, repeat), 2),
                "seal_us": round(_best_us(lambda: [signer.seal(reg, type_, record(), False)
                                                   for _ in range(n_cmd)], n_cmd, repeat), 2),
                "check_us": round(_best_us(lambda: [verifier.check(type_, decoded, sealed)
                                                    for _ in range(n_cmd)], n_cmd, repeat), 2)}

    out["tasks_commanded_100"] = costs("TasksCommanded", lambda: cmd.to_record(cv), sched, cmd_sealed, cmd_rec)
    # an agents' batch of 100 reports of 100 machines: a proof per report
    reports = [d._report(d.AgentState(f"m{i}"), d.TaskRun(f"e1.web/{i}", d.Spec("e1.web", "e1", 1, ("x",), (), "r"),
                                                           d.P_RUNNING, d.STARTING), d.RUNNING, "up", 5)
               for i in range(100)]
    batch = d.batch(reports, "agent/simulated", 5)[0]
    rv = reg.reader("TaskStatesChanged").version
    b_sealed = machines.seal(reg, "TaskStatesChanged", batch.to_record(rv), False)
    b_rec = reg.decode(b_sealed)[1]
    out["task_reports_100"] = costs("TaskStatesChanged", lambda: batch.to_record(rv), machines, b_sealed, b_rec)
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    out["cores"] = os.cpu_count()
    return out


def format_text(doc: dict) -> str:
    hb, hc = doc["heartbeat"], doc["health_check_at_5000_per_s"]
    tc, tr = doc["tasks_commanded_100"], doc["task_reports_100"]
    return "\n".join([
        f"identities: {doc['events']:,} heartbeats, best of {doc['repeat']}, {doc['cores']} cores, load average "
        f"{doc['load_average'][0]}",
        f"  heartbeat ({hb['bytes_plain']} -> {hb['bytes_sealed']} bytes): encode {hb['encode_us']} us, sealed "
        f"{hb['seal_us']} us (HMAC: +{hb['sign_cost_us']} us); decode {hb['decode_us']} us, check +{hb['check_us']} us",
        f"  the same with Ed25519 (a key pair per machine): sign {hb['ed25519_sign_us']} us, verify "
        f"{hb['ed25519_verify_us']} us",
        f"  health check at {hc['heartbeats_per_s']:,} heartbeats/s: decoding {hc['decode_core_share']:.1%} of a core, "
        f"checking the HMAC +{hc['hmac_core_share']:.2%} (Ed25519 would be +{hc['ed25519_core_share']:.1%})",
        f"  TasksCommanded of 100 commands: encode {tc['encode_us']} us, signed (Ed25519) {tc['seal_us']} us, "
        f"checked {tc['check_us']} us",
        f"  TaskStatesChanged of 100 machines' reports: encode {tr['encode_us']} us, sealed {tr['seal_us']} us, "
        f"checked {tr['check_us']} us"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.identities", description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20_000, help="heartbeats measured (default 20,000)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    doc = measure(args.events)
    print(json.dumps(doc, indent=2) if args.json else format_text(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
