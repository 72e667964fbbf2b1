"""What an engine with worker processes can leave behind after it stops or dies: running
worker processes, and its /dev/shm segments and semaphores. For the tests that kill workers
and check that shutdown cleaned up."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Collection


def process_alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def semaphore_holders(name: str) -> set[int]:
    """The live processes that have the named semaphore `/dev/shm/<name>` mapped (an open
    POSIX semaphore is a mapping of its file; glibc creates it under a temporary name and
    links it, so the mapping is found by inode, not by name). Semaphore names carry no pid,
    so this is how a semaphore another test worker holds open (the suite runs in parallel)
    is told apart from one this engine left."""
    try:
        inode = str(os.stat(f"/dev/shm/{name}").st_ino)
    except FileNotFoundError:
        return set()
    holders = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[4] == inode and \
                            fields[5].startswith("/dev/shm/"):
                        holders.add(int(entry))
                        break
        except OSError:  # gone, or not ours to read
            continue
    return holders


def foreign_semaphore(name: str, own_pids: Collection[int]) -> bool:
    """A semaphore held open by a live process outside `own_pids` (another test's)."""
    return bool(semaphore_holders(name) - set(own_pids))


def engine_leftovers(worker_pids: Collection[int], shm_names: Collection[str],
                     shm_before: Collection[str] | None = None) -> list[str]:
    """Worker processes still running, and /dev/shm entries of this engine still there: its
    queues' segments (`shm_names`) and any segment named after this process or a worker
    (`mrv2_<pid>_...`). With `shm_before` (the entries before the engine started), only
    entries created since count, and new semaphores count too, except those another process
    holds open."""
    own_pids = (os.getpid(), *worker_pids)
    owners = tuple(f"mrv2_{pid}_" for pid in own_pids)
    entries = set(os.listdir("/dev/shm"))
    if shm_before is not None:
        entries -= set(shm_before) - set(shm_names)
    ours = sorted(n for n in entries if n in shm_names or n.startswith(owners)
                  or (shm_before is not None and n.startswith("sem.")
                      and not foreign_semaphore(n, own_pids)))
    return ([f"process {pid}" for pid in worker_pids if process_alive(pid)]
            + [f"process {p.pid} ({p.name})" for p in mp.active_children()
               if p.pid in worker_pids] + [f"/dev/shm/{n}" for n in ours])


def new_engine_entries(before: Collection[str], semaphores: bool = True) -> list[str]:
    """The /dev/shm entries created since `before` that this process's engines may have left:
    their segments (`mrv2_<pid>_`: this process's, or a process no longer alive, its
    workers') and, with `semaphores`, semaphores no other process holds open. A live
    process's other than this one is another test worker's engine (the suite runs in
    parallel), not a leftover here (CI runs failed on another worker's semaphores and
    segments)."""
    def ours(name: str) -> bool:
        if name.startswith("sem."):
            return semaphores and not foreign_semaphore(name, (os.getpid(),))
        pid = name.split("_")[1] if name.startswith("mrv2_") else ""
        return pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid)))
    return sorted(n for n in set(os.listdir("/dev/shm")) - set(before) if ours(n))


def lasting_engine_entries(before: Collection[str], within_s: float = 3.0,
                           semaphores: bool = True) -> list[str]:
    """`new_engine_entries` still there after up to `within_s`: a process another test
    worker killed is dead, so its segments look like this process's until its parent
    unlinks them a moment later; a leak of this process's lasts."""
    deadline = time.monotonic() + within_s
    while (left := new_engine_entries(before, semaphores)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_for_no_leftovers(worker_pids: Collection[int], shm_names: Collection[str],
                          shm_before: Collection[str] | None = None,
                          within_s: float = 5.0) -> None:
    """AssertionError naming what is still there after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while (left := engine_leftovers(worker_pids, shm_names, shm_before)) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left behind: {left}"
