"""`scheduler_nice`: the scheduler actor's threads, those it starts later too, run at
the configured niceness; raising priority without the privilege keeps the niceness."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from serve_app.configuration.args import ServeArgs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is Linux's")

CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    from serve_app.deployment.actor import set_process_nice
    target = int(sys.argv[1])
    started = threading.Event()
    before = threading.Thread(target=lambda: started.wait(), daemon=True)
    before.start()
    changed = set_process_nice(target)
    later = []
    def spawn():
        later.append(threading.get_native_id())
        started.wait()
    after = threading.Thread(target=spawn, daemon=True)
    after.start()
    time.sleep(0.1)
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    print(json.dumps({"changed": changed, "levels": sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}),
                      "later": os.getpriority(os.PRIO_PROCESS, later[0])}))
    started.set()
""")


def _run(nice: int) -> dict:
    """In a child process (the test's own niceness stays): how many threads changed,
    the niceness levels of every thread, and that of a thread started afterwards."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(nice)], capture_output=True, text=True, check=True, cwd=os.getcwd()
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_every_thread_and_every_later_one_gets_the_niceness():
    current = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(current + 2, 19)
    got = _run(target)
    assert got["changed"] >= (2 if target != current else 0)  # the main thread and the one started before
    assert got["levels"] == [target] and got["later"] == target


def test_without_the_privilege_the_niceness_stays_and_a_warning_says_so(monkeypatch, caplog):
    """What an unprivileged actor meets when asked for a higher priority (setpriority
    raises EACCES): nothing changes, one warning."""
    from serve_app.deployment import actor

    current = os.getpriority(os.PRIO_PROCESS, 0)

    def refuse(which, who, prio):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(actor.os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="serve_app.deployment.actor"):
        assert actor.set_process_nice(current - 1 if current > -20 else current + 1) == 0
    assert [r.message for r in caplog.records] == [
        f"scheduler_nice {current - 1 if current > -20 else current + 1}: not permitted (niceness stays {current})"
    ]
    assert os.getpriority(os.PRIO_PROCESS, 0) == current


def test_the_knob_defaults_to_the_lowest_priority_and_checks_its_range():
    assert ServeArgs(model="m").scheduler_nice == 19
    assert ServeArgs(model="m", scheduler_nice=None).scheduler_nice is None
    with pytest.raises(ValueError):
        ServeArgs(model="m", scheduler_nice=20)
