"""`ropewalk keys ...`: the keys behind the identities on the log (streams/auth.py, infra/trust.py), on the operator's
host (they read and write the secrets directory, and the rotation is written to the log as the operator).

    ropewalk keys list [--json]                         # the Ed25519 keys the region accepts: pinned, announced, until
    ropewalk keys rotate IDENTITY [--overlap-s S] [--signed-by operator|old]   # a new key; the old one for S seconds
    ropewalk keys machine MACHINE [--out FILE]          # a machine's own key file, to give its process agent
"""
from __future__ import annotations

import time
from pathlib import Path

from processors.frontend.console import CliError
from processors.frontend.render import _print
from streams.serde import SchemaRegistry


def cmd_list(cfg, args) -> int:
    from infra import trust  # noqa: PLC0415 - start-up: the key ring (~8 ms), when used

    verifier = trust.verifier_for(cfg.as_principal("operator"))
    if verifier is None:
        raise CliError(f"this region has no keys ({cfg.secrets / trust.TRUST_FILE} is missing: `ropewalk up` makes it)")
    ring = verifier.ring
    ring.refresh()
    ring.fetch.close()
    keys = trust.ring_keys(ring)

    def until(k):
        return "anchor" if k["anchor"] else "valid" if k["until_ms"] is None else f"until {k['until_ms']}"
    _print(keys, args.json, "\n".join(f"{k['identity']:10} {k['key_id']:22} {until(k)}" for k in keys))
    return 0


def cmd_rotate(cfg, args) -> int:
    from infra import trust  # noqa: PLC0415 - start-up: the key ring (~8 ms), when used
    from streams.clients import EventProducer  # noqa: PLC0415 - start-up: confluent-kafka (~35 ms)

    doc = trust.trust_doc(cfg.secrets)
    if doc is None:
        raise CliError(f"this region has no keys ({cfg.secrets / trust.TRUST_FILE} is missing: `ropewalk up` makes it)")
    if args.overlap_s < 0:
        raise CliError(f"--overlap-s: expected a number of seconds >= 0, got {args.overlap_s}")
    try:
        rot = trust.rotation(doc, args.identity, int(time.time() * 1000), overlap_ms=int(args.overlap_s * 1000),
                             by=args.signed_by)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    producer = EventProducer(cfg.as_principal("operator"), SchemaRegistry.from_dir(), "keys", signer=rot.signer,
                             **{"message.timeout.ms": 15000})
    producer.send(rot.announcement)
    producer.flush(20)  # on the log before the new key is in any file: nobody signs with a key not announced
    trust.save(cfg.secrets, rot.doc)
    s = rot.summary
    _print(s, args.json, f"{s['identity']}: new key {s['key_id']} (announced, signed by {s['signed_by']}); "
                         f"{s['previous_key_id']} accepted for records dated up to {s['previous_until_ms']}. Start the "
                         f"{s['identity']} workers again to sign with the new key.")
    return 0


def cmd_machine(cfg, args) -> int:
    from infra import trust  # noqa: PLC0415 - start-up: the key ring (~8 ms), when used

    path = trust.write_machine_key(cfg.secrets, args.machine, Path(args.out) if args.out else None)
    _print({"machine": args.machine, "key_file": str(path)}, args.json,
           f"{path}: machine {args.machine}'s key (0600): give it to its agent (--machine-key {path.name}, or "
           f"<its secrets dir>/machines/)")
    return 0


def add_commands(sub) -> None:
    grp = sub.add_parser("keys", help="the keys behind the identities on the log: list, rotate, a machine's key"
                         ).add_subparsers(dest="action_", required=True)
    sp = grp.add_parser("list", help="the Ed25519 keys the region accepts (pinned and announced on the keys topic)")
    sp.set_defaults(fn=cmd_list)
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp = grp.add_parser("rotate", help="a new signing key for an identity, announced on the keys topic")
    sp.set_defaults(fn=cmd_rotate)
    sp.add_argument("identity", help="scheduler, sidekick or operator")
    sp.add_argument("--overlap-s", type=float, default=24 * 3600,
                    help="how long records signed with the old key are still accepted (default a day; 0: revoked)")
    sp.add_argument("--signed-by", choices=("operator", "old"), default="operator",
                    help="who signs the announcement: the operator's key, or the identity's old key")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp = grp.add_parser("machine", help="write a machine's own key file (for its process agent)")
    sp.set_defaults(fn=cmd_machine)
    sp.add_argument("machine", help="the machine id")
    sp.add_argument("--out", help="where (default: <secrets>/machines/<machine>.json)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
