#!/usr/bin/env bash
# The test suite, plus one untimed pass over every benchmark so a broken benchmark fails too.
# Two pytest workers (pytest-xdist), a test file each at a time (--dist loadfile keeps a file's
# module fixtures, such as its server, in one process): much of the suite waits on processes
# it starts (engine cores, servers, workers) and a cold checkout spends minutes compiling numba
# kernels. Two workers on two cores (2-core Zen 3): a clean clone with empty caches took 11:38
# in all, less than one worker took with every cache warm (11:46). Extra arguments go to pytest.
exec "$(dirname "${BASH_SOURCE[0]}")/env.sh" python -m pytest tests bench -q --benchmark-disable -n 2 --dist loadfile --durations=25 "$@"
