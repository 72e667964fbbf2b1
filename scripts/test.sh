#!/usr/bin/env bash
# The test suite, plus one untimed pass over every benchmark so a broken benchmark fails too.
# Extra arguments go to pytest.
exec "$(dirname "${BASH_SOURCE[0]}")/env.sh" python -m pytest tests bench -q --benchmark-disable --durations=25 "$@"
