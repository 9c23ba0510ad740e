"""The TensorRT CPU lane: this project's TensorRT backend against NVIDIA's real Python layer, without a GPU.

    python scripts/trt_lane/run.py [--versions 10.16.1.11,11.1.0.106,11.4.0.106] [--numpy 2.3.5,current] [--json F]

For each TensorRT version: PyPI's `tensorrt-cu12-bindings` wheel (the compiled pybind module and NVIDIA's
`tensorrt.plugin` sources; ~1.3 MB) is unpacked under ~/.cache/dflash-export/trt-lane/, installed as `tensorrt`, and
loaded over stub.c, a stand-in for the runtime libraries (libnvinfer, libnvinfer_plugin, libnvonnxparser) whose nine
entry points return NULL -- what the real ones return when CUDA cannot start. Nothing runs on a GPU and no figure
comes from this lane. checks.py then runs in a subprocess per (TensorRT, numpy) pair (never in the test suite's own
process, so `tensorrt` stays uninstalled there): the `trt.*` names the backend uses, the builder configuration each
recipe dtype resolves to, plugin registration through NVIDIA's decorators, plugin creation (build phase, JIT and
AOT), output types, format combinations and tactics per dtype, and fields saved and reloaded (runtime phase).

Exit status 0 when every supported pair passes every check and every pair the backend refuses (check_versions)
really fails in NVIDIA's code; 1 otherwise; 3 when the wheels cannot be fetched (no package index).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_VERSIONS = "10.16.1.11,11.1.0.106,11.4.0.106"


def cache_root() -> Path:
    root = os.environ.get("DFLASH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                          "dflash-export")
    return Path(root).expanduser() / "trt-lane"


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)


def bindings(version: str) -> Path:
    """site dir holding `tensorrt` (the bindings of `version`), fetched once."""
    site = cache_root() / f"site-{version}"
    if (site / "tensorrt" / "__init__.py").is_file():
        return site
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    r = pip("download", "--no-deps", "-q", f"tensorrt-cu12-bindings=={version}", "-d", str(wheels))
    found = sorted(wheels.glob(f"tensorrt_cu12_bindings-{version}-*.whl"))
    if r.returncode != 0 or not found:
        raise FileNotFoundError(f"tensorrt-cu12-bindings=={version}: {r.stderr.strip()[-300:]}")
    tmp = site.with_name(site.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(tmp)
    (tmp / "tensorrt_bindings").rename(tmp / "tensorrt")
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    return site


def stub_libs(major: str) -> Path:
    """The stand-in runtime libraries, with the sonames the bindings of TensorRT `major` link against."""
    out = cache_root() / f"stub-{major}"
    names = [f"lib{n}.so.{major}" for n in ("nvinfer", "nvinfer_plugin", "nvonnxparser")]
    if all((out / n).is_file() for n in names):
        return out
    out.mkdir(parents=True, exist_ok=True)
    for n in names:
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out / n), f"-Wl,-soname,{n}",
                        str(HERE / "stub.c")], check=True, capture_output=True)
    return out


def numpy_dir(version: str) -> Path | None:
    """A directory holding numpy `version` to put ahead of this environment's (None: this environment's own)."""
    if version == "current":
        return None
    d = cache_root() / f"numpy-{version}"
    if not (d / "numpy" / "__init__.py").is_file():
        r = pip("install", "-q", "--no-deps", "--target", str(d), f"numpy=={version}")
        if r.returncode != 0:
            raise FileNotFoundError(f"numpy=={version}: {r.stderr.strip()[-300:]}")
    return d


def run_pair(version: str, np_version: str) -> dict:
    site, libs, npd = bindings(version), stub_libs(version.split(".")[0]), numpy_dir(np_version)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "PYTHONPATH": ":".join(str(p) for p in (npd, site, ROOT) if p)}
    r = subprocess.run([sys.executable, str(HERE / "checks.py")], capture_output=True, text=True, env=env,
                       timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"tensorrt": version, "numpy": np_version, "error": (r.stderr or r.stdout)[-2000:]}
    return json.loads(lines[-1])


def verdict(res: dict) -> tuple[bool, str]:
    if "error" in res:
        return False, "the checks did not run: " + res["error"].strip().splitlines()[-1][:200]
    failed = res["failures"]
    plugin_failed = [f for f in failed if "/" in f or f == "register_plugins"]
    if res["supported_pair"]:
        return not failed, "supported: " + ("every check passed" if not failed else f"FAILED {failed}")
    other = [f for f in failed if f not in plugin_failed]
    ok = bool(plugin_failed) and not other
    return ok, ("refused by check_versions, and NVIDIA's plugin creation does fail on it" if ok else
                f"refused by check_versions but {'its plugins work' if not plugin_failed else f'also {other}'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", default=DEFAULT_VERSIONS)
    ap.add_argument("--numpy", default="2.3.5,current", help="numpy versions ('current': this environment's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results, ok = [], True
    for version in args.versions.split(","):
        for np_version in args.numpy.split(","):
            try:
                res = run_pair(version, np_version)
            except FileNotFoundError as e:
                print(f"cannot fetch what the lane needs: {e}", file=sys.stderr)
                return 3
            good, why = verdict(res)
            ok &= good
            res["verdict"] = why
            results.append(res)
            print(f"TensorRT {res.get('tensorrt', version):12} numpy {res.get('numpy', np_version):8} "
                  f"{'ok  ' if good else 'FAIL'} {why}")
            for name, value in res.get("checks", {}).items():
                if isinstance(value, str) and value.startswith("FAILED") and res.get("supported_pair"):
                    print(f"    {name}: {value[:300]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
