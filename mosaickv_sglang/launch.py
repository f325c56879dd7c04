"""Start/stop a real SGLang server (a child process group, always torn down) and talk to it.

Used by the demo, the accuracy runner and the end-to-end tests. On a CPU machine the MosaicKV
CPU platform is switched on (``MOSAICKV_CPU_PLATFORM=1``); start-up is 20-70 s on two cores.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from .assets.smollm2 import DEFAULT_OUT as SMOLLM2


def server_env() -> dict:
    """The environment for a server child: the CPU platform unless a GPU is present."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["MOSAICKV_CPU_PLATFORM"] = "1"
    env.pop("SGLANG_PLUGINS", None)
    return env


PORT_BASE, PORT_SPAN = 20000, 2000  # below Linux's ephemeral range (32768+)
_ports_given: set[int] = set()
_ports_lock = threading.Lock()
_live_servers: set[subprocess.Popen] = set()  # started by running_server, not yet stopped


def _bindable(port: int) -> bool:
    """Whether a server could bind `port` now. SO_REUSEADDR as uvicorn sets it: a port whose
    last server was killed keeps its connections in TIME_WAIT for a minute, which refuses a plain
    bind but not the server's; only a live listener refuses both."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PORT_TRIES = 16  # ports tried in each span before the next one


def free_port() -> int:
    """A free HTTP port for a server, PORT_SPAN apart from every other one this process gave.

    SGLang binds its HTTP port only after loading the model, and meanwhile its processes take
    kernel-chosen ports (NCCL / torch.distributed, from the ephemeral range) and, with DP
    attention, port + 233 on: a kernel-chosen free port handed to servers that start together
    was taken by another server's internal port before its owner bound it (the 2-GPU machine:
    "address already in use", one server lost). Hence ports below the ephemeral range (32768+),
    PORT_SPAN apart, each span tried at PORT_TRIES places (another process may hold one)."""
    with _ports_lock:
        for base in range(PORT_BASE, 32768 - PORT_SPAN, PORT_SPAN):
            if base in _ports_given:
                continue
            for k in range(PORT_TRIES):  # distinct per process, same span
                port = base + (os.getpid() + 37 * k) % (PORT_SPAN // 2)
                if _bindable(port):
                    _ports_given.add(base)
                    return port
    raise RuntimeError(f"no free port left in {PORT_BASE}..32768 (step {PORT_SPAN}, "
                       f"{PORT_TRIES} tries a span): {len(_ports_given)} servers of this process "
                       "hold one, every other try was bound by a listener")


def release_port(port: int) -> None:
    """Give back free_port's span once its server has stopped."""
    with _ports_lock:
        _ports_given.discard(port - (port - PORT_BASE) % PORT_SPAN)


def request(url: str, payload: dict | None = None, timeout: float = 900.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
        try:
            return resp.status, json.loads(raw or b"null")
        except json.JSONDecodeError:
            return resp.status, raw.decode()


def _children(pid: int) -> list:
    """The processes below `pid` that a SIGTERM stops (psutil, an SGLang dependency): not
    Python's multiprocessing resource tracker, which ignores it and exits with its parent."""
    import psutil
    out = []
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "multiprocessing.resource_tracker" not in " ".join(child.cmdline()):
                    out.append(child)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


def _running(procs: list) -> list:
    """Those of `procs` still running (not exited, nor a zombie waiting for its parent)."""
    import psutil
    alive = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (launcher, scheduler, detokenizer, daemon workers),
    then SIGKILL it. The wait ends when the launcher exits or, sooner, when every process below
    it has exited: SGLang's launcher then only sleeps 5 s "before crash diagnostics" (0.5.17),
    which cost each server of the CPU suite 5 of its 6 s to stop."""
    if proc.poll() is None:
        below = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 30
        while proc.poll() is None and time.time() < deadline:
            if not _running(below):  # exited (a zombie until the launcher reaps it) or gone
                try:
                    proc.wait(timeout=0.3)  # a launcher that exits by itself, let it
                except subprocess.TimeoutExpired:
                    pass
                break
            time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def stop_all_servers() -> int:
    """Stop every server running_server started and has not stopped yet (for a signal handler
    that must not leave servers holding the GPU when threads still use them); returns how many."""
    with _ports_lock:
        procs = list(_live_servers)
    for proc in procs:  # signal all first, so their shutdowns overlap (stop waits up to 30 s)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        stop(proc)
    return len(procs)


def stop_servers_on_signals(tag: str, note: str = "", before=None) -> None:
    """SIGTERM (e.g. `timeout`) or Ctrl-C: stop every server running_server started, then exit
    at once (threads still waiting on those servers are not joined). Without it a time limit
    killed the benchmark and left its servers holding the GPU (they run in their own sessions):
    the next call on that machine ran out of memory. `before()` runs first."""
    def handler(signum, _frame) -> None:
        if before is not None:
            before()
        n = stop_all_servers()
        print(f"[{tag}] signal {signum}: stopped {n} server(s){note}", flush=True)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


# SGLang 0.5.17 logs this once the KV pool is allocated: the end of the window in which a server
# sizes its pool from the GPU memory free (free at its start vs free after its weights), which a
# server starting beside it would disturb.
POOL_SIZED_MARKER = "Memory pool end"


@contextmanager
def running_server(model: Path, log: Path, *args: str, startup_s: float = 300,
                   sizing_lock: threading.Lock | None = None):
    """Yield SimpleNamespace(url, log, proc) for `python -m sglang.launch_server` with args.

    `sizing_lock`, shared by servers started at once on one GPU, is held from the launch until
    this server's pool is allocated (POOL_SIZED_MARKER in its log, or it is healthy, or it
    failed), so each sizes its pool with the others' pools already in place, while their
    warm-ups (most of a start) overlap."""
    if sizing_lock is not None:
        sizing_lock.acquire()
    holding = sizing_lock is not None

    def release():
        nonlocal holding
        if holding:
            holding = False
            sizing_lock.release()

    try:
        port = free_port()
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=server_env(),
                                    start_new_session=True)
    except BaseException:
        release()
        raise
    with _ports_lock:
        _live_servers.add(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if holding and POOL_SIZED_MARKER in log.read_text(errors="replace"):
                release()
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if request(f"{url}/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy after {startup_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        release()
        yield SimpleNamespace(url=url, log=log, proc=proc)
    finally:
        release()
        stop(proc)
        with _ports_lock:
            _live_servers.discard(proc)
        release_port(port)


@contextmanager
def running_servers(*specs: tuple, startup_s: float = 300):
    """Several `running_server`s started at once (each spec: (model, log, *args)), yielded as a
    list in spec order once all are healthy; all are stopped on exit, and if one fails to start
    the others started are stopped before its error is raised. On a 2-core CPU two start-ups
    (~27 s each, mostly single-threaded imports) overlap to ~30 s."""
    from concurrent.futures import ThreadPoolExecutor

    entered: list = [None] * len(specs)

    def start(i: int):
        model, log, *args = specs[i]
        cm = running_server(model, log, *args, startup_s=startup_s)
        srv = cm.__enter__()
        entered[i] = cm
        return srv

    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(start, i) for i in range(len(specs))]
        servers = [f.result() for f in futures]  # the first start-up error, if any
        yield servers
    finally:
        for cm in entered:
            if cm is not None:
                cm.__exit__(None, None, None)


def flush_cache(url: str, timeout_s: float = 60) -> None:
    """/flush_cache succeeds only once the scheduler is idle: retry until then."""
    deadline = time.time() + timeout_s
    while True:
        try:
            request(f"{url}/flush_cache")
            return
        except urllib.error.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(1)


def mosaickv_stats(url: str) -> dict:
    _, info = request(f"{url}/get_server_info")
    return info["internal_states"][0]["mosaickv"]
