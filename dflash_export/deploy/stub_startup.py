"""Run by a model stub's interpreter as it starts, before any model is imported (copied into the stub environment
as `dflash_stub_startup.py` and imported by its .pth file, deploy/triton_install.py `make_stub_env`): closes the
sockets the stub inherited from tritonserver. Standard library only; it does nothing in any other process.

tritonserver's python backend starts a stub with fork + exec and closes no descriptor in between, and tritonserver
opens its accepted HTTP connections and its internal socket pairs without close-on-exec. A stub started while
tritonserver serves (a model reloaded after its stub died) therefore holds a copy of every such socket open at that
moment, among them the repository-API connection that asked for the load: when tritonserver closes one, the copy
keeps the connection open (CLOSE_WAIT, its peer never told) for the stub's whole life. The stub itself talks to
tritonserver through shared memory and has no socket of its own when its interpreter starts, so every socket
descriptor it has then is one of those copies.
"""

import os
import stat

STUB_NAME = "triton_python_backend_stub"


def close_inherited_sockets() -> list[int]:
    """In a stub process: close every socket descriptor above stderr; the descriptors closed."""
    try:
        if os.path.basename(os.readlink("/proc/self/exe")) != STUB_NAME:
            return []
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: not the Linux stub this is for
        return []
    closed = []
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
                closed.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return closed


CLOSED = close_inherited_sockets()
