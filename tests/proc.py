"""What /proc says about a service's processes: the ports they listen on and their command lines."""

from __future__ import annotations

import contextlib
import os


def listening_ports(pid: int) -> list[int]:
    """The TCP ports of the listening sockets process ``pid`` holds, each as often as it holds one
    (from /proc: the process's socket inodes matched against the kernel's socket tables)."""
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.append(target[8:-1])
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return sorted(listening[inode] for inode in inodes if inode in listening)


def command_line(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as raw:
        return raw.read().decode(errors="replace").split("\0")[:-1]


def assert_forked_holding_their_own_listener(
    supervisor: int, port: int, front_ends: list[int]
) -> None:
    """Each front end forked from the supervisor (it runs the supervisor's command line, where a
    spawned one runs multiprocessing's), holding one listener, its own, of what the supervisor had."""
    for pid in front_ends:
        assert command_line(pid) == command_line(supervisor), command_line(pid)
        assert listening_ports(pid) == [port], (pid, listening_ports(pid))
