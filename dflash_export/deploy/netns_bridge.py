"""tritonserver in a network namespace of its own, reached only through a Unix socket: run as a script by
deploy/triton_process.py (standard library only, so it starts in milliseconds and imports nothing of the package).

Why: tritonserver's HTTP port must answer the front alone, and its only guard is a header given on its command line,
which every local user can read in /proc. In a new user + network namespace tritonserver's loopback is its own:
no process outside can connect to any of its ports. This process makes the namespaces (unprivileged: a user
namespace mapping only the caller's own uid and gid), brings the namespace's loopback up, starts tritonserver as its
child, and relays:
- the Unix socket `--uds` (created 0600 inside the server's 0700 work dir: the front's way in) to tritonserver's HTTP
  port;
- each listening socket it inherits (`--forward FD:PORT`, bound by `serve` outside the namespace: the metrics and
  gRPC ports a user asked for) to that port inside.
It ends when tritonserver ends, with its exit status (a signal is re-raised), and passes SIGTERM / SIGINT on to it.

`--probe`: make the namespaces and exit 0, or print why not and exit 1 (where user namespaces are disabled, `serve`
falls back to the header and says so).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def enter_private_network() -> None:
    """unshare(2) a user and a network namespace, map this uid / gid onto themselves, bring loopback up."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass


def _relay_to(port: int, whole_close: bool = False):
    """A connection handler relaying to `port` inside the namespace. `whole_close`: the client's end of stream is
    its close (the front's HTTP client never half-closes and reads nothing after it), so the connection to
    tritonserver is closed then instead of half-closed: an answer that never comes (a request on a model stub that
    died) then holds no connection that tritonserver's shutdown would wait for."""
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        try:
            if not whole_close:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
                return
            back = asyncio.ensure_future(_pump(up_reader, writer))
            await _pump(reader, up_writer)
            back.cancel()
            await asyncio.gather(back, return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                w.close()

    return relay


# The longest path a Unix socket's address holds (sun_path: 108 bytes, the terminating NUL included); files.py holds
# the same number and mechanism, which this standard-library-only script does not import.
UNIX_PATH_MAX = 107


def _bind_address(uds: str) -> tuple[str, int | None]:
    """(the address to bind the Unix socket `uds` at, a descriptor to close once bound or None): the path itself
    when it fits sun_path, else the same file reached through a descriptor on its directory (/proc/self/fd/N/NAME)."""
    if len(os.fsencode(uds)) <= UNIX_PATH_MAX:
        return uds, None
    head, name = os.path.split(uds)
    fd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{name}", fd


async def _serve(uds: str, http_port: int, forwards: list[tuple[int, int]], proc: subprocess.Popen) -> None:
    old = os.umask(0o177)
    address, fd = _bind_address(uds)
    try:
        servers = [await asyncio.start_unix_server(_relay_to(http_port, whole_close=True), path=address)]
    finally:
        os.umask(old)
        if fd is not None:
            os.close(fd)
    for fd, port in forwards:
        sock = socket.socket(fileno=fd)
        servers.append(await asyncio.start_server(_relay_to(port), sock=sock))
    while proc.poll() is None:
        await asyncio.sleep(0.1)
    for s in servers:
        s.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--probe", action="store_true")
    p.add_argument("--uds")
    p.add_argument("--port", type=int)
    p.add_argument("--forward", action="append", default=[])
    p.add_argument("command", nargs="*")
    args = p.parse_args(argv)
    try:
        enter_private_network()
    except OSError as e:
        print(f"no private network namespace: {e.strerror or e}", flush=True)
        return 1
    if args.probe:
        return 0
    forwards = [tuple(int(x) for x in f.split(":", 1)) for f in args.forward]
    proc = subprocess.Popen(args.command, stdin=subprocess.DEVNULL, close_fds=True,
                            preexec_fn=lambda: _die_with(signal.SIGKILL))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: proc.send_signal(s))
    try:
        asyncio.run(_serve(args.uds, args.port, forwards, proc))
    except OSError as e:  # the socket could not be made: nothing could reach tritonserver, so it is ended
        print(f"netns_bridge: cannot listen on the Unix socket {args.uds} ({e.strerror or e})", flush=True)
        proc.terminate()
        proc.wait()
        return 1
    finally:
        rc = proc.wait()
    if rc < 0:  # died of a signal: so does this process, for whoever reads its status
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


def _die_with(sig: int) -> None:
    """In tritonserver's child before exec: it gets `sig` when this process dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, int(sig), 0, 0, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
