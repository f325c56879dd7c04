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
