"""A stand-in for ssh that "logs in" to an emulated host: it enters its namespaces.

MPICH's mpiexec starts one proxy per host with `ssh [options] HOST COMMAND...`; with
HYDRA_LAUNCHER_EXEC pointing here (job.start_mpirun does that), the same call runs
COMMAND on the emulated HOST instead. As ssh does, the command's words are joined with
spaces and run by a shell, and ssh's own options (-x, -o ...) are skipped. Before it
enters the host, it joins the host's cgroups (its CPU share, its pauses: cgroups.py),
as every process of that host does.

    python -m collectives.cluster.rsh STATE_DIR [-x] node1 hydra_pmi_proxy --control-port ...
"""
from __future__ import annotations

import json
import os
import sys

from .cgroups import CgroupError, join

SSH_OPTIONS_WITH_VALUE = {"-o", "-p", "-l", "-i", "-F", "-J", "-c", "-m", "-b", "-E"}


def main(argv) -> int:
    state_dir, args = argv[0], list(argv[1:])
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option in SSH_OPTIONS_WITH_VALUE and args:
            args.pop(0)
    if len(args) < 2:
        print("collectives.cluster.rsh: usage: rsh STATE_DIR [options] HOST COMMAND...",
              file=sys.stderr)
        return 255
    host, command = args[0], " ".join(args[1:])
    with open(os.path.join(state_dir, "state.json")) as file:
        state = json.load(file)
    hosts = state["hosts"]
    by_address = {entry["address"]: name for name, entry in hosts.items()}
    name = host if host in hosts else by_address.get(host)
    if name is None:
        print(f"collectives.cluster.rsh: no emulated host {host!r} (hosts: "
              f"{', '.join(hosts)})", file=sys.stderr)
        return 255
    entry = hosts[name]
    # We run on another host (mpiexec's, whose /sys hides the cgroups): the groups are
    # reached through the launcher's view of the files.
    try:
        join(entry.get("cgroups", []), through_pid=state["owner"])
    except CgroupError as error:
        print(f"collectives.cluster.rsh: {error}", file=sys.stderr)
        return 255
    os.execvp("nsenter", ["nsenter", f"--uts={entry['uts']}", "ip", "netns", "exec",
                          entry["netns"], "sh", "-c", command])
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
