"""Warm standby processes (`ddiloco.runtime.standby`): the role protocol, and real standby processes
handed a role (they preload nothing here, so each test takes a fraction of a second)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.standby import StandbyPool, module_command, parse_role, role_message

WAIT_S = 30.0


def test_role_message_round_trips_through_parse_role():
    line = role_message("ddiloco.cli", ["learner", "--learner-id", "2"], "/tmp/x.log").decode()
    assert line.endswith("\n")
    assert parse_role(line) == {"module": "ddiloco.cli", "args": ["learner", "--learner-id", "2"], "log": "/tmp/x.log"}


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"args": [], "log": "x"}), "'module'"),
    (json.dumps({"module": "m", "args": "a b", "log": "x"}), "'args'"),
    (json.dumps({"module": "m", "args": [1], "log": "x"}), "'args'"),
    (json.dumps({"module": "m", "args": []}), "'log'"),
])
def test_parse_role_says_what_is_wrong(line, message):
    with pytest.raises(ValueError, match=message):
        parse_role(line)


def test_only_a_module_run_by_this_interpreter_can_go_to_a_standby():
    assert module_command([sys.executable, "-m", "ddiloco.cli", "learner", "--x"]) == ("ddiloco.cli",
                                                                                       ["learner", "--x"])
    assert module_command([sys.executable, "fake.py", "learner"]) is None
    assert module_command(["/other/python", "-m", "ddiloco.cli"]) is None
    assert module_command([sys.executable, "-m"]) is None


def test_pool_settings_are_checked(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    with pytest.raises(ValueError, match="size=-1 is invalid: expected an integer >= 0"):
        StandbyPool(launcher, size=-1, name="s", preload=(), threads=1)
    with pytest.raises(ValueError, match="refill_delay_s"):
        StandbyPool(launcher, size=1, name="s", preload=(), threads=1, refill_delay_s=-1.0)


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def pool(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    now = [0.0]
    started = []
    pool = StandbyPool(launcher, size=1, name="standby", preload=("json",), threads=1, refill_delay_s=5.0,
                       clock=lambda: now[0], on_start=started.append)
    pool.now, pool.started = now, started
    yield pool
    pool.close()
    for pid in pool.pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_a_standby_runs_its_role_in_its_own_process_with_the_roles_log_and_exit_code(pool, tmp_path):
    pool.fill()
    [standby_pid] = pool.pids
    assert [c.pid for c in pool.started] == [standby_pid]
    data = tmp_path / "data.json"
    data.write_text('{"b": 1, "a": [2]}')
    child = pool.hand_out("role-a", [sys.executable, "-m", "json.tool", "--sort-keys", str(data)])
    assert child is not None and child.pid == standby_pid and child.name == "role-a"
    assert child.popen.wait(timeout=WAIT_S) == 0
    log = (tmp_path / "logs" / "role-a.log").read_text()
    assert f"start in standby pid {standby_pid}" in log
    assert json.loads(log.split("\n", 1)[1]) == {"a": [2], "b": 1}  # the role's stdout, after the header
    assert "waiting for a role" in (tmp_path / "logs" / "standby-1.log").read_text()

    # Used up: no standby until the refill is due; then a new one, and a failing role's exit status shows.
    assert pool.hand_out("role-b", [sys.executable, "-m", "json.tool", str(data)]) is None
    pool.fill()
    assert len(pool.pids) == 1
    pool.now[0] = 5.0
    pool.fill()
    assert len(pool.pids) == 2 and pool.handed_out == 1
    child = pool.hand_out("role-b", [sys.executable, "-m", "json.tool", str(tmp_path / "missing.json")])
    assert child is not None and child.popen.wait(timeout=WAIT_S) == 2  # argparse: no such file
    assert "missing.json" in child.log_tail()[-1]


def test_a_command_that_is_not_a_module_of_this_interpreter_is_not_handed_out(pool):
    pool.fill()
    assert pool.hand_out("role", ["/bin/true"]) is None
    assert pool.handed_out == 0


def test_a_dead_standby_is_skipped_and_replaced(pool):
    pool.fill()
    [pid] = pool.pids
    os.killpg(pid, signal.SIGKILL)
    _wait(lambda: not process_group_alive(pid), "the standby to die")
    assert pool.hand_out("role", [sys.executable, "-m", "json.tool", "--help"]) is None
    pool.fill()  # not handed out: replaced at once
    assert len(pool.pids) == 2 and pool.pids[1] != pid


def test_a_standby_exits_by_itself_when_its_owner_closes_its_stdin(pool):
    pool.fill()
    [standby] = pool.started
    standby.close_stdin()
    assert standby.popen.wait(timeout=WAIT_S) == 0
    assert "no role" in (standby.log_path.read_text())


def test_standbys_that_keep_dying_make_the_pool_give_up_rather_than_loop(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    pool = StandbyPool(launcher, size=1, name="standby", preload=("no_such_module_anywhere",), threads=1,
                       refill_delay_s=0.0)
    try:
        deadline = time.monotonic() + WAIT_S
        while pool.gave_up is None:
            assert time.monotonic() < deadline, "the pool never gave up"
            pool.fill()
            time.sleep(0.05)
        assert len(pool.pids) == 3 and "3 standbys in a row exited" in pool.gave_up
        # Each replaced a dead one, under its name: one log, appended to.
        log = (tmp_path / "logs" / "standby-1.log").read_text()
        assert log.count("No module named 'no_such_module_anywhere'") == 3
        assert [path.name for path in (tmp_path / "logs").iterdir()] == ["standby-1.log"]
        pool.fill()
        assert len(pool.pids) == 3  # no more starts
        assert pool.hand_out("role", [sys.executable, "-m", "json.tool", "--help"]) is None
    finally:
        pool.close()
    assert not [pid for pid in pool.pids if process_group_alive(pid)]


def test_replacements_take_the_lowest_free_name_so_a_pool_keeps_its_size_in_names_and_logs(tmp_path):
    # A long run with `--standby-learners 2` whose learners are killed again and again: one log per restart before.
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    started = []
    pool = StandbyPool(launcher, size=2, name="standby", preload=(), threads=1, refill_delay_s=0.0,
                       on_start=started.append, nice=0)
    hand_outs = 3
    try:
        for index in range(hand_outs):
            pool.fill()
            child = pool.hand_out(f"role-{index}", [sys.executable, "-m", "json.tool", "--help"])
            assert child is not None and child.popen.wait(timeout=WAIT_S) == 0
        pool.fill()
        names = [standby.name for standby in started]
        assert len(names) == 2 + hand_outs and set(names) == {"standby-1", "standby-2"}, names
        assert sorted(path.name for path in (tmp_path / "logs").glob("standby-*")) == ["standby-1.log",
                                                                                      "standby-2.log"]
        assert sum(path.read_text().count("waiting for a role") for path in (tmp_path / "logs").glob("standby-*")) \
            >= hand_outs  # every standby that ran a role had logged there first
    finally:
        pool.close()
    assert not [pid for pid in pool.pids if process_group_alive(pid)]


def _nice_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2:].split()[16])  # field 19 of /proc/PID/stat: nice


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_a_standby_waits_at_low_priority_and_its_role_runs_at_the_normal_one(tmp_path):
    from ddiloco.runtime.standby import may_restore_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_restore_priority(base):
        pytest.skip("this user may not raise a priority again: standbys run at the normal priority")
    (tmp_path / "prio_probe.py").write_text(
        "import os\nprint(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))\n")
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False,
                                     extra_env={"PYTHONPATH": str(tmp_path)}))
    pool = StandbyPool(launcher, size=1, name="standby", preload=("json",), threads=1, nice=7)
    try:
        pool.fill()
        [pid] = pool.pids
        _wait(lambda: "waiting for a role" in (tmp_path / "logs" / "standby-1.log").read_text(), "the standby")
        assert _nice_of(pid) == base + 7
        assert "at nice +7" in (tmp_path / "logs" / "standby-1.log").read_text()
        child = pool.hand_out("probe", [sys.executable, "-m", "prio_probe"])
        assert child is not None and child.popen.wait(timeout=WAIT_S) == 0
        assert child.log_tail()[-1] == f"[{base}]"  # every thread back at the normal priority
    finally:
        pool.close()
