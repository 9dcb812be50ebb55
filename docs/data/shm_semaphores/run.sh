#!/usr/bin/env bash
# Our ctypes semaphores against posix_ipc's (bench.py says what each row measures).
# Run on a quiet machine: the ping-pong row is two processes waking each other, and
# anything else on the cores shows in it. From the repository's root:
#   pip install posix-ipc
#   bash docs/data/shm_semaphores/run.sh          # 7 trials each; writes results.txt here
# Arguments go to bench.py (a quick check: --trials 1 --round-trips 500 --calls 5000).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
{
    echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(uname -sr), $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# $(python -c 'import posix_ipc; print("posix_ipc", posix_ipc.VERSION)')"
    echo "# python docs/data/shm_semaphores/bench.py $*"
    python "$here/bench.py" "$@"
} | tee "$here/results.txt"
