"""Start CPU rank processes by forking a process that has already imported Megatron-LM.

A rank of ``cpu_runner`` spends most of its start-up importing torch and Megatron-LM and answering
the CUDA calls (``apply_cuda_answers``: about 5 of the 7 s a two-rank, two-iteration run takes on
a quiet core). A test session launches Megatron-LM's loop about a hundred times, always from the
same checkout with the same environment, so a *zygote* does those steps once and forks each rank
from that state.

What a forked rank shares with its zygote is exactly what a fresh rank has done before its
per-run steps: the interpreter, ``sys.path`` with the script's directory first, and
``apply_cuda_answers()``. Everything that depends on the run happens in the child, as in a fresh
rank: its environment (``RANK``, ``MASTER_PORT``, ...), the iteration record, the TSP launcher's
hooks and the script itself (``cpu_runner._rank_main``). The TSP hooks are installed after the
zygote's imports, as they are after ``apply_cuda_answers``'s imports in a fresh rank, and the
script's own modules (``gpt_builders``, ``model_provider``) are imported only in the child, so a
hook that a module binds at import is bound as in a fresh rank.

A zygote serves one (interpreter, script directory, environment without the per-rank variables):
the environment is read at import by torch and Megatron-LM, so runs that differ in it get their
own zygote. The zygote must be single-threaded when it forks; if its imports started a thread it
says so and ``cpu_runner`` starts fresh processes instead. ``TSP_CPU_RUNNER_FORK=0`` turns the
zygote off.

The zygote is ``python -m megatron_tsp.megatron_lm.cpu_runner --cpu-runner-zygote SCRIPT``
(``serve`` with cpu_runner's preparation and rank worker; this module imports nothing of the
package). Protocol (JSON lines): the launcher writes ``{"argv", "env", "cwd", "log"}`` per rank
and reads ``{"pid"}``; the zygote writes ``{"exit": pid, "code": returncode}`` when a rank ends
(it is the ranks' parent, so it reaps them). The zygote exits when its stdin closes.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Callable, Dict, List, Optional, Sequence

FORK_ENV = "TSP_CPU_RUNNER_FORK"
ZYGOTE_FLAG = "--cpu-runner-zygote"
MAX_ZYGOTES = 2


def enabled() -> bool:
    return os.environ.get(FORK_ENV, "1") != "0" and hasattr(os, "fork")


# --------------------------------------------------------------------------------------------
# Inside the zygote
# --------------------------------------------------------------------------------------------


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _start_rank(request: dict, protocol_fds: List[int], run: Callable[[List[str]], int]) -> None:
    """In the forked child: become the rank the request describes, ``run`` its argv, exit."""
    code = 1
    try:
        for fd in protocol_fds:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0], *request["argv"]]
        code = run(list(request["argv"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code if isinstance(code, int) else 1)


def serve(script: str, prepare: Callable[[], object], run: Callable[[List[str]], int]) -> int:
    """The zygote's main loop: ``prepare()`` once (with the script's directory first on
    ``sys.path``), then fork a rank that calls ``run(argv)`` per request. ``cpu_runner`` runs it
    in the process it starts with ``ZYGOTE_FLAG`` (``prepare``: ``apply_cuda_answers``, ``run``:
    its rank worker)."""
    # the protocol keeps private copies of stdin/stdout; stray prints of the imports go to stderr
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(proto_out, "w", buffering=1)

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    prepare()
    threads = _thread_count()
    send({"ready": threads == 1, "threads": threads})
    if threads != 1:
        return 0
    buffer = b""
    children = set()
    while True:
        readable, _, _ = select.select([proto_in], [], [], 0.05 if children else 1.0)
        if readable:
            chunk = os.read(proto_in, 1 << 16)
            if not chunk:
                return 0
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _start_rank(request, [proto_in, proto_out], run)
                children.add(pid)
                send({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# --------------------------------------------------------------------------------------------
# In the launcher
# --------------------------------------------------------------------------------------------


class ForkedRank:
    """A rank forked by a zygote, with the part of ``subprocess.Popen`` that ``cpu_runner``
    uses (``poll``, ``kill``, ``wait``)."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> Optional[int]:
        return self.zygote.exit_codes.get(self.pid)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        with self.zygote.changed:
            self.zygote.changed.wait_for(
                lambda: self.pid in self.zygote.exit_codes or not self.zygote.alive(), timeout
            )
        return self.poll()


class Zygote:
    """One zygote process (see the module docstring) and the thread reading its replies."""

    def __init__(self, python: str, script: str, env: Dict[str, str]):
        self.stderr = tempfile.NamedTemporaryFile(prefix="tsp_rank_zygote_", suffix=".log")
        self.proc = subprocess.Popen(
            [python, "-m", "megatron_tsp.megatron_lm.cpu_runner", ZYGOTE_FLAG, script],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        self.exit_codes: Dict[int, int] = {}
        self.replies: List[dict] = []
        self.changed = threading.Condition()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        hello = self._next_reply(timeout=600)
        self.ready = bool(hello and hello.get("ready"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "exit" in message:
                    self.exit_codes[message["exit"]] = message["code"]
                else:
                    self.replies.append(message)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _next_reply(self, timeout: float) -> Optional[dict]:
        with self.changed:
            self.changed.wait_for(lambda: self.replies or not self.alive(), timeout)
            return self.replies.pop(0) if self.replies else None

    def start(self, argv: List[str], env: Dict[str, str], log: str) -> ForkedRank:
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log}
        with self.lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._next_reply(timeout=60)
        if not reply or "pid" not in reply:
            raise RuntimeError(f"rank zygote did not start a rank; its log: {self.stderr.name}")
        return ForkedRank(self, reply["pid"])

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        self.stderr.close()


_ZYGOTES: Dict[tuple, Zygote] = {}
_CANNOT_FORK: set = set()  # keys whose zygote was not single-threaded after its imports


def zygote_for(
    python: str, script: str, env: Dict[str, str], per_run: Sequence[str]
) -> Optional[Zygote]:
    """The zygote serving runs of ``script`` under ``python`` with ``env`` (a rank's environment,
    without the variables named in ``per_run``, which each rank sets for itself), started on
    first use; None where forking is off or the zygote cannot fork safely (the caller then
    starts fresh processes)."""
    if not enabled():
        return None
    base = {k: v for k, v in env.items() if k not in per_run}
    key = (python, os.path.dirname(os.path.abspath(script)), tuple(sorted(base.items())))
    if key in _CANNOT_FORK:
        return None
    zygote = _ZYGOTES.get(key)
    if zygote is not None and not zygote.alive():
        zygote.close()
        del _ZYGOTES[key]
        zygote = None
    if zygote is None:
        while len(_ZYGOTES) >= MAX_ZYGOTES:
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        zygote = _ZYGOTES[key] = Zygote(python, script, base)
    else:  # most recently used last
        _ZYGOTES[key] = _ZYGOTES.pop(key)
    if not zygote.ready:
        _CANNOT_FORK.add(key)
        _ZYGOTES.pop(key).close()
        return None
    return zygote if zygote.alive() else None


def close_all() -> None:
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


atexit.register(close_all)
