import os
import sys

# Spawned ranks import test modules by name: make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))

# MPICH keeps its shared memory in /dev/shm/mpich_shm_* and removes it at exit; ranks
# the tests kill on purpose leave theirs behind. Removed at the end of the session:
# those that appeared during it and that no live process still maps. Only where the
# whole session ends (not in a pytest-xdist worker, while others may still start
# MPICH jobs), and only on a system with /dev/shm and /proc.
SHM = "/dev/shm"


def _mpich_segments():
    try:
        return {name for name in os.listdir(SHM) if name.startswith("mpich_shm_")}
    except OSError:
        return set()


def _mapped(paths):
    """Those of `paths` that some live process maps."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = maps.read()
            found.update(path for path in paths if path in mapped)
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def pytest_sessionstart(session):
    session.config.mpich_segments_before = _mpich_segments()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "mpich_segments_before", None)
    if before is None or hasattr(session.config, "workerinput") or not os.path.isdir("/proc"):
        return
    new = {os.path.join(SHM, name) for name in _mpich_segments() - before}
    for path in (new - _mapped(new)) if new else ():
        try:
            os.unlink(path)
        except OSError:
            pass
