"""Process liveness, the one definition every sweep and watchdog of the runtime uses."""

from __future__ import annotations


def pid_alive(pid: int) -> bool:
    """Is process `pid` running (in this pid namespace)? A zombie (killed, not yet reaped) counts as dead.

    Reads /proc/{pid}/stat rather than `os.kill(pid, 0)`: a killed child that its parent has not reaped yet still
    answers the signal probe, but its files are orphaned all the same.
    """
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def pid_exited(pid: int) -> bool:
    """Has every thread of process `pid` finished, so that its files (sockets, mappings) are closed?

    Stricter than `not pid_alive(pid)`: when a multi-threaded process is killed, its main thread turns zombie
    first while the other threads are still exiting and its file table, listening sockets included, is still
    open. A zombie is done only when no thread besides the main one is left.
    """
    if pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            threads = next((line for line in f if line.startswith(b"Threads:")), b"Threads: 1")
    except (FileNotFoundError, ProcessLookupError):
        return True
    return int(threads.split()[1]) <= 1
