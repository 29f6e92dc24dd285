"""``mimo_data.worker_pool``: the worker processes of build, index, verify and report.

Each test starts one pool of one or two workers from this process's forkserver: a worker that
dies is an error naming what it held, never a wait or a short result; an early stop kills a
blocked worker; errors and the caller's environment reach across.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def _square_or_die(x: int) -> int:
    if x == 7:      # as the out-of-memory killer ends a worker
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def test_pool_results_are_bounded_by_a_window_and_a_dead_worker_is_an_error():
    # Pool.imap read all its input at once and kept every result until consumed: with a slow
    # writer (build's, index's), results piled up. ordered_map submits `window` ahead.
    from mimo_data.worker_pool import WorkerDied, ordered_map
    pulled = []

    def items():
        for i in range(1000):
            pulled.append(i)
            yield i
    results = ordered_map(_square_or_die, items(), workers=1, window=4)
    assert [next(results) for _ in range(7)] == [i * i for i in range(7)]
    assert len(pulled) <= 7 + 4
    # a multiprocessing.Pool lost a killed worker's item and waited for it forever (a CI run
    # hung 90 minutes on a worker's segfault): the pool breaks, the items in flight are named
    # (10 is submitted after 6 is consumed: the worker may have died on 7 before)
    with pytest.raises(WorkerDied, match=r"\(killed by SIGKILL: most often the out-of-memory "
                       r"killer\) while it had one of [34] item\(s\) in flight: 7, 8, 9(, 10)?$"):
        next(results)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie); a process reaped between the open and the read
    makes the read fail with ESRCH."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _pid(path: str) -> int:
    with open(path, "w") as file:
        file.write(str(os.getpid()))
    return os.getpid()


def test_a_worker_killed_between_items_is_an_error_not_a_short_result(tmp_path):
    # the one worker is killed after its first item, before the second is handed over: the
    # pool may break before or after that hand-over (a broken pool refused it, and the
    # results ended short, silently), and either way the caller hears of it
    import time

    from mimo_data.worker_pool import WorkerDied, ordered_map
    marker = tmp_path / "pid"

    def items():
        yield str(marker)
        while not marker.exists():      # the worker has written its pid (its result is next)
            time.sleep(0.01)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.01)
        time.sleep(0.5)     # the executor most likely sees the death before the hand-over
        yield str(tmp_path / "never")
    results = ordered_map(_pid, items(), workers=1, window=1, advice="run it again")
    assert next(results) == int(marker.read_text())
    with pytest.raises(WorkerDied, match=r"killed by SIGKILL.*/never and those after it were "
                       r"not done; run it again$"):
        next(results)


def _read(path: str) -> bytes:
    if path.endswith("fifo"):       # the test waits for this worker to reach the FIFO
        with open(path + ".pid", "w") as file:
            file.write(str(os.getpid()))
    with open(path, "rb") as file:      # a FIFO no one writes: blocks forever
        return file.read()


def test_a_consumer_that_stops_early_does_not_wait_for_a_blocked_worker(tmp_path):
    # a --strict stop or a writer's error while a worker is blocked on a read (a hung mount,
    # a FIFO given as a medium): the pool's shutdown waited for that read forever
    import threading
    import time

    from mimo_data.worker_pool import ordered_map
    plain, fifo = tmp_path / "plain", tmp_path / "fifo"
    plain.write_bytes(b"x")
    os.mkfifo(fifo)
    results = ordered_map(_read, [str(plain), str(fifo)], workers=2, window=2)
    assert next(results) == b"x"
    marker = tmp_path / "fifo.pid"
    for _ in range(12000):          # a hang guard (2 minutes): the worker is at the FIFO
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.01)
    reader = int(marker.read_text())
    closing = threading.Thread(target=results.close, daemon=True)
    closing.start()
    closing.join(timeout=120)       # a hang guard: the workers are killed, not awaited
    assert not closing.is_alive(), "closing the pool waited for a worker blocked on a read"
    for _ in range(12000):          # a hang guard: a killed worker is gone in milliseconds
        if not _alive(reader):
            return
        time.sleep(0.01)
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))   # frees it, so the test ends
    raise AssertionError("the worker blocked on the FIFO outlived the pool's close")


def _seen(name: str) -> tuple[str | None, str]:
    return os.environ.get(name), os.getcwd()


def _refuse(detail: str) -> None:
    from mimo_data.shards.records import RecordError
    raise RecordError("bad_record", detail)


def test_a_workers_counted_error_reaches_the_caller_as_itself():
    # CountedError's pickle (Exception's: its args, the detail alone) could not be rebuilt: the
    # pool broke and a skip of a record was reported as a worker killed by the OOM killer
    from mimo_data.shards.records import RecordError
    from mimo_data.worker_pool import ordered_map
    with pytest.raises(RecordError) as raised:
        list(ordered_map(_refuse, ["the detail"], workers=1, window=1))
    assert (raised.value.reason, raised.value.detail) == ("bad_record", "the detail")


def test_pool_workers_see_the_callers_environment_and_folder(tmp_path, monkeypatch):
    # the workers fork from the forkserver, started once a process with the environment and
    # folder of then: a credential or relative path set later must reach them as a fork's would
    from mimo_data.worker_pool import ordered_map
    assert list(ordered_map(_seen, ["MIMO_TEST_SEEN"], workers=1, window=1))[0][0] is None
    monkeypatch.setenv("MIMO_TEST_SEEN", "later")
    monkeypatch.chdir(tmp_path)
    assert list(ordered_map(_seen, ["MIMO_TEST_SEEN"], workers=1, window=1)) == [
        ("later", str(tmp_path))]


_SLOW_IMPORT = '''
import os, time
if os.getpid() != int(os.environ["CALLER"]):        # the forkserver, importing this now
    open(os.environ["IMPORTING"], "w").close()
    while not os.path.exists(os.environ["GO_ON"]):
        time.sleep(0.01)


def double(x):
    return 2 * x
'''

_CALLER = '''
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)   # (a background job inherits it off)
os.environ["CALLER"] = str(os.getpid())
from mimo_data.worker_pool import ordered_map
import slow_import
try:
    print(list(ordered_map(slow_import.double, range(3), 1, 2)))
except KeyboardInterrupt:
    sys.stderr.write("interrupted\\n")
'''


def test_ctrl_c_while_the_forkserver_imports_is_the_callers_alone(tmp_path):
    """Ctrl-C at a terminal signals the whole process group: the forkserver, still importing
    the workers' module, ignores it (it printed a KeyboardInterrupt traceback under the
    caller's one line); the caller stops as it chooses. The module's import waits until the
    caller has ended."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    (tmp_path / "slow_import.py").write_text(_SLOW_IMPORT)
    importing, go_on = tmp_path / "importing", tmp_path / "go-on"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "IMPORTING": str(importing), "GO_ON": str(go_on),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}
    process = subprocess.Popen([sys.executable, "-c", _CALLER], cwd=tmp_path, env=env,
                               start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not importing.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the forkserver never imported the module"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGINT)
        process.wait(60)            # (its import outlasts the caller, as torch's does a build)
        go_on.touch()
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # (the fork request the forkserver serves once its import is done finds the ended
    # caller's semaphores gone, quietly: forkserver_hook)
    assert err == "interrupted\n", err



_INTERRUPTED_SPAWN = '''
import multiprocessing.popen_forkserver as popen
import os, sys, time
if __name__ == "__mp_main__":       # the worker, reading its process object: slowly
    time.sleep(1)
launch = popen.Popen._launch


def interrupted(self, process):     # Ctrl-C just as the forkserver has forked a worker
    launch(self, process)
    raise KeyboardInterrupt


if __name__ == "__main__":          # (the worker imports no mimo module: the forkserver's
    from mimo_data.worker_pool import ordered_map   # preload alone gives it the hook)
    popen.Popen._launch = interrupted
    try:
        print(list(ordered_map(abs, range(3), 1, 2)))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\\n")
'''


def test_ctrl_c_as_a_worker_starts_is_the_callers_alone(tmp_path):
    """Ctrl-C between the forkserver's fork of a worker and the pool's record of it: the
    caller ends, removing its semaphores, before the worker reads them (here the worker is
    slow to); the worker printed a FileNotFoundError traceback under the caller's one line.
    (Its stderr is the caller's: the run ends once the worker has.)"""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "caller.py").write_text(_INTERRUPTED_SPAWN)
    done = subprocess.run([sys.executable, str(tmp_path / "caller.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.stderr == "interrupted\n", done.stderr


_SECOND_CTRL_C = '''
import multiprocessing.process
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)   # (a background job inherits it off)
from mimo_data.worker_pool import ordered_map
terminate = multiprocessing.process.BaseProcess.terminate
fired = []


def impatient(self):                # Ctrl-C again while the first one's stop ends the workers
    # (once, from the stop itself: the executor's own thread may end a worker later, after it)
    if not fired and threading.current_thread() is threading.main_thread():
        fired.append(True)
        os.kill(os.getpid(), signal.SIGINT)
    terminate(self)


if __name__ == "__main__":
    multiprocessing.process.BaseProcess.terminate = impatient
    results = ordered_map(abs, range(-5, 0), 1, 2)
    print(next(results))
    results.close()                 # the consumer stops early: the pool is stopped
    print("stopped")
'''


def test_a_second_ctrl_c_does_not_break_off_the_stop(tmp_path):
    """A second Ctrl-C (``timeout`` passes its signal on; an impatient user) while a stopped
    pool ends its workers: ignored, not a KeyboardInterrupt traceback from the pool's
    shutdown with workers left running."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "caller.py").write_text(_SECOND_CTRL_C)
    done = subprocess.run([sys.executable, str(tmp_path / "caller.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert (done.stdout, done.stderr) == ("5\nstopped\n", ""), done
    # (the Ctrl-C was sent: without the stop's ignoring it, the traceback is its)


_CTRL_C_AT_START = r'''
import os, signal, time
from multiprocessing import forkserver
from mimo_data import forkserver_hook, worker_pool

# Python's own handler, as a command at a terminal has it (one started in the background of
# a script, as CI runs the suite, inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
before = os.environ.get(forkserver_hook.CALLER_VARIABLE)
started = forkserver.ensure_running
servers = []


def ctrl_c_meanwhile():
    os.kill(os.getpid(), signal.SIGINT)
    started()
    servers.append(forkserver._forkserver._forkserver_pid)


forkserver.ensure_running = ctrl_c_meanwhile
try:
    worker_pool._start_forkserver()
    time.sleep(1)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      os.environ.get(forkserver_hook.CALLER_VARIABLE) == before,
      signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, []))
if servers and servers[0] is not None:      # the forkserver holds SIGINT blocked or ignored
    status = open(f"/proc/{servers[0]}/status").read()
    held = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
            if line.startswith(("SigBlk", "SigIgn"))}
    print(bool((held["SigBlk"] | held["SigIgn"]) & (1 << (signal.SIGINT - 1))))
else:
    print(True)
'''


def test_ctrl_c_while_the_forkserver_starts_is_not_lost(tmp_path):
    """_start_forkserver set SIGINT to SIG_IGN in the caller while the forkserver started, so
    a Ctrl-C in that window was discarded: the build ran on to the end (exit 0). It is to
    interrupt the caller (its handler, its signal mask and environment as they were), and the
    forkserver is still not to take it (blocked there). In a process of its own, with Python's
    SIGINT handler: the suite may run with SIGINT ignored (a script's background job)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "caller.py").write_text(_CTRL_C_AT_START)
    done = subprocess.run([sys.executable, str(tmp_path / "caller.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.stdout.split() == ["interrupted", "True", "True", "True", "True"], done
