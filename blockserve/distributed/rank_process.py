"""Ranks 1..N-1 when the engine starts them itself (`distributed_executor="spawn"`): each is
`python -m blockserve.distributed.worker`, a fresh interpreter that joins over env:// as a rank on
another host does, so no rank ever imports the engine's `__main__` (a script with no
`if __name__ == "__main__":` guard, or a notebook, starts an engine like any other program).

    RankProcess(rank, size, port)   started; its stderr passed on to this process's, the last lines kept
    wait_until_joining(ranks, s)    returns once every rank has imported what it runs and is joining;
                                    RankExited at once for a rank that exits first

The engine passes `BLOCKSERVE_TP_READY_FD` (READY_FD) to the ranks it starts: a pipe each writes one
byte to just before it joins. Rank 0 enters the rendezvous (which blocks in torch, deaf to a rank's
exit) only once every rank is there, and meanwhile sees a rank that exits as its pipe's end of file.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

READY_FD = "BLOCKSERVE_TP_READY_FD"
LOOPBACK = "127.0.0.1"
_TAIL_LINES = 40  # of a rank's stderr, kept for the error that names it
_EXIT_WAIT_S = 10.0  # a rank whose ready pipe closed is exiting: how long it may take before it is killed


class RankExited(RuntimeError):
    """A rank's process ended while the engine was starting; the message names the rank, its exit
    status and the end of its stderr."""


class RankProcess:
    """Rank `rank` of `size`, joining the rendezvous rank 0 serves on loopback `port`."""

    def __init__(self, rank: int, size: int, port: int):
        self.rank = rank
        self.ready_fd, ready_for_rank = os.pipe()
        env = {**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(size), READY_FD: str(ready_for_rank)}
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "blockserve.distributed.worker"], env=env,
                                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            pass_fds=(ready_for_rank,))
        except BaseException:
            os.close(self.ready_fd)
            raise
        finally:
            os.close(ready_for_rank)
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._relay = threading.Thread(target=self._pass_on_stderr, name=f"blockserve-tp-rank{rank}-stderr",
                                       daemon=True)
        self._relay.start()

    def _pass_on_stderr(self) -> None:
        """Drained as it comes (a full pipe would stop the rank), so the rank's log reads as before."""
        with self.process.stderr as lines:
            for line in lines:
                text = line.decode(errors="replace")
                self._tail.append(text)
                if sys.stderr is not None:
                    try:
                        sys.stderr.write(text)
                        sys.stderr.flush()
                    except (OSError, ValueError):
                        pass

    def exited(self) -> bool:
        return self.process.poll() is not None

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the rank to exit, kill it past that; reaped either way."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._relay.join(1.0)
        self.close_ready()

    def close_ready(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None

    def report(self) -> str | None:
        """`rank r: <its error>` (its stderr's last line: the exception a traceback ends with) when it
        exited with a non-zero status; None while it runs or after a clean exit or a signal."""
        if not self.exited() or self.process.returncode <= 0:
            return None
        self._relay.join(1.0)
        last = next((line.strip() for line in reversed(list(self._tail)) if line.strip()), "no error on its stderr")
        return f"rank {self.rank}: {last}"

    def start_up_failure(self) -> RankExited:
        """The error for a rank that ended during start-up, once it has exited (and been reaped)."""
        self.stop(_EXIT_WAIT_S)
        status = self.process.returncode
        how = f"status {status}" if status >= 0 else f"signal {_signal_name(-status)}"
        tail = "".join(self._tail).rstrip() or "(nothing)"
        return RankExited(f"tensor-parallel rank {self.rank} exited with {how} during start-up; "
                          f"the end of its stderr:\n{tail}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def wait_until_joining(ranks: list[RankProcess], timeout_s: float) -> None:
    """Return once every rank has said it is joining; RankExited as soon as one exits before,
    TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as pending:
        for rank in ranks:
            pending.register(rank.ready_fd, selectors.EVENT_READ, rank)
        while pending.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(key.data.rank for key in pending.get_map().values())
                raise TimeoutError(f"tensor-parallel ranks {waiting} did not start within {timeout_s:g} s "
                                   "(distributed_startup_timeout_s)")
            for key, _ in pending.select(left):
                rank = key.data
                pending.unregister(key.fd)
                said = os.read(key.fd, 1)
                rank.close_ready()
                if not said:  # end of file: the rank exited before it could join
                    raise rank.start_up_failure()
