"""Each line of stdin, stamped with the seconds since this began (faults.sh, restart.sh)."""
import sys
import time

start = time.monotonic()
for line in sys.stdin:
    print(f"{time.monotonic() - start:7.1f} {line}", end="", flush=True)
