"""One writer per output: a build or an indexing claims its output folder or bucket prefix
before it touches anything there, and gives it back when it ends.

Two runs into one output at once (a job array, a command started on every node of a shared
file system) would otherwise remove each other's files and both exit 0 over a broken
dataset. The second run is refused, naming the first; the first is not disturbed.

- A local folder: an exclusive ``flock`` on ``OUTPUT/CLAIM_FILE``. The kernel lets it go when
  the process ends, however it ends, so a killed run's claim never blocks the next one.
- A URL (object stores have no locks): the object ``CLAIM_FILE``, looked at first, then
  created only where none is there (S3's conditional write, ``If-None-Match``) and read back,
  renewed every ``RENEW_S`` by a thread, only over this run's own last write of it (``If-Match``
  on its ETag; a store without conditional writes: looked at, then written). A claim not
  renewed for ``STALE_S`` (by the store's clock: hosts' clocks may differ) is a killed run's,
  and the next run takes it over; a run whose claim was taken over (it was suspended that
  long) stops before its next upload, and before its index is written, leaving the output
  to the other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from mimo_data.shards import storage
from mimo_data.shards.format import CLAIM_FILE, CLAIM_PROBE

RENEW_S = 30.0       # a URL's claim is renewed this often
STALE_S = 300.0      # and is a killed run's once not renewed for this long
READ_BACK_S = 1.0    # a new claim is read back after this, to be sure no other run's replaced it
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputBusy(Exception):
    """Another run writes into the output, or took it over from this one."""


class OutputUnwritable(Exception):
    """The output folder takes no claim: it takes no writes (read-only, no permission)."""


@dataclass(frozen=True)
class Claimant:
    """What a claim file says of the run holding it."""
    token: str
    command: str
    host: str
    pid: int
    started: float
    renewed: float

    def said(self) -> str:
        return (f"{self.command} (pid {self.pid} on {self.host.partition(' ')[0]}, started "
                f"{_when(self.started)})")

    def encoded(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _decoded(data: bytes) -> Claimant | None:
    try:
        return Claimant(**json.loads(data))
    except (ValueError, TypeError):       # empty (a lock file not written yet) or not ours
        return None


def _busy(output: str, holder: Claimant | None, lapses_in: float | None = None
          ) -> OutputBusy:
    """``output`` held by ``holder``; ``lapses_in``: seconds until a URL's claim lapses
    where it is not renewed (a killed run's)."""
    who = holder.said() if holder else "another mimo-shard run"
    if lapses_in is None:           # a folder's lock: gone with its holder
        return OutputBusy(f"{output} is being written by {who}; wait for it to end, or choose "
                          "another --output")
    lapse = ("its claim lapses in about " + (f"{math.ceil(lapses_in)} s" if lapses_in < 120
                                                else f"{round(lapses_in / 60)} minutes") +
             f", at {_when(time.time() + lapses_in)} by this host's clock")
    claim = storage.join(output, CLAIM_FILE)
    if holder is not None and _ended(holder):
        return OutputBusy(f"{output} was being written by {who}, which has ended without "
                          f"giving its claim back (killed, or stopped by an error): {lapse}; "
                          f"build again then (or now, once you delete {claim}), or choose "
                          "another --output")
    return OutputBusy(f"{output} is being written by {who}; wait for it to end (if it was "
                      f"killed, {lapse}; if you are sure it is no longer running, delete "
                      f"{claim}), or choose another --output")


def _ended(holder: Claimant) -> bool:
    """Whether ``holder`` ran on this host, in a process that is gone."""
    return holder.host == this_host() and not _alive(holder.pid)


def this_host() -> str:
    """This host as a claim names it: its name, then (Linux) its process-id namespace and
    boot: containers of one host name (a pod on the host's network) and a host rebooted
    since are other hosts, whose pids this process cannot look up. In the one ``host`` field
    an earlier mimo reads (a field more would make it read the claim as none)."""
    where = []
    for path, read in (("/proc/self/ns/pid", os.readlink),
                       ("/proc/sys/kernel/random/boot_id", _first_line)):
        try:
            where.append(read(path))
        except OSError:         # not Linux: the name alone
            return socket.gethostname()
    return " ".join([socket.gethostname(), *where])


def _first_line(path: str) -> str:
    with open(path) as file:
        return file.readline().strip()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's
        return True
    return True


class Claim:
    """A run's hold on its output; :meth:`confirm` before each upload and before the index."""

    def __init__(self, output: str, remote: storage.Remote | None, mine: Claimant):
        self.output, self.remote, self.mine = output, remote, mine
        self._url = storage.join(output, CLAIM_FILE)
        self.lost = False
        # the claim an earlier run left there, not removed: that run was killed (what it
        # wrote is a killed run's leftover); None where there was none
        self.killed: Claimant | None = None
        self._wrote = False               # (a take refused before its write removes nothing)
        self._taken_by: Claimant | None = None
        self._etag: str | None = None     # of this run's last write of its claim (S3's)
        self._stop = threading.Event()
        self._renewing = threading.Thread(target=self._renew, daemon=True, name="mimo-claim")

    def confirm(self) -> None:
        """OutputBusy where another run took the output over (a URL's claim only)."""
        if self.remote is None:
            return
        if not self.lost:
            holder = _read(self.remote, self._url)
            if holder is None or holder.token != self.mine.token:
                self.lost, self._taken_by = True, holder
        if self.lost and self._taken_by is None:
            raise OutputBusy(
                f"this run's claim {self._url} is gone (deleted, or the bucket or its prefix "
                "was removed or reset meanwhile): it stopped without writing an index; look at "
                f"{self.output}, then build again")
        if self.lost:
            raise OutputBusy(
                f"{self._taken_by.said() if self._taken_by else 'another run'} took over "
                f"{self.output}, replacing this run's claim (a claim not renewed for "
                f"{STALE_S / 60:g} minutes is taken over: was this run suspended?); it stopped "
                "without writing an index and leaves the output to the other")

    def _renew(self) -> None:
        """The renewing thread of a URL's claim: until stopped or taken over."""
        while not self._stop.wait(RENEW_S):
            try:
                self._renew_once()
            except OutputBusy:
                return
            except Exception:     # the store is away: the next renewal, or confirm, tells
                continue

    def _renew_once(self) -> None:
        """Write the claim again with the time of now. Where the store takes conditional
        writes (S3's If-Match), only over this run's last write of it: a claim another run
        wrote meanwhile is never overwritten (looked at, then written, it could be, and both
        runs would go on writing the output)."""
        assert self.remote is not None
        data = Claimant(**{**asdict(self.mine), "renewed": time.time()}).encoded()
        if self._etag:
            try:
                etag = self.remote.replace(self._url, data, self._etag)
            except NotImplementedError:     # the store takes no If-Match: looked at, then written
                self._etag = None
            else:
                if etag is None:            # written again or removed since this run's write
                    self.confirm()          # OutputBusy where another run's claim is there
                    etag = self.remote.written(self._url)[1]  # ours: a retried write landed
                self._etag = etag or None
                return
        self.confirm()
        self.remote.write(self._url, data)

    def take(self) -> None:
        """Claim the URL: OutputBusy where another run holds it; then renew it until
        :meth:`end`."""
        assert self.remote is not None
        remote, url, mine = self.remote, self._url, self.mine
        # looked at first, and created only where none is (a store that ignores the
        # condition writes anyway: the look is then what refuses a running build's output)
        holder = _read(remote, url)
        etag = remote.create(url, mine.encoded()) if holder is None else None
        if holder is None and etag is None:
            holder = _read(remote, url)     # another's, made since the look (or ours, retried)
            if holder is None:              # an object no mimo claim reads as: replaced
                etag = remote.write(url, mine.encoded())
            elif holder.token == mine.token:
                etag = remote.written(url)[1]
        if holder is not None and holder.token != mine.token:
            age, stale = self._age(holder)
            # a claim of this host's (and process-id namespace's) whose process is gone
            # lapses once two renewals are missed: a live run renews it meanwhile
            ended = _ended(holder)
            lapse = min(2 * RENEW_S, STALE_S) if ended else STALE_S
            if age < lapse:
                raise _busy(self.output, holder, lapses_in=lapse - age)
            print(f"mimo-shard: taking over {self.output} from {holder.said()}, whose claim "
                  f"was last renewed {f'{age:.0f} s' if age < 120 else f'{age / 60:.0f} minutes'}"
                  f" ago ({'its process has ended' if ended else 'it was killed'})",
                  file=sys.stderr)
            etag = self._take_over(stale)
            self.killed = holder
        self._wrote, self._etag = True, etag or None
        time.sleep(READ_BACK_S)
        holder = _read(remote, url)
        if holder is None or holder.token != mine.token:
            raise _busy(self.output, holder, lapses_in=STALE_S)
        self._renewing.start()

    def _take_over(self, stale: str | None) -> str | None:
        """Write this run's claim over the stale one whose ETag is ``stale``: only over that
        one where the store takes If-Match (another run that took it over first is not
        overwritten: OutputBusy); this claim's ETag."""
        assert self.remote is not None
        data = self.mine.encoded()
        if stale:
            try:
                etag = self.remote.replace(self._url, data, stale)
            except NotImplementedError:
                pass
            else:
                if etag is None:
                    raise _busy(self.output, _read(self.remote, self._url), lapses_in=STALE_S)
                return etag
        return self.remote.write(self._url, data)

    def _age(self, holder: Claimant) -> tuple[float, str | None]:
        """Seconds since ``holder`` last renewed its claim, and the claim's ETag (None where
        the store says none): by the store's clock where the store says when objects were
        written (the claim's and a probe's written now: hosts' clocks may differ by more than
        ``STALE_S``), else by the holder's and this host's."""
        assert self.remote is not None
        probe = storage.join(self.output, CLAIM_PROBE + self.mine.token)
        try:
            self.remote.write(probe, b"")
            (now, _), (then, etag) = self.remote.written(probe), self.remote.written(self._url)
        finally:
            self.remote.remove(probe)
        if now is None or then is None:
            return time.time() - holder.renewed, etag
        return now - then, etag

    def end(self) -> None:
        """Stop renewing, then remove the URL's claim where it is still this run's (a take
        that failed midway included)."""
        assert self.remote is not None
        self._stop.set()
        if self._renewing.ident is not None:
            self._renewing.join()     # no renewal after the removal
        if self._wrote and not self.lost:
            try:
                self.confirm()
                self.remote.remove(self._url)
            except (OutputBusy, OSError):   # taken over, or the store away: it lapses
                pass


@contextmanager
def held(output: str, command: str, remote: storage.Remote | None = None) -> Iterator[Claim]:
    """Claim ``output`` (a local folder that exists, or with ``remote`` a URL) for ``command``
    while the block runs. OutputBusy where another run holds it. Writing a URL's claim is the
    run's first write there: a missing bucket raises FileNotFoundError before anything else."""
    now = time.time()
    mine = Claimant(uuid.uuid4().hex, command, this_host(), os.getpid(), now, now)
    claim = Claim(output, remote, mine)
    if remote is None:
        with _locked(output, mine) as claim.killed:
            yield claim
        return
    try:
        claim.take()
        yield claim
    finally:
        claim.end()


@contextmanager
def _locked(folder: str, mine: Claimant) -> Iterator[Claimant | None]:
    """``folder`` locked for ``mine``; yields the claim a killed run left in its file (a
    run that ends otherwise removes it), if any."""
    path = os.path.join(folder, CLAIM_FILE)
    fd = _lock(folder, path)
    if fd is None:
        yield None
        return
    try:
        killed = _decoded(os.pread(fd, 4096, 0))
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encoded(), 0)
        yield killed
    finally:
        try:
            os.remove(path)   # while locked: a run that opened it meanwhile tries again
        except FileNotFoundError:
            pass
        os.close(fd)


def _lock(folder: str, path: str) -> int | None:
    """An open descriptor of ``path``, exclusively locked; None where the file system takes
    no locks (said)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputUnwritable(f"cannot write into --output {folder}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _decoded(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _busy(folder, holder) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKS:
                raise
            if not os.path.getsize(path):    # (made just now: not left in the dataset)
                os.remove(path)
            print(f"mimo-shard: {folder}'s file system takes no locks ({exc.strerror}): a "
                  "second run into it at the same time would not be refused", file=sys.stderr)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)          # its holder removed it between our open and our lock: again


def _read(remote: storage.Remote, url: str) -> Claimant | None:
    try:
        return _decoded(remote.read(url))
    except FileNotFoundError:
        return None
