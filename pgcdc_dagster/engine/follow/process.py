"""A command's head start on a follow (:func:`head_start`, :func:`adopt`): on threads, or in a
follower in a process of its own while the command runs Dagster.

Why: ``pgcdc catchup`` and ``follow`` start following at once (:mod:`..control.head_start`) while
the command's main thread imports Dagster, its storage and the definitions (a fresh process:
seconds of pure Python), opens the instance, creates the run and records every range's events.
On threads, the follower's receive and apply share one interpreter lock with all of that; in a
forked process they do not. So a cold command's follow on threads is clearly slower than the
engine's follow alone, and in a process of its own it comes close to it. Warm (the command
server's child, Dagster already imported), the backlog cut into growing ranges
(:func:`~.follower.backlog_range_bytes`) gains in a process and nothing on threads (more run
events on the same lock). The figures: ``benchmarks/HISTORY.md``, "The follow's range shaping"
and "The follower in a process of its own".

How: :class:`ProcessFollower` forks; the child runs an ordinary :class:`~.follower.Follower` and
sends each range it applies, its progress reports and, at the end, its summary and error (if
any) up a pipe; a stop goes down another. In the parent it behaves as the follower does
(:meth:`run`, :meth:`stop`, :meth:`close`, :attr:`summary`), so the run adopts it unchanged.

What must hold:

* The child dies with its parent (``PR_SET_PDEATHSIG`` SIGKILL): a killed command stays a
  crash, and never leaves a follower working without the range lock the parent held.
* The parent holds the range lock until the child has ended (:meth:`close` waits for it), as
  for a follower on threads.
* The child touches nothing of the parent's: not its connections (the range lock's), not its
  terminal display, not its locks. It is forked before the Dagster instance is opened, from the
  main thread (the parent-death signal follows the thread that forked), writes only to its
  pipe, and leaves with ``os._exit``, so no finaliser runs on what it inherited.
* A child killed by SIGKILL (a failpoint, the OOM killer) takes the command with it, exactly as
  when the follower ran on threads: what is durable is resumed by the next command.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import struct
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from .. import progress
from ..control import head_start as head_starts
from ..control.pipeline import SparkProvider
from ..control.range_lock import lent_lock
from ..errors import PgcdcError
from ..lsn import Lsn
from ..processes import fresh_standard_streams
from ..settings import ReplicationSettings
from .backlog import Backlog
from .follower import END, Follower, Following, FollowSummary, done_ranges, track, untrack

_PR_SET_PDEATHSIG = 1
PACE = "\x00pace "
"""How a line down the stop pipe asks for a pace (:meth:`ProcessFollower.pace`) instead of a
stop (a stop's reason is text, never starting with NUL)."""
_HEADER = struct.Struct("!I")


class FollowProcessError(PgcdcError):
    """The follow process ended without saying how (it died), or its error could not be sent."""


class ProcessFollower:
    """A :class:`~.follower.Follower`, not yet started, run in a forked child process. Start it
    from the main thread, before the process opens a connection of Dagster's or starts threads
    that take locks (the command server's child has one, blocked in ``recv``)."""

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        """Not started here: the child runs it, on its copy of this process."""
        self.interrupts = follower.interrupts
        self.summary = FollowSummary()
        self.stopping = False
        self.pid = 0
        self._stop_fd = -1
        self._done = Backlog()
        self._errors: list[BaseException] = []
        self._reader: threading.Thread | None = None

    # -- the parent's side ---------------------------------------------------------------------

    def start(self) -> ProcessFollower:
        """Fork the follower (idempotent)."""
        if self.pid:
            return self
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(up_r)
            os.close(down_w)
            _child(self, parent, up_w, down_r)
        os.close(up_w)
        os.close(down_r)
        self.pid = pid
        self._stop_fd = down_w
        track(self)
        self._reader = threading.Thread(
            target=self._read, args=(up_r,), name="pgcdc-follow-process", daemon=True
        )
        self._reader.start()
        return self

    def stop(self, reason: str) -> None:
        """Stop at the next range boundary. Safe from a signal handler (one ``write``)."""
        self.stopping = True
        if self._stop_fd >= 0:
            with contextlib.suppress(OSError):  # the child has ended already
                os.write(self._stop_fd, reason.replace("\n", " ").encode()[:200] + b"\n")

    def pace(self, min_cut_s: float) -> None:
        """As :meth:`.follower.Follower.pace`, in the child (a line down the stop pipe)."""
        if self._stop_fd >= 0:
            with contextlib.suppress(OSError):  # the child has ended already
                os.write(self._stop_fd, f"{PACE}{min_cut_s:.3f}\n".encode())

    @property
    def endpos(self) -> Lsn | None:
        return self.follower.endpos

    def run(self, idle_s: float | None = None) -> Iterator[Any]:
        """As :meth:`.follower.Follower.run`: every range as it is applied, until the end."""
        self.start()
        try:
            yield from done_ranges(self._done, self.interrupts, self.stop, idle_s)
        finally:
            self.close(self.summary.stopped_by or "closed")
            self._done.close()
        if self._errors:
            raise self._errors[0]

    def close(self, reason: str) -> None:
        """Stop at the next range boundary and wait for the child to end there."""
        self.stop(reason)
        while self._reader is not None and self._reader.is_alive():
            try:
                self._reader.join(timeout=0.2)
            except self.interrupts:
                continue  # already stopping: let the child finish the boundary
        if self._stop_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._stop_fd)
            self._stop_fd = -1
        untrack(self)

    def _read(self, fd: int) -> None:
        """Take the child's messages until it closes its pipe, then reap it."""
        ended = False
        try:
            with open(fd, "rb", buffering=1 << 16) as pipe:
                while (header := pipe.read(_HEADER.size)) and len(header) == _HEADER.size:
                    kind, payload = pickle.loads(pipe.read(_HEADER.unpack(header)[0]))
                    if kind == "done":
                        self._done.put(payload)
                    elif kind == "progress":
                        progress.publish(payload)
                    elif kind == "end":
                        self.summary, error = payload
                        if error is not None:
                            self._errors.append(error)
                        ended = True
        except Exception as exc:  # a torn message: the child died while writing
            self._errors.append(FollowProcessError(f"the follow process' report was cut: {exc}"))
        _, status = os.waitpid(self.pid, 0)
        if not ended:
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash of the command, as on threads
            self._errors.append(
                FollowProcessError(
                    f"the follow process {self.pid} died ({_describe(status)}); "
                    "run the command again: it resumes from what is durable"
                )
            )
        self._done.put(END)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


# -- the child's side ---------------------------------------------------------------------------


def _child(spec: ProcessFollower, parent: int, up: int, down: int) -> None:
    """Run the follower and report up the pipe; leave with ``os._exit`` whatever happens."""
    code = 0
    try:
        _die_with(parent)
        fresh_standard_streams()  # a thread of the parent may have held the old ones' locks
        lock = threading.Lock()

        def send(kind: str, payload: Any) -> None:
            data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
            with lock:
                os.write(up, _HEADER.pack(len(data)))
                view = memoryview(data)
                while view:
                    view = view[os.write(up, view) :]

        progress.forward_only(lambda report: send("progress", report))
        follower = spec.follower

        def stop_on(signum: int, frame: Any) -> None:
            follower.stop(f"stopped by {signal.Signals(signum).name}")

        for sig in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C reaches both of us
            signal.signal(sig, stop_on)
        threading.Thread(target=_stops_from, args=(down, follower), daemon=True).start()
        error: BaseException | None = None
        try:
            for followed in follower.run():
                send("done", followed)
        except BaseException as exc:  # sent to the parent, raised there
            error = exc
        send("end", (follower.summary, _portable(error)))
    except BaseException:
        code = 70
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
    os._exit(code)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent exits, however it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(70)


def _stops_from(fd: int, follower: Follower) -> None:
    """Each line from the parent is a stop, or a pace (:data:`PACE`); its end (the parent
    closed it, or died) is a stop too."""
    with open(fd, "rb") as pipe:
        for line in pipe:
            said = line.decode(errors="replace").strip()
            if said.startswith(PACE):
                with contextlib.suppress(ValueError):
                    follower.pace(float(said.removeprefix(PACE)))
                continue
            follower.stop(said or "stopped")
    follower.stop("the command ended")


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling as itself, else one that says the same."""
    if error is None:
        return None
    with contextlib.suppress(Exception):
        again = pickle.loads(pickle.dumps(error))
        if type(again) is type(error) and str(again) == str(error):
            return error
    if isinstance(error, PgcdcError):
        return PgcdcError(str(error))
    detail = "".join(traceback.format_exception(error)).rstrip()
    return FollowProcessError(f"the follow process failed: {detail}")


def head_start(
    settings: ReplicationSettings,
    endpos: Lsn | None,
    spark: SparkProvider,
    *,
    own_process: bool = False,
) -> Following:
    """Start following now, for this process's follow run to :func:`adopt` once it exists
    (see :mod:`..control.head_start`). The caller holds the range lock, lent to that run, until the
    follower has ended. ``own_process``: in a forked child, for a caller whose interpreter has
    other work, Dagster's imports and run (:class:`ProcessFollower`; Linux only, elsewhere on
    threads)."""
    lent = lent_lock(settings.target_dsn, settings.slot)
    threaded = Follower(
        settings, endpos, spark=spark, lock_session=lent.session_pid if lent else None
    )
    follower: Following = threaded
    if own_process and sys.platform.startswith("linux"):  # it needs a parent-death signal
        follower = ProcessFollower(threaded)
    follower.start()
    head_starts.offer("follow", settings.slot, follower)
    return follower


def adopt(slot: str) -> Following | None:
    """The follower :func:`head_start` started in this process for ``slot`` (a
    :class:`~.follower.Follower` or a :class:`ProcessFollower`), once."""
    follower = head_starts.adopt("follow", slot)
    return follower if isinstance(follower, Follower | ProcessFollower) else None
