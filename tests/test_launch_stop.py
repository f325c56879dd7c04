"""stop_all_servers: what a SIGTERM handler calls so that no server started by running_server
outlives the run (on a GPU one would hold its memory): every live process group is stopped."""
import os
import subprocess
import sys

import pytest

from mosaickv_sglang import launch


def test_stop_all_servers_stops_every_live_group(monkeypatch):
    monkeypatch.setattr(launch, "_live_servers", set())
    # stand-ins for servers: process-group leaders with a child each (like launcher + scheduler)
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
             for _ in range(2)]
    launch._live_servers.update(procs)
    assert launch.stop_all_servers() == 2
    assert all(p.poll() is not None for p in procs)
    for p in procs:  # the whole group went, the child too
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)


_POPEN = subprocess.Popen


def _fake_server(monkeypatch, code: str) -> None:
    """running_server launches `code` (a stand-in server that never gets healthy) instead."""
    monkeypatch.setattr(launch.subprocess, "Popen",
                        lambda cmd, **kw: _POPEN([sys.executable, "-c", code], **kw))


def test_sizing_lock_is_released_once_the_pool_is_sized(tmp_path, monkeypatch):
    """A server holds the shared lock until its log says its pool is allocated, not until it is
    healthy (its warm-up overlaps the next server's start), and gives it back when it fails."""
    import threading
    import time

    lock = threading.Lock()
    _fake_server(monkeypatch, f"import time; time.sleep(1.5); print({launch.POOL_SIZED_MARKER!r}, "
                              "flush=True); time.sleep(60)")
    failure = []

    def start():
        try:
            with launch.running_server(tmp_path, tmp_path / "a.log", startup_s=8, sizing_lock=lock):
                pass
        except RuntimeError as e:
            failure.append(str(e))

    t = threading.Thread(target=start)
    t0 = time.time()
    t.start()
    time.sleep(0.5)
    assert lock.locked()  # held while the pool is being sized
    assert lock.acquire(timeout=6)  # released at the marker...
    waited = time.time() - t0
    assert 1.5 <= waited < 6 and t.is_alive() and not failure  # ...before the server is healthy
    lock.release()
    t.join()
    assert failure and "not healthy" in failure[0]

    _fake_server(monkeypatch, "raise SystemExit(3)")  # dies before sizing anything
    with pytest.raises(RuntimeError, match="exited with 3"):
        with launch.running_server(tmp_path, tmp_path / "b.log", startup_s=8, sizing_lock=lock):
            pass
    assert not lock.locked()


def test_a_sigterm_stops_the_servers_and_exits(tmp_path):
    """What a benchmark's time limit (`timeout`'s SIGTERM) does with stop_servers_on_signals:
    the stand-in server's whole group is stopped before the process exits with 128 + 15 (an
    H200 call once left three servers holding the GPU after such a limit)."""
    import signal
    import time

    pid_file = tmp_path / "server.pid"
    code = f"""
import subprocess, sys, time
from mosaickv_sglang import launch
server = subprocess.Popen(["sleep", "120"], start_new_session=True)
launch._live_servers.add(server)
open({str(pid_file)!r}, "w").write(str(server.pid))
launch.stop_servers_on_signals("bench", "; see the JSON", before=lambda: print("before"))
time.sleep(120)
"""
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and bench.poll() is None
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 128 + signal.SIGTERM
    assert out.splitlines() == ["before", "[bench] signal 15: stopped 1 server(s); see the JSON"]
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)


# a stand-in server that is healthy at once: 200 to every GET on the port given (argv[1])
HEALTHY = ("import http.server as h, sys\n"
           "class H(h.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers()\n"
           "h.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def test_running_servers_stops_the_started_one_when_another_fails(tmp_path, monkeypatch):
    """Two servers started at once: one gets healthy, the other exits; the error is raised and
    the healthy one is stopped, its whole group, not left running."""
    from pathlib import Path

    codes = {"a.log": HEALTHY, "b.log": "raise SystemExit(3)"}
    started = {}

    def popen(cmd, **kw):
        name = Path(kw["stdout"].name).name
        port = cmd[cmd.index("--port") + 1]
        started[name] = _POPEN([sys.executable, "-c", codes[name], port], **kw)
        return started[name]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with launch.running_servers((tmp_path, tmp_path / "a.log"), (tmp_path, tmp_path / "b.log"),
                                    startup_s=30):
            raise AssertionError("not both started: the body must not run")
    assert set(started) == {"a.log", "b.log"}
    assert started["a.log"].poll() is not None  # the healthy one was stopped
    with pytest.raises(ProcessLookupError):
        os.killpg(started["a.log"].pid, 0)


def test_running_servers_yields_them_in_spec_order(tmp_path, monkeypatch):
    procs = []

    def popen(cmd, **kw):
        procs.append(_POPEN([sys.executable, "-c", HEALTHY, cmd[cmd.index("--port") + 1]], **kw))
        return procs[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    with launch.running_servers(*[(tmp_path, tmp_path / f"{i}.log") for i in range(3)],
                                startup_s=30) as servers:
        assert [s.log.name for s in servers] == ["0.log", "1.log", "2.log"]
        assert len({s.url for s in servers}) == 3
    assert all(p.poll() is not None for p in procs)
