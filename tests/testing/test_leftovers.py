"""engine_leftovers: a live child process and an engine-named /dev/shm segment are reported,
entries that existed before are not, nor a semaphore another process holds, and nothing is once
they are gone."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

from mrv2.testing.leftovers import (engine_leftovers, new_engine_entries, process_alive,
                                    semaphore_holders, wait_for_no_leftovers)


def test_reports_a_live_worker_and_an_engine_segment_until_they_are_gone():
    before = set(os.listdir("/dev/shm"))
    worker = mp.get_context("spawn").Process(target=time.sleep, args=(30,))
    worker.start()
    shm = shared_memory.SharedMemory(name=f"mrv2_{os.getpid()}_leftover_test", create=True,
                                     size=64)
    try:
        assert process_alive(worker.pid)
        left = engine_leftovers([worker.pid], [], before)
        assert f"process {worker.pid}" in left and f"/dev/shm/{shm.name}" in left
        # Entries older than the engine are not its leftovers.
        assert f"/dev/shm/{shm.name}" not in engine_leftovers([], [], before | {shm.name})
    finally:
        worker.kill()
        worker.join()
        shm.close()
        shm.unlink()
    assert not process_alive(worker.pid)
    wait_for_no_leftovers([worker.pid], [shm.name], before, within_s=1.0)


def test_a_semaphore_another_process_holds_open_is_not_this_engines():
    """Semaphore names carry no pid: one this process holds counts as new, one a process
    outside the engine holds open (another test worker's) does not."""
    before = set(os.listdir("/dev/shm"))
    other = subprocess.Popen(
        [sys.executable, "-c", "import multiprocessing as mp, time\n"
         "lock = mp.get_context('spawn').Lock()\nprint(lock._semlock.name, flush=True)\n"
         "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    own = mp.get_context("spawn").Lock()
    try:
        theirs = "sem." + other.stdout.readline().strip().lstrip("/")
        mine = "sem." + own._semlock.name.lstrip("/")
        assert theirs in os.listdir("/dev/shm")
        assert semaphore_holders(theirs) == {other.pid}
        left = engine_leftovers([], [], before)
        assert f"/dev/shm/{mine}" in left and f"/dev/shm/{theirs}" not in left
        assert mine in new_engine_entries(before) and theirs not in new_engine_entries(before)
        assert mine not in new_engine_entries(before, semaphores=False)
    finally:
        other.kill()
        other.wait()
        del own
