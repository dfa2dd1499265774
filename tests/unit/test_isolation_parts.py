"""The process agent's isolation of tasks, its pure parts and its host-wide uid leases (processors/agent/isolation.py).
The tasks themselves, as an attacker tries them: tests/integration/test_isolation.py."""
from __future__ import annotations

import json
import re
import os
import subprocess
from pathlib import Path

import pytest

from processors.agent import isolation as iso


@pytest.mark.parametrize("text, want", [
    ("70000-79999", (70000, 79999)), ("5-5", (5, 5)),
    ("0-10", ValueError), ("10-5", ValueError), ("70000", ValueError), ("a-b", ValueError), ("", ValueError),
    ("1-4294967295", ValueError),
])
def test_uid_range(text, want):
    if want is ValueError:
        with pytest.raises(ValueError, match="task uids"):
            iso.UidRange.parse(text)
    else:
        r = iso.UidRange.parse(text)
        assert (r.first, r.last) == want and len(r) == want[1] - want[0] + 1 and want[0] in r and want[1] + 1 not in r


@pytest.mark.parametrize("agent_env, command_env, want", [
    ({"PATH": "/bin", "ROPEWALK_TOKEN": "rwt_secret", "LANG": "C.UTF-8", "HOME": "/root"}, {"A": "1"},
     {"PATH": "/bin", "LANG": "C.UTF-8", "HOME": "/t", "A": "1"}),
    ({}, {}, {"PATH": iso.DEFAULT_PATH, "HOME": "/t"}),
    ({"PATH": "/bin"}, {"PATH": "/opt/bin", "HOME": "/h"}, {"PATH": "/opt/bin", "HOME": "/h"}),  # the command's wins
])
def test_a_task_gets_none_of_the_agents_environment_but_the_kept_variables(agent_env, command_env, want):
    assert iso.task_env(command_env, "/t", agent_env) == want


@pytest.mark.parametrize("paths, want", [
    (["/r/run", "/r/run/agents/m", "/r/secrets"], ["/r/run", "/r/secrets"]),
    (["/a", "/a", "/ab"], ["/a", "/ab"]),  # a sibling with a common prefix is not inside
    (["/x/y/z", "/x"], ["/x"]),
])
def test_outermost(paths, want):
    assert iso.outermost(map(Path, paths)) == [Path(p) for p in want]


def test_the_sandbox_hides_the_run_directory_but_the_passages_to_the_task_and_drops_to_its_uid():
    argv = iso.sandbox_argv(["sh", "-c", "x"], task_dir=Path("/r/run/agents/m/tasks/j_0"),
                            hidden=[Path("/r/run"), Path("/r/run/secrets"), Path("/r/run/agents/m")], uid=70001,
                            gid=70001, bwrap="/usr/bin/bwrap", setpriv="/usr/bin/setpriv")
    assert argv[:8] == ["/usr/bin/bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    text = " ".join(argv)
    for tmp in iso.SHARED_TMP:
        assert f"--perms 1777 --tmpfs {tmp}" in text
    assert "--perms 0711 --tmpfs /r/run " in text and text.count("--tmpfs") == 4  # /tmp, /var/tmp, /dev/shm, run
    passages = [argv[i + 3] for i, a in enumerate(argv) if a == "--perms" and argv[i + 2] == "--dir"]
    assert passages == ["/r/run/agents", "/r/run/agents/m", "/r/run/agents/m/tasks"]
    i = argv.index("--bind")
    assert argv[i:i + 5] == ["--bind", "/r/run/agents/m/tasks/j_0", "/r/run/agents/m/tasks/j_0", "--chdir",
                             "/r/run/agents/m/tasks/j_0"]
    assert {"--unshare-pid", "--unshare-ipc"} <= set(argv) and "--die-with-parent" not in argv  # survives the agent
    assert "--unshare-net" not in argv  # a task is a service
    tail = argv[argv.index("--") + 1:]
    assert tail == ["/usr/bin/setpriv", "--reuid=70001", "--regid=70001", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--", "sh", "-c", "x"]
    # the tmpfs over the run directory comes before the passages and the bind: each made on top of the one before
    assert argv.index("/r/run") < argv.index("/r/run/agents") < i


def test_a_task_directory_outside_every_hidden_one_needs_no_passage():
    argv = iso.sandbox_argv(["true"], task_dir=Path("/w/t"), hidden=[Path("/r/run")], uid=1, gid=1)
    assert "--dir" not in argv and argv[argv.index("--bind") + 1] == "/w/t"


# -- leases: real files in a directory of the test's own ------------------------------------------------------

def leases(tmp_path: Path, owner: str, uids: str = "71000-71002") -> iso.Leases:
    return iso.Leases(tmp_path / "leases", iso.UidRange.parse(uids), tmp_path / owner / "agent-state.json")


def hold(lease: iso.Leases, held: dict[str, int]) -> None:
    """The owner's state file, listing the uids it holds (as the process agent saves it)."""
    lease.owner.parent.mkdir(parents=True, exist_ok=True)
    lease.owner.write_text(json.dumps({iso.OWNER_UIDS_KEY: held}))


def test_two_agents_never_lease_one_uid(tmp_path):
    a, b = leases(tmp_path, "a"), leases(tmp_path, "b")
    ua = a.acquire("j/0")
    hold(a, {"j/0": ua})
    ub = b.acquire("k/0")
    hold(b, {"k/0": ub})
    assert ua != ub and a.holds(ua) and not a.holds(ub) and b.holds(ub)
    assert a.mine() == {ua: "j/0"} and b.mine() == {ub: "k/0"}
    assert json.loads((tmp_path / "leases" / str(ua)).read_text())["owner"] == str(a.owner)
    assert not b.claim(ua, "k/1")  # another agent's lease is not taken while it holds it


def test_a_lease_its_owner_no_longer_holds_is_taken_over_and_the_range_can_run_out(tmp_path):
    a, b = leases(tmp_path, "a", "71000-71001"), leases(tmp_path, "b", "71000-71001")
    u1, u2 = a.acquire("j/0"), a.acquire("j/1")
    hold(a, {"j/0": u1, "j/1": u2})
    with pytest.raises(iso.IsolationError, match="no uid left .* widen ROPEWALK_TASK_UIDS"):
        b.acquire("k/0")
    hold(a, {"j/0": u1})  # a handed j/1 back in its state (and crashed before removing the lease)
    assert b.acquire("k/0") == u2 and b.holds(u2)
    os.unlink(a.owner)  # a's work directory gone (a test's temporary directory deleted)
    assert b.acquire("k/1") == u1


def test_a_uid_a_user_has_is_never_leased(tmp_path):
    nobody = iso._nobody()  # named in /etc/passwd
    lease = iso.Leases(tmp_path / "leases", iso.UidRange(nobody, nobody + 1), tmp_path / "a" / "agent-state.json")
    assert lease.acquire("j/0") == nobody + 1
    assert not lease.claim(nobody, "j/1")


def test_a_uid_some_process_runs_as_is_never_leased(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a process of another uid needs root")

    p = subprocess.Popen(["sleep", "30"], user=71050, group=71050, extra_groups=[])
    try:
        lease = iso.Leases(tmp_path / "leases", iso.UidRange(71050, 71051), tmp_path / "a" / "agent-state.json")
        assert iso.processes_of(71050) == [p.pid]
        assert lease.acquire("j/0") == 71051 and not lease.claim(71050, "j/1")
        assert iso.kill_uid(71050) and not iso.processes_of(71050)
    finally:
        p.kill()
        p.wait()


def test_the_task_directory_is_given_to_its_uid_and_back_to_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    uids = iso.UidRange.parse("71000-71009")
    d = tmp_path / "tasks" / "j_0"
    iso.own(d, 71000, uids)
    (d / "f").write_text("x")
    os.chown(d / "f", 71000, 71000)
    (d / "root-owned").write_text("r")  # e.g. a hard link to a file of someone else: never given away
    os.symlink("/etc/shadow", d / "link")
    os.lchown(d / "link", 71000, 71000)
    iso.disown(d)
    assert (d.stat().st_uid, d.stat().st_mode & 0o777) == (0, 0o700)
    iso.own(d, 71005, uids)  # the task's next run, under another uid: what it had follows it
    assert d.stat().st_uid == 71005 and (d / "f").stat().st_uid == 71005
    assert (d / "root-owned").stat().st_uid == 0 and Path("/etc/shadow").stat().st_uid == 0
    assert os.lstat(d / "link").st_uid == 71005


# How tasks run, decided at the agent's start (Isolation.start), on every kind of machine: (root?, --task-sandbox,
# bwrap installed?, the probe's verdict) -> (a uid per task?, the sandbox, what the agent says, or the error).
NOT_ROOT = "the agent does not run as root"
MISSING = "bubblewrap is not installed"
PROBE_FAILED = "bwrap failed (exit 1): No permissions to create new namespace"


@pytest.mark.parametrize("root, want, installed, probe, uids, sandbox, says", [
    (False, iso.AUTO, True, None, False, iso.NONE, NOT_ROOT),
    (False, iso.NONE, True, None, False, iso.NONE, NOT_ROOT),
    (False, iso.BWRAP, True, None, None, None, NOT_ROOT),  # required: the agent refuses to start
    (True, iso.AUTO, True, None, True, iso.BWRAP, "in a bubblewrap sandbox"),
    (True, iso.AUTO, False, None, True, iso.NONE, MISSING),
    (True, iso.AUTO, True, PROBE_FAILED, True, iso.NONE, PROBE_FAILED),
    (True, iso.NONE, True, None, True, iso.NONE, f"{iso.SANDBOX_ENV}=none"),
    (True, iso.BWRAP, True, None, True, iso.BWRAP, "in a bubblewrap sandbox"),
    (True, iso.BWRAP, False, None, None, None, MISSING),
    (True, iso.BWRAP, True, PROBE_FAILED, None, None, PROBE_FAILED),
    (True, "firejail", True, None, None, None, "expected one of"),
])
def test_how_tasks_run_is_decided_at_the_agents_start(monkeypatch, tmp_path, root, want, installed, probe, uids,
                                                      sandbox, says):
    monkeypatch.setattr(iso.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setattr(iso.shutil, "which", lambda name: f"/usr/bin/{name}" if installed or name != "bwrap" else None)
    monkeypatch.setattr(iso, "probe_sandbox", lambda bwrap, setpriv, scratch: probe)

    def start() -> iso.Isolation:
        return iso.Isolation.start(want=want, uids=iso.UidRange.parse("71100-71109"), leases_dir=tmp_path / "leases",
                                   owner=tmp_path / "agent-state.json", hidden=[tmp_path], scratch=tmp_path / "tasks")

    if uids is None:
        with pytest.raises(iso.IsolationError, match=re.escape(says)):
            start()
        return
    got = start()
    assert (got.leases is not None, got.sandbox) == (uids, sandbox)
    assert says in got.describe()
