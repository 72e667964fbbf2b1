#!/usr/bin/env bash
# The main job: offline generation on the built-in tiny model, printing completions and throughput.
exec "$(dirname "${BASH_SOURCE[0]}")/env.sh" mrv2 generate "$@"
