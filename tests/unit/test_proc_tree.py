"""scripts.bench.proc_tree on live processes: a busy child is found below this process, named
by its command line, and its CPU time shows in the per-kind cores of an interval."""

import subprocess
import sys
import time

from scripts.bench import proc_tree


def test_a_busy_child_shows_up_with_its_cpu():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.2)
        before, wall = proc_tree.cpu_seconds(child.pid), time.perf_counter()
        time.sleep(0.6)
        after = proc_tree.cpu_seconds(child.pid)
        cores = proc_tree.cpu_by_kind(before, after, time.perf_counter() - wall)
        assert child.pid in proc_tree.descendants(child.pid) and set(after) == {child.pid}
        assert list(cores) == ["python -c"]
        assert 0.5 < cores["python -c"] <= 1.05  # one busy thread: about one core
        assert proc_tree.peak_rss_mb(child.pid)["peak_rss_mb"] > 1
    finally:
        child.kill()
        child.wait()
