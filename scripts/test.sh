#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest.
exec "$(dirname "${BASH_SOURCE[0]}")/env.sh" python -m pytest tests -q "$@"
