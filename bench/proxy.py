"""A TCP delay proxy for the Mooncake master's RPC port, run as its own process.

Why a separate process: `MooncakeDistributedStore.setup()` holds the GIL while it talks to the
master, so a proxy thread inside the benchmark process would deadlock it. Why threads and
`time.sleep` instead of asyncio: event-loop timers round up to whole milliseconds, which would
turn a 0.1 ms one-way delay into 1 ms; `time.sleep` uses clock_nanosleep.

Each direction of each connection has a reader (stamps every chunk with its due time, now +
one-way delay) and a writer (sleeps until the chunk is due, then sends it), so back-to-back RPCs
are pipelined like on a real link instead of being serialised by the delay. An optional
bandwidth cap adds serialisation time per chunk (bytes / rate) on top of the delay.

    python -m bench.proxy --target 127.0.0.1:50051 --rtt-ms 1.0 [--listen-port 0] [--mbps 100]

prints `LISTENING <port>` once it accepts connections.

For fault tests, each line on its stdin sets the mode (`DelayProxy.set_mode`): `forward` (the
default); `drop`, a black hole that keeps every connection open and discards what is sent either
way (a request lost this way is never retransmitted, so its call waits for its RPC timeout even
after `forward` again; the line `dropped` answers `DROPPED <n>`, the chunks discarded so far);
or `garbage:<kind>`, where each new connection gets one canned HTTP
answer from `GARBAGE` (an etcd gateway answering nonsense) while open ones keep forwarding.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HOST = "127.0.0.1"
_CHUNK = 1 << 16
_mode = "forward"  # set from stdin by _read_modes
_dropped = 0  # chunks discarded in `drop` mode

# Answers a broken etcd gateway may give: no HTTP at all, a body cut short, JSON of the wrong
# shape, and a master view that is not host:port.
_VIEW = '{"kvs": [{"key": "eA==", "value": "bm8tcG9ydC1oZXJl"}]}'  # value: b64("no-port-here")
GARBAGE = {
    "status": b"garbage\r\n\r\n",
    "incomplete": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"kvs\": [",
    "shape": b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{\"kvs\": [{}]}",
    "view": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_VIEW), _VIEW.encode()),
}


def _pump(src: socket.socket, dst: socket.socket, one_way_s: float, bytes_per_s: float) -> None:
    """Forward src -> dst, delaying each chunk by one_way_s (and its serialisation time)."""
    pending: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def reader() -> None:
        global _dropped
        try:
            while data := src.recv(_CHUNK):
                if _mode != "drop":
                    pending.put((time.perf_counter() + one_way_s, data))
                else:
                    _dropped += 1
        except OSError:
            pass
        pending.put(None)

    threading.Thread(target=reader, daemon=True).start()
    link_free = 0.0  # when the emulated link finishes sending the previous chunk
    try:
        while (item := pending.get()) is not None:
            due, data = item
            if bytes_per_s > 0:
                link_free = max(due, link_free) + len(data) / bytes_per_s
                due = link_free
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _handle(client: socket.socket, target: tuple[str, int], one_way_s: float,
            bytes_per_s: float) -> None:
    if _mode.startswith("garbage:"):
        try:
            client.recv(_CHUNK)  # the request
            client.sendall(GARBAGE[_mode.split(":", 1)[1]])
        except OSError:
            pass
        client.close()
        return
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=_pump, args=(a, b, one_way_s, bytes_per_s), daemon=True).start()


def _read_modes() -> None:
    global _mode
    for line in sys.stdin:
        if line.strip() == "dropped":
            print(f"DROPPED {_dropped}", flush=True)
            continue
        _mode = line.strip()
        print(f"MODE {_mode}", flush=True)


def serve(listen_port: int, target: tuple[str, int], rtt_ms: float, mbps: float) -> None:
    """Accept connections forever; each gets its own pair of delayed pumps."""
    threading.Thread(target=_read_modes, daemon=True).start()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((HOST, listen_port))
    srv.listen(128)
    print(f"LISTENING {srv.getsockname()[1]}", flush=True)
    one_way_s, bytes_per_s = rtt_ms / 2e3, mbps * 1e6 / 8
    while True:
        conn, _ = srv.accept()
        _handle(conn, target, one_way_s, bytes_per_s)


@dataclass
class DelayProxy:
    """The proxy as a child process (its own session, so it can be killed as a group)."""

    target: str
    rtt_ms: float
    mbps: float = 0.0
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> DelayProxy:
        cmd = [sys.executable, "-m", "bench.proxy", "--target", self.target,
               "--rtt-ms", str(self.rtt_ms), "--mbps", str(self.mbps)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     cwd=os.path.dirname(os.path.dirname(__file__)))
        line = self.proc.stdout.readline() if self.proc.stdout else ""  # "" if it died
        if not line.startswith("LISTENING"):
            self.stop()
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def set_mode(self, mode: str) -> None:
        """`forward`, `drop` or `garbage:<kind>` (see the module doc); returns once it applies."""
        assert mode in ("forward", "drop") or mode.removeprefix("garbage:") in GARBAGE, mode
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == f"MODE {mode}"

    def dropped(self) -> int:
        """How many chunks `drop` mode has discarded (a request sent into the black hole)."""
        self.proc.stdin.write("dropped\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().removeprefix("DROPPED "))

    def stop(self) -> None:
        from devkit.processes import stop_process

        stop_process(self.proc)
        self.proc = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="host:port to forward to")
    p.add_argument("--rtt-ms", type=float, default=1.0, help="added round trip, split evenly")
    p.add_argument("--mbps", type=float, default=0.0, help="bandwidth cap per direction (0=off)")
    p.add_argument("--listen-port", type=int, default=0)
    a = p.parse_args()
    host, port = a.target.rsplit(":", 1)
    serve(a.listen_port, (host, int(port)), a.rtt_ms, a.mbps)


if __name__ == "__main__":
    main()
