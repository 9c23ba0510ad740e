"""Files: where the project's cache lives, the content hash that names a build's inputs, JSON objects read with one
clear error, writers that leave either the whole result or nothing (atomic files and directories, output-path checks
before any work starts), .npy / .npz arrays read without unpickling or allocating more than the file holds, and
rows of a float32 matrix read from inside a file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from dflash_export.environment import env_dir, expand_home
from dflash_export.errors import DFlashError


def cache_root() -> Path:
    """Where the user's cache lives, not created: $DFLASH_CACHE (an absolute path: environment.env_dir), else
    $XDG_CACHE_HOME/dflash-export, else ~/.cache/dflash-export. XDG_CACHE_HOME counts only when absolute (the XDG
    base directory rules: an empty or relative value is ignored, never a cache under whatever the cwd happens to be).
    A DFlashError naming DFLASH_CACHE when it is relative or there is no home directory to put the cache in."""
    given = env_dir("DFLASH_CACHE")
    if given is not None:
        return given
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    default = os.path.join(xdg if os.path.isabs(xdg) else "~/.cache", "dflash-export")
    path = expand_home(default)
    if path is None:  # never a `~` directory under the cwd, nor one under the root directory
        raise DFlashError("cannot find the home directory (HOME is not set or empty); set DFLASH_CACHE to a "
                          "writable directory", path=Path(default))
    return Path(path)


def cache_dir() -> Path:
    """The user's cache for converted targets, generated data and tiny pairs (`cache_root()`). Created when absent; a
    DFlashError naming it and DFLASH_CACHE when it cannot be (no permission, a file in the way, no home directory)."""
    p = cache_root()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # FileExistsError: a file by that name
        why = "a file, not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise DFlashError(f"cannot create the cache directory ({why}); set DFLASH_CACHE to a writable directory",
                          path=p) from None
    return p


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# The largest JSON file read whole: configs, manifests and markers are kilobytes, a tokenizer.json tens of megabytes.
MAX_JSON_BYTES = 256 << 20


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold an object; missing, unreadable, oversized (a sparse file of terabytes would be read
    whole), unparsable or non-object files are one DFlashError line."""
    import json

    path = Path(path)
    if not path.is_file():
        raise DFlashError("file not found", path=path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise DFlashError(f"{size} bytes, more than any JSON file read here ({MAX_JSON_BYTES >> 20} MiB)",
                              path=path)
        data = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8, whatever the locale
    except RecursionError:  # arrays or objects nested past the parser's depth
        raise DFlashError("not valid JSON (nested too deeply)", path=path) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past int()'s digit limit
        raise DFlashError(f"not valid JSON ({e})", path=path) from None
    except OSError as e:  # unreadable by this user, or gone since the check
        raise DFlashError(f"cannot read it ({e.strerror})", path=path) from None
    if not isinstance(data, dict):
        raise DFlashError("expected a JSON object", path=path)
    return data


class DuplicateKey(ValueError):
    """A key given twice in one JSON object (`unique_keys`): `key`, and `shown`, the key cut to 80 characters for a
    message (a key may be megabytes long)."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key
        self.shown = key if len(key) <= 80 else key[:60] + "..." + key[-17:]


def unique_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook for a JSON object whose keys are all distinct: json alone keeps the last of a
    repeated key, silently; DuplicateKey here."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def lone_surrogate(value) -> tuple[str, str] | None:
    """Where in a decoded JSON value a string or a key holds a lone surrogate (a \\ud800 escape: not Unicode text,
    which no tokenizer or UTF-8 writer takes), and what: (`messages[1].role`, or `key 'a.b'` for a key, '' for the
    value itself; `lone surrogate \\ud800 at character 3`); None when every string is text. Walked with a stack, so
    JSON nested as deeply as its reader allows costs no recursion."""
    stack = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, f"lone surrogate \\u{ord(v[e.start]):04x} at character {e.start}"
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                at = f"{where}.{k}" if where else str(k)
                stack += [(at, item), (f"key {at!r}", k)]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", item) for i, item in reversed(list(enumerate(v)))]
    return None


def read_cache_json(path: str | os.PathLike, max_bytes: int = 1 << 20):
    """The JSON value of a small file the cache holds, or None when it is missing, not a regular file (a FIFO, a
    device, a symlink to one), larger than `max_bytes`, unreadable or not JSON: the caller then works it out afresh.
    Opened non-blocking (a FIFO in its place does not hang the reader) and read no further than `max_bytes` (a link
    to /dev/zero or a sparse file of terabytes costs nothing), since a cache entry is never trusted to be what its
    writer left."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        data = b""
        while len(data) <= max_bytes and (block := os.read(fd, max_bytes + 1 - len(data))):
            data += block
        if len(data) > max_bytes:  # grew while read
            return None
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    finally:
        os.close(fd)


def _os_error_of(e: BaseException) -> OSError | None:
    """The operating system's error behind a failed write: an OSError itself, or a library error that reports one
    only in its text (safetensors, written in Rust: "... No space left on device (os error 28)") when that error can
    only be about where it writes (no space or quota left, a file too large, a read-only filesystem): a library's
    "no such file" may be about a file it reads."""
    import errno
    import re

    if isinstance(e, OSError):
        return e if e.errno is not None else None
    if isinstance(e, DFlashError):  # already the one line to show
        return None
    m = re.search(r"\(os error (\d+)\)", str(e))
    code = int(m.group(1)) if m else None
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return None
    return OSError(code, os.strerror(code))


# The longest name a directory entry may have (NAME_MAX on Linux and most filesystems), and the most of it that the
# name of a temporary sibling takes from the name it stands for: the rest holds ".", ".tmp-PID-" and mkdtemp's
# random part (or ".old-PID").
NAME_MAX = 255
_STEM_MAX = 200


def _sibling_stem(final: Path) -> str:
    """The part of `final`'s name that its temporary siblings are named after: the whole name, or, for a name so long
    that theirs would pass NAME_MAX, its first bytes and a hash of it (still one stem per name)."""
    name = final.name
    if len(os.fsencode(name)) <= _STEM_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    cut = name
    while len(os.fsencode(cut)) > _STEM_MAX - len(digest) - 1:
        cut = cut[:-1]
    return f"{cut}~{digest}"


@contextmanager
def atomic_dir(final: str | os.PathLike, field: str | None = None, what: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `final` only if the block completes.

    A half-written directory is removed on any exception, so it can never be taken for a finished artifact. With
    `what` ("the engine"), a write that fails naming no file (a full disk: a write's OSError carries no path) or a
    file of the removed temporary directory is one error naming `final`. A library's error that reports the
    operating system's error only in its text (safetensors on a full disk) is that OSError, naming `final`.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_sibling_stem(final)}.tmp-{os.getpid()}-", dir=final.parent))
    except OSError as e:  # named by the directory asked for, not by the temporary sibling
        raise DFlashError(f"cannot write here ({e.strerror or e})", path=final, field=field) from None
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a finished artifact should read like any other directory
    try:
        yield tmp
        old = _swap_in(tmp, final)
        if old is not None:
            _remove_path(old)
    except BaseException as e:
        _remove_path(tmp)
        os_error = _os_error_of(e)
        if what and os_error is not None and (
                os_error.filename is None or Path(str(os_error.filename)).is_relative_to(tmp)):
            raise DFlashError(f"cannot write {what} ({os_error.strerror or os_error})", path=final,
                              field=field) from None
        if os_error is not None and os_error is not e:
            raise OSError(os_error.errno, os_error.strerror, str(final)) from None
        raise


def _swap_in(tmp: Path, final: Path) -> Path | None:
    """Put the finished directory `tmp` at `final`'s name. When `final` exists it is exchanged with `tmp` in one
    step (renameat2 RENAME_EXCHANGE), so that a reader always finds a whole directory there, the previous or the new
    one, and writers finishing at once each put theirs in whole (the last one stays); `tmp` then holds the previous
    directory, returned for the caller to remove. Where the filesystem cannot exchange, the previous one is renamed
    aside first (put back if the second rename fails) and its new name returned; None when nothing was there."""
    import errno

    for _ in range(100):  # each retry follows another writer's rename of `final` in between
        try:
            tmp.rename(final)  # nothing there (or an empty directory)
            return None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        try:
            if _exchange(tmp, final):
                return tmp
        except FileNotFoundError:
            continue  # another writer moved `final` aside: try again
        old = final.with_name(f".{_sibling_stem(final)}.old-{os.getpid()}")
        try:
            final.rename(old)
        except FileNotFoundError:
            continue
        try:
            tmp.rename(final)
        except BaseException as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                shutil.rmtree(old, ignore_errors=True)  # another writer's came in between: replace that one
                continue
            if old.is_dir() and not _exists(final):  # stopped between the two renames: the previous one goes back
                old.rename(final)
            raise
        return old
    raise OSError(errno.EBUSY, "replaced by other writers over and over", str(final))


def dir_identity(d: Path) -> tuple[int, int] | None:
    """The directory at `d` as (device, inode): another one once `atomic_dir` has swapped a new one in; None if
    gone."""
    try:
        st = os.stat(d)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` atomically (Linux renameat2 RENAME_EXCHANGE); False where this system or
    filesystem cannot, an OSError for any other failure."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library older than glibc 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_path(p: Path) -> None:
    """Remove a directory tree, or the link or file in its place; nothing if it is gone."""
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def remove_stale_temps(final: Path) -> None:
    """Remove `.NAME.tmp-PID-*` / `.NAME.old-PID` siblings of `final` left by a process that is gone (killed
    mid-build): only this pid-named form, and only when that pid is no longer alive. An `.old-PID` with no `final`
    beside it (killed between atomic_dir's two renames) is the previous complete directory: it is put back."""
    import re

    pattern = re.compile(rf"^\.{re.escape(_sibling_stem(final))}\.(?:tmp-(\d+)-.+|old-(\d+))$")
    try:
        siblings = list(final.parent.iterdir())
    except OSError:
        return
    for d in siblings:
        m = pattern.match(d.name)
        if not m or not d.is_dir() or d.is_symlink():
            continue
        pid = int(m.group(1) or m.group(2))
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if m.group(2) and not _exists(final):  # killed between moving the previous one aside and the new one in
            try:
                d.rename(final)  # the previous directory is the last complete one: back in place
                continue
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def atomic_file(final: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temp file next to `final` and move it into place on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{_sibling_stem(final)}.tmp-", dir=final.parent)
    os.close(fd)
    # mkstemp makes the file 0600; the finished file should read like any other the user writes (umask applies).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _exists(p: Path) -> bool:
    try:
        return p.exists() or p.is_symlink()
    except OSError:  # no permission to look: the ancestor check says so
        return False


def check_output_parent(path, field: str | None = "--out") -> None:
    """The nearest existing ancestor of `path` must be a writable directory (else `path` can never be created)."""
    anc = Path(os.path.abspath(path)).parent
    while not _exists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise DFlashError(f"cannot create it: {anc} is a file, not a directory", path=path, field=field)
    if not os.access(anc, os.W_OK | os.X_OK):
        raise DFlashError(f"cannot create it: {anc} is not writable", path=path, field=field)
    why = _cannot_create_in(anc)
    if why:
        raise DFlashError(f"cannot create it: creating anything in {anc} fails ({why})", path=path, field=field)


def _cannot_create_in(d: Path) -> str | None:
    """Why nothing can be created in directory `d` (None: something can), found by creating and removing an empty
    directory there. `os.access` answers from permission bits alone, so for root it says yes to /proc, /sys and
    directories a filesystem refuses for its own reasons; only trying tells, before the work instead of after."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-probe-", dir=d))
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def is_engine_dir(d) -> bool:
    """Whether `d` holds an engine's manifest.json written by dflash-export (a finished or tampered engine that
    `build` may replace), as opposed to a directory of someone else's files."""
    try:
        m = json.loads((Path(d) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and (m.get("tool") == "dflash-export" or "backend" in m)


def engine_dir_holding(path) -> Path | None:
    """The engine directory `path` is, or lies inside (None: none). An engine holds only the files its manifest
    lists (loading it refuses any other), so nothing else may be written there."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    return next((d for d in (p, *p.parents) if is_engine_dir(d)), None)


def _refuse_inside_engine(path: Path, field: str | None, itself: bool = False) -> None:
    """Refuse an output under an engine directory, or (`itself`: written into, not swapped in whole) the engine
    directory itself."""
    inside = engine_dir_holding(path if itself else Path(os.path.abspath(path)).parent)
    if inside is not None:
        raise DFlashError(f"is inside the engine directory {inside}, which holds only the files its manifest lists "
                          "(anything written there makes it refuse to load); choose a path outside it",
                          path=path, field=field)


def check_output_dir(path, field: str | None = "--out", *, command: str | None = None,
                     is_previous_output: Callable[[Path], bool] | None = None, replaced: bool = False) -> None:
    """An output directory that can be written, refused before any work when it cannot.

    `replaced`: the directory is swapped in whole from a sibling (`atomic_dir`), so its parent must be writable, it
    may not be the current directory or one above it, and, when it already holds files, `is_previous_output` must
    recognize them as an earlier output of `dflash-export <command>`: replacing anything else would silently delete
    someone's files.
    """
    path = Path(path)
    _refuse_inside_engine(path, field, itself=not replaced)
    if replaced:
        full = Path(os.path.abspath(path))
        try:
            cwd = Path.cwd()
        except OSError:
            cwd = None
        if cwd is not None and (full == cwd or full in cwd.parents):
            raise DFlashError("is the current directory or one above it, which this would replace; choose a new "
                              "directory", path=path, field=field)
    if _exists(path):
        if not path.is_dir():
            raise DFlashError("exists and is not a directory", path=path, field=field)
        if not os.access(path, os.W_OK | os.X_OK):
            raise DFlashError("directory is not writable", path=path, field=field)
        if not replaced:
            why = _cannot_create_in(path)
            if why:
                raise DFlashError(f"creating anything in this directory fails ({why})", path=path, field=field)
            return
        if is_previous_output is not None and any(path.iterdir()) and not is_previous_output(path):
            raise DFlashError(f"exists and was not written by `dflash-export {command}`; choose a new directory",
                              path=path, field=field)
    check_output_parent(path, field)


def check_output_file(path, field: str | None = "--out") -> None:
    """An output file path: not an existing directory, and creatable."""
    path = Path(path)
    if path.is_dir():
        raise DFlashError("is a directory; expected a file name", path=path, field=field)
    _refuse_inside_engine(path, field)
    check_output_parent(path, field)


@contextmanager
def removing_new_dirs(path, keep_if: Callable[[Path], bool] | None = None) -> Iterator[None]:
    """Run the block; if it fails, remove the directories on the way to `path` that it created and left empty (so a
    failed build leaves no empty `out/<recipe>/` behind). With `keep_if`, a `path` the block created is removed with
    whatever was written into it, unless `keep_if(path)` says it holds something worth keeping (a training work
    directory with a checkpoint). Directories that existed before are never touched."""
    def created(p: Path) -> bool:
        try:
            return not (p.exists() or p.is_symlink())
        except OSError:  # cannot tell: treat it as someone else's
            return False

    path = Path(os.path.abspath(path))
    new = [p for p in [path, *path.parents] if created(p)]
    try:
        yield
    except BaseException:
        if keep_if is not None and path in new and path.is_dir() and not keep_if(path):
            shutil.rmtree(path, ignore_errors=True)
        for p in new:  # deepest first
            try:
                p.rmdir()
            except OSError:
                pass
        raise


class UnreadableArrays(ValueError):
    """An .npy or .npz file `read_npy` / `read_npz` refuse; the message says why, and the caller names the file and
    field in its own error (or, for a cache entry, makes it again)."""


def _declared_bytes(f) -> int:
    """The bytes of data the .npy header at `f`'s position declares (its shape times its dtype's size), read
    without the data; `f` is left at the data."""
    import math

    from numpy.lib import format as npy

    version = npy.read_magic(f)
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, _, dtype = read_header(f)
    return math.prod(shape) * dtype.itemsize


def _open_regular(path: str | os.PathLike):
    """`path` opened for reading in binary, refused (UnreadableArrays) unless it is a regular file: opened
    non-blocking, so a FIFO in its place is refused instead of hanging the reader."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnreadableArrays("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# What a damaged .npy / .npz raises while read: a short file, a bad header, a zip archive that is not one (or one
# compressed by a method, or encrypted, that zipfile cannot read).
_ARRAY_ERRORS = (OSError, ValueError, EOFError, KeyError, RuntimeError, NotImplementedError)


def read_npy(path: str | os.PathLike):
    """The array of the .npy file at `path` (a regular file: `_open_regular`), never unpickled (numpy's
    `allow_pickle=False`: an object array is refused); the bytes its header declares are checked against what the
    file holds before numpy allocates them, so a doctored or damaged header (a shape of 10^11 rows) cannot make it
    allocate hundreds of GiB. UnreadableArrays saying why otherwise."""
    from numpy.lib import format as npy

    try:
        with _open_regular(path) as f:
            declared = _declared_bytes(f)
            held = os.fstat(f.fileno()).st_size - f.tell()
            if declared > held:
                raise UnreadableArrays(f"its header declares {declared} bytes of data, more than the {held} the file "
                                       "holds")
            f.seek(0)
            return npy.read_array(f, allow_pickle=False)
    except UnreadableArrays:
        raise
    except _ARRAY_ERRORS as e:
        raise UnreadableArrays(f"{type(e).__name__}: {e}") from None


def read_npz(path: str | os.PathLike) -> dict:
    """The arrays of the .npz archive at `path` (a regular file: `_open_regular`) by name, none unpickled (numpy's
    `allow_pickle=False`); what their headers declare is checked against the file's size before any is read, so a
    doctored or damaged header cannot make numpy allocate more than the file holds (the archives written here, by
    np.savez, are uncompressed). A damaged member fails its CRC-32 check. UnreadableArrays saying why otherwise."""
    import zipfile

    from numpy.lib import format as npy

    try:
        with _open_regular(path) as raw, zipfile.ZipFile(raw) as z:
            members = z.infolist()
            names = [m.filename.removesuffix(".npy") for m in members]
            twice = next((n for n in names if names.count(n) > 1), None)
            if twice is not None:
                raise UnreadableArrays(f"the array {twice!r} is stored twice")
            declared = 0
            for m in members:
                with z.open(m) as f:
                    declared += _declared_bytes(f)
            size = os.fstat(raw.fileno()).st_size
            if declared > size:
                raise UnreadableArrays(f"its arrays declare {declared} bytes, more than the file's {size}")
            out = {}
            for name, m in zip(names, members):
                with z.open(m) as f:
                    out[name] = npy.read_array(f, allow_pickle=False)
            return out
    except UnreadableArrays:
        raise
    except (*_ARRAY_ERRORS, zipfile.BadZipFile) as e:
        raise UnreadableArrays(f"{type(e).__name__}: {e}") from None


class MatrixRows:
    """A float32 matrix [V, H] at `offset` inside a file (an engine's embedding table, its LM head), read with pread:
    rows by id, or a contiguous range. `what` names it in errors.

    Not a memory map: every page fault on a mapped file also maps its cached neighbours (the kernel's fault-around,
    64 KiB), so a memory-mapped embedding table became resident ~28 rows per token seen -- 50-110 MB of a 113 MB
    table after a few hundred tokens of chat (measured), which alone put the engine over its memory budget. A pread
    of one 2.3 KB row costs a couple of microseconds; a step reads 1-16 rows.
    """

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], what: str = "matrix"):
        """The caller has checked that the matrix fits the file (its manifest or graph says where it lies)."""
        self.path, self.offset, self.shape, self.what = Path(path), int(offset), (int(shape[0]), int(shape[1])), what
        self._row_bytes = 4 * self.shape[1]
        self._fd = os.open(self.path, os.O_RDONLY)

    def rows(self, ids, out=None):
        """Rows `ids` as a fresh [n, H] float32 array, or written into `out` (C-contiguous [n, H] float32)."""
        import numpy as np

        out = np.empty((len(ids), self.shape[1]), np.float32) if out is None else out
        for i, t in enumerate(ids):
            t = int(t)
            if not 0 <= t < self.shape[0]:
                raise DFlashError(f"token id {t} outside the {self.what} ({self.shape[0]} rows)", field="input_ids")
            if os.preadv(self._fd, [out[i]], self.offset + t * self._row_bytes) != self._row_bytes:
                raise DFlashError(f"truncated while reading the {self.what}", path=self.path)
        return out

    def range(self, start: int, stop: int):
        """Rows start..stop-1 in one read."""
        import numpy as np

        out = np.empty((stop - start, self.shape[1]), np.float32)
        if os.preadv(self._fd, [out], self.offset + start * self._row_bytes) != out.nbytes:
            raise DFlashError(f"truncated while reading the {self.what}", path=self.path)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


# The longest path a Unix socket's address holds (sun_path: 108 bytes, the terminating NUL included); a longer one is
# reached through a descriptor on its directory (`path_through_fd`). deploy/netns_bridge.py, a standard-library-only
# script, holds the same number and mechanism.
UNIX_PATH_MAX = 107


def directory_fd(path: str | os.PathLike) -> int:
    """A descriptor on the directory `path` for `path_through_fd` (O_PATH: it reads nothing; closed on exec); its
    holder closes it once the names made through it are no longer used. OSError when it cannot be opened."""
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def path_through_fd(dir_fd: int, name: str) -> str:
    """The file `name` in the directory `dir_fd` is held on (`directory_fd`), reached through that descriptor:
    /proc/self/fd/N/NAME, a path of about 20 bytes before the name, valid in this process while `dir_fd` is open.
    For a callee that cannot take the file's own path: one whose bytes are not UTF-8 (`native_path`), one longer
    than a Unix socket's address holds."""
    return f"/proc/self/fd/{dir_fd}/{name}"


def _utf8_names(text: str) -> bool:
    """Whether `text`, encoded as UTF-8 (what the C++ and Rust bindings of onnx, ONNX Runtime, TensorRT and tokenizers
    do with a str), gives the bytes the file system knows it by (os.fsencode)."""
    try:
        return text.encode("utf-8") == os.fsencode(text)
    except UnicodeEncodeError:  # surrogate escapes: bytes the locale's encoding could not decode
        return False


@contextmanager
def native_path(path: str | os.PathLike) -> Iterator[str]:
    """`path` as a str the C++ and Rust bindings of onnx, ONNX Runtime, TensorRT, safetensors and tokenizers open the
    right file (or directory) with, while the context lasts: the path itself when its UTF-8 is its bytes on disk;
    otherwise (a directory whose name the locale cannot decode, Python holding its bytes as surrogate escapes, as
    under LC_ALL=C without UTF-8 mode, or a locale whose encoding is not UTF-8) the file reached through a descriptor
    held on its directory, /proc/self/fd/N/NAME. Files beside it (external data, an optimized graph's output, a model
    directory's files) resolve in the same directory either way. DFlashError naming the path when the file's own
    name is not UTF-8."""
    path = os.fspath(path)
    if _utf8_names(os.path.abspath(path)):  # a relative path too: the bindings make it absolute to find files beside it
        yield path
        return
    parent, name = os.path.split(os.path.abspath(path))
    if not _utf8_names(name):
        raise DFlashError("the file's name is not valid UTF-8 (the C++ and Rust libraries reading it take UTF-8 "
                          "paths): rename it", path=path)
    try:
        fd = directory_fd(parent)
    except OSError as e:
        raise DFlashError(f"cannot open its directory ({e.strerror})", path=path) from None
    try:
        yield path_through_fd(fd, name)
    finally:
        os.close(fd)
