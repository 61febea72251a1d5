"""Private network namespaces for partition tests: a bridge in a "hub" namespace and one veth
per member namespace, so that one member can be cut off (its link downed: packets vanish, no
RST) and healed again. Addresses (10.213.13.0/24) exist only inside these namespaces; nothing
is configured in the caller's namespace. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN).

Code joins a namespace per thread (`setns` affects only the calling thread), and processes a
thread spawns inherit its namespace, so devkit classes run unchanged inside `Netns.run`.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
SUBNET = "10.213.13"
_CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """None if namespaces can be created here, else why not."""
    name = f"mcpool-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot create network namespaces here ({e})"
    return None


class Netns:
    """Namespaces <tag>-hub (bridge) and <tag>-<member>, member i at 10.213.13.<i+1>."""

    def __init__(self, members: list[str]) -> None:
        self.tag = f"mcp{os.getpid() % 100000}"
        self.members = {m: f"{SUBNET}.{i + 1}" for i, m in enumerate(members)}
        self.hub = f"{self.tag}-hub"
        self._created: list[str] = []

    def ns(self, member: str) -> str:
        return f"{self.tag}-{member}"

    def address(self, member: str) -> str:
        return self.members[member]

    def _hub_end(self, member: str) -> str:
        return f"{self.tag[:6]}{list(self.members).index(member)}h"

    def create(self) -> Netns:
        try:
            for name in (self.hub, *map(self.ns, self.members)):
                _ip("netns", "add", name)
                self._created.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, member in enumerate(self.members):
                hub_end, inner = self._hub_end(member), f"{self.tag[:6]}{i}m"
                _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name",
                    inner, "netns", self.ns(member))
                _ip("-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
                _ip("-n", self.ns(member), "addr", "add", f"{self.address(member)}/24", "dev",
                    inner)
                _ip("-n", self.ns(member), "link", "set", inner, "up")
        except BaseException:
            self.remove()
            raise
        return self

    def partition(self, member: str) -> None:
        """Cut `member` off: its bridge port goes down, its packets are dropped silently."""
        _ip("-n", self.hub, "link", "set", self._hub_end(member), "down")

    def heal(self, member: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_end(member), "up")

    def run(self, member: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a thread inside `member`'s namespace (its sockets and children stay
        there); re-raises what fn raised."""
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                fd = os.open(f"/var/run/netns/{self.ns(member)}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns failed")
                finally:
                    os.close(fd)
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        t = threading.Thread(target=body, name=f"netns-{member}")
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def remove(self) -> None:
        """Delete every namespace created (their veths and addresses go with them)."""
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._created.clear()
