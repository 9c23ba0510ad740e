"""The `tritonserver` binary shipped in the `nvidia-pytriton` wheel, and the environment it and its python backend stub
run with (what `triton_process.TritonServer` starts).

The wheel carries the server, the python backend and one python-backend stub per CPython minor version; the stub has to
match the interpreter whose packages the models import, and it links `libpython3.X.so`. Three things make that work:

- a private backend directory whose `python/` holds the backend library plus the stub for *this* Python (the backend
  looks for `triton_python_backend_stub` next to its own library);
- `LD_LIBRARY_PATH` with this interpreter's own lib directory first (a system libpython of the same version otherwise
  wins and brings a foreign standard library), then the wheel's bundled libraries;
- this environment's site-packages and the project root on the stub's `sys.path`: the stub's embedded interpreter
  ignores PYTHONPATH, takes its prefix from `python3` on PATH, and imports numpy before any model code runs; so PATH
  starts with a throw-away venv (`make_stub_env`) whose site-packages leads to the right packages (its .pth file
  first closes the sockets a stub inherits from tritonserver, deploy/stub_startup.py).

The stubs in nvidia-pytriton 0.7 were compiled against numpy 1 (pybind11 without numpy-2 support): under numpy 2 they
misread every tensor buffer (BYTES inputs crash the stub, outputs come back with wrong sizes). When this environment
has numpy >= 2, the stub gets a private numpy 1 directory (exactly STUB_NUMPY) first on its path (installed once
with pip into `stub_site_dir()`, by `./dev setup`); onnxruntime, torch and tokenizers built for numpy 2 run on numpy
1.26 (numpy's ABI is backward compatible at run time), and the served outputs are checked against direct engine calls
in tests/test_deploy_server.py.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from dflash_export.deploy.repository import stub_python_path
from dflash_export.environment import env_dir
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.files import cache_root


@dataclass
class TritonInstall:
    """Where the pieces of the wheel's tritonserver live."""

    binary: Path
    python_backend: Path        # directory holding libtriton_python.so + triton_python_backend_utils.py
    stub: Path                  # triton_python_backend_stub built for this interpreter's minor version
    lib_dirs: list[Path]        # bundled shared libraries the binary and the stub need


def find_triton() -> TritonInstall:
    """Locate tritonserver in the installed `nvidia-pytriton` wheel; MissingDependency naming what is absent."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("the tritonserver binary comes with nvidia-pytriton: pip install --no-deps "
                                "nvidia-pytriton", field="nvidia-pytriton")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        lib_dirs=[d for d in (root / "lib", root.parent.parent / "nvidia_pytriton.libs") if d.is_dir()],
    )
    for path in (install.binary, install.python_backend / "libtriton_python.so", install.stub):
        if not path.is_file():
            raise MissingDependency(f"not found in the nvidia-pytriton wheel (Python {version} supported?)",
                                    path=path)
    if not os.access(install.binary, os.X_OK):
        raise MissingDependency("tritonserver is not executable here (its file mode, or a noexec mount); reinstall "
                                "nvidia-pytriton", path=install.binary)
    return install


def python_lib_dir() -> Path:
    """The directory holding this interpreter's own libpython (a venv points back at its base installation)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if not libdir or not (Path(libdir) / ldlib).exists():
        raise MissingDependency(f"this Python ({sys.executable}) has no shared libpython ({ldlib or '?'}) for the "
                                "python backend stub to link; use a Python built with --enable-shared",
                                field="libpython")
    return Path(libdir)


STUB_SITE_ENV = "DFLASH_TRITON_STUB_SITE"
STUB_NUMPY = "numpy==1.26.4"  # exactly this one: the last numpy 1 with wheels for every Python the stubs support
STUB_MARKER = "DFLASH_STUB_NUMPY"  # model.py accepts a numpy other than the deployed one only from a marked directory


def stub_site_dir() -> Path:
    """Where the stub's numpy < 2 lives: $DFLASH_TRITON_STUB_SITE (an absolute path: environment.env_dir) or a
    per-Python directory in the user's cache (files.cache_root: DFLASH_CACHE honoured)."""
    given = env_dir(STUB_SITE_ENV)
    if given is not None:
        return given
    return cache_root() / f"triton-stub-py{sys.version_info.major}.{sys.version_info.minor}"


def _numpy_major(where: Path | None = None) -> int | None:
    if where is None:
        from importlib import metadata

        try:
            return int(metadata.version("numpy").split(".")[0])
        except metadata.PackageNotFoundError:
            return None
    found = sorted(where.glob("numpy-*.dist-info"))
    return int(found[-1].name.split("-")[1].split(".")[0]) if found else None


def ensure_stub_site(install: bool = True) -> Path | None:
    """Return the numpy < 2 directory the stub needs (None when this environment's numpy is already < 2).

    Installs exactly STUB_NUMPY there with pip when absent and `install` is true (`./dev setup` does it once, so
    `serve` normally finds it); MissingDependency otherwise.
    """
    if (_numpy_major() or 0) < 2:
        return None
    site_dir = stub_site_dir()
    if (_numpy_major(site_dir) or 2) < 2:
        if not (site_dir / STUB_MARKER).is_file():  # marked once: a read-only directory (an image layer) serves as is
            try:
                (site_dir / STUB_MARKER).touch()
            except OSError as e:
                raise MissingDependency(f"holds numpy 1 but not the {STUB_MARKER} file that marks it for the stub, "
                                        f"and it cannot be written ({e.strerror or e}): create that empty file in it, "
                                        f"or point {STUB_SITE_ENV} at another directory", path=site_dir) from None
        return site_dir
    def pip_into(target: Path) -> list[str]:
        return [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:", "--target",
                str(target), STUB_NUMPY]

    if not install:
        raise MissingDependency("the python backend stub needs numpy 1 (it was built against numpy 1); run: "
                                + " ".join(pip_into(site_dir)), field="numpy")
    import fcntl

    from dflash_export.files import atomic_dir

    # Two first `serve`s at once: one installs, the other waits and finds it. pip --target moves its files in one
    # by one, so it installs into a temporary sibling renamed into place whole (marked last): a killed or failed
    # install leaves no directory that looks installed.
    try:
        site_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(site_dir.parent / f".{site_dir.name}.lock", "a")
    except OSError as e:
        raise MissingDependency(f"cannot install {STUB_NUMPY} for the python backend stub here ({e.strerror or e}); "
                                f"point {STUB_SITE_ENV} at a writable directory", path=site_dir) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (_numpy_major(site_dir) or 2) < 2 and (site_dir / STUB_MARKER).is_file():
            return site_dir
        print(f"the python backend stub needs {STUB_NUMPY}: installing it once into {site_dir}", file=sys.stderr,
              flush=True)
        with atomic_dir(site_dir, what=f"the stub's {STUB_NUMPY}") as tmp:
            done = subprocess.run(pip_into(tmp), capture_output=True, text=True)
            if done.returncode != 0 or (_numpy_major(tmp) or 2) >= 2:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise MissingDependency(f"could not install {STUB_NUMPY} for the python backend stub ({tail})",
                                        path=site_dir)
            (tmp / STUB_MARKER).touch()
    return site_dir


def make_backend_dir(install: TritonInstall, into: Path) -> Path:
    """Build `<into>/python/` = the wheel's python backend + the stub for this Python. Returns `into`."""
    py = into / "python"
    py.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (py / name).symlink_to(install.python_backend / name)
    # A copy, not a link: its $ORIGIN-relative rpath then points nowhere whatever ld.so makes of symlinks, so
    # LD_LIBRARY_PATH alone decides its libraries: the interpreter's own libpython first, then the wheel's.
    shutil.copy2(install.stub, py / "triton_python_backend_stub")
    return into


def make_stub_env(into: Path, stub_site: Path | None) -> Path:
    """A minimal virtual environment for the stub; returns its bin directory (to put first on PATH).

    The stub's embedded interpreter ignores PYTHONPATH and finds its prefix from `python3` on PATH, so a venv there
    decides its `sys.path`: its site-packages holds numpy < 2 (when needed) ahead of everything, then a .pth adds the
    project root and this environment's site-packages (with their own .pth files, e.g. editable installs).
    """
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    (into / "bin").mkdir(parents=True, exist_ok=True)
    (into / "bin" / "python3").symlink_to(base)
    (into / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n", encoding="utf-8")
    sp = into / "lib" / f"python{ver}" / "site-packages"
    sp.mkdir(parents=True, exist_ok=True)
    if stub_site is not None:
        for entry in stub_site.iterdir():
            if entry.name.startswith("numpy"):
                (sp / entry.name).symlink_to(entry)
    # The stub's first act: close the sockets it inherited from tritonserver (deploy/stub_startup.py says why).
    shutil.copyfile(Path(__file__).with_name("stub_startup.py"), sp / "dflash_stub_startup.py")
    # Plain lines are appended to sys.path; `import` lines run (addsitedir also processes that dir's .pth files).
    lines = ["import dflash_stub_startup"]
    lines += [p if not p.endswith("site-packages") else f"import site; site.addsitedir({p!r})"
              for p in stub_python_path()]
    # No __pycache__ written into the model repository when the stub imports model.py: a bytecode file there would
    # run instead of the checked model.py (check_repository refuses one). The stub's interpreter ignores
    # PYTHONDONTWRITEBYTECODE; this line runs before any model is imported.
    lines.append("import sys; sys.dont_write_bytecode = True")
    (sp / "dflash_serving.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return into / "bin"


def server_env(install: TritonInstall, stub_site: Path | None, stub_bin: Path,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver (and through it every stub) runs with."""
    env = dict(os.environ if base is None else base)
    libs = [str(python_lib_dir())] + [str(d) for d in install.lib_dirs]
    # The stubs ignore PYTHONPATH (their paths come from the stub venv); this is for anything else they spawn.
    pypath = ([str(stub_site)] if stub_site else []) + stub_python_path()
    for d in [*libs, str(stub_bin), *pypath]:  # a search path list has no way to quote its separator
        if ":" in d:
            raise DFlashError("a ':' in this path would split the search paths tritonserver and its model stubs run "
                              "with (LD_LIBRARY_PATH, PATH, PYTHONPATH): move the interpreter, checkout or cache "
                              "holding it to a path without one", path=Path(d))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    env["PATH"] = str(stub_bin) + os.pathsep + env.get("PATH", "")
    if env.get("PYTHONPATH"):
        pypath.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = ":".join(pypath)
    # Each stub is a separate process per model instance; one BLAS/OpenMP thread each keeps N instances from
    # oversubscribing the cores (a user who wants more sets it explicitly).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONHOME", None)
    return env
