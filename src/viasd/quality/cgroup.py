"""Total memory for a sandbox run: a cgroup v2 of its own under this process's (memory.max for
the program and all its children together, pids.max), where one can be made."""

from __future__ import annotations

import os
import sys

_memory_cap: str | None = None


def memory_cap_mode() -> str:
    """How the sandbox caps memory, probed once: "cgroup" (a cgroup v2 under this process's own,
    with memory.max = the run's limit for the program and all its children together, and pids.max),
    or "rlimit" (no writable cgroup v2 with the memory controller here: RLIMIT_AS per process plus
    RLIMIT_NPROC 32, so at most 32 x the limit in total)."""
    global _memory_cap
    if _memory_cap is None:
        probe = new_cgroup(64)
        _memory_cap = "cgroup" if probe is not None else "rlimit"
        remove_cgroup(probe)
    return _memory_cap


def _own_cgroup() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        with open("/proc/self/mounts") as f:
            mount = next((line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]), None)
    except OSError:
        return None
    if rel is None or mount is None:
        return None
    return os.path.join(mount, rel.lstrip("/"))


def new_cgroup(memory_mb: int) -> str | None:
    """A fresh cgroup v2 for one run (memory.max, pids.max), or None where none can be made."""
    if _memory_cap == "rlimit":
        return None
    parent = _own_cgroup()
    if parent is None:
        return None
    try:
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return None
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if "memory" not in enabled:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")  # refused (EBUSY) where the parent holds processes: then no cgroup
        import secrets

        path = os.path.join(parent, f"viasd-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(path)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(memory_mb << 20))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            with open(os.path.join(path, "memory.swap.max"), "w") as f:
                f.write("0")
        if os.path.exists(os.path.join(path, "pids.max")):
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write("64")
        return path
    except OSError:
        remove_cgroup(path)
        return None


def kill_cgroup(path: str | None) -> None:
    if path is not None and os.path.exists(os.path.join(path, "cgroup.kill")):
        try:
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass


def remove_cgroup(path: str | None) -> None:
    if path is None:
        return
    for _ in range(50):  # rmdir waits for the kernel to finish reaping the members
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            import time

            time.sleep(0.02)
