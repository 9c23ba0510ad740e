"""Unusual but legitimate paths: a long TMPDIR under tritonserver's Unix socket, names near NAME_MAX for the
directories and files written whole, `$` and `~` in the names of directories, `--out=~/...`, and printed commands
holding paths with spaces. Each runs in seconds, without tritonserver."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _long_dir(base: Path, at_least: int = 150) -> Path:
    d = base
    while len(os.fsencode(str(d))) < at_least:
        d = d / ("d" * 40)
    d.mkdir(parents=True)
    return d


def test_a_unix_socket_past_sun_path_is_bound_and_reached_through_its_directory(tmp_path):
    """tritonserver's socket lies in a work dir under TMPDIR: past the 107 bytes of sun_path the bridge binds it, and
    the front reaches it, through a descriptor on its directory."""
    from dflash_export.deploy.netns_bridge import _bind_address
    from dflash_export.deploy.triton_process import UNIX_PATH_MAX, _uds_ok, unix_address

    uds = _long_dir(tmp_path) / "tritonserver.sock"
    assert len(os.fsencode(str(uds))) > UNIX_PATH_MAX

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    address, fd = _bind_address(str(uds))
    try:
        server = asyncio.run_coroutine_threadsafe(asyncio.start_unix_server(answer, path=address), loop).result(10)
    finally:
        if fd is not None:
            os.close(fd)
    dir_fd = os.open(uds.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        assert uds.is_socket()
        assert len(unix_address(uds, dir_fd)) <= UNIX_PATH_MAX
        assert _uds_ok(unix_address(uds, dir_fd), "/v2/health/ready", timeout=5)
        short = tmp_path / "s.sock"  # a path that fits is used as it is
        assert unix_address(short, dir_fd) == str(short)
    finally:
        os.close(dir_fd)
        async def close():
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_the_bridge_ends_tritonserver_and_exits_when_its_socket_cannot_be_made(tmp_path):
    """A socket the bridge cannot make (here: its directory is gone) ends the command it started and the bridge at
    once, with a line naming the socket, instead of leaving a server nothing can reach running until the ready
    timeout."""
    from dflash_export.deploy.triton_process import BRIDGE, private_network_unavailable

    if (why := private_network_unavailable()) is not None:
        pytest.skip(f"no private network namespace here: {why}")
    uds = tmp_path / "gone" / "tritonserver.sock"
    r = subprocess.run([sys.executable, "-I", str(BRIDGE), "--uds", str(uds), "--port", "1", "--", "sleep", "60"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert f"cannot listen on the Unix socket {uds}" in r.stdout


def test_directories_and_files_written_whole_take_names_up_to_name_max(tmp_path):
    """A temporary sibling is named after the name it stands for: a name near NAME_MAX still works (its siblings take
    a shortened stem), a replaced directory leaves nothing beside it, and a dead writer's leftovers are found."""
    from dflash_export.files import NAME_MAX, _sibling_stem, atomic_dir, atomic_file, remove_stale_temps

    for name in ("n" * NAME_MAX, "é" * (NAME_MAX // 2)):
        final = tmp_path / name
        for content in ("first", "second"):  # the second replaces the first (renamed aside or exchanged)
            with atomic_dir(final) as d:
                (d / "f").write_text(content)
            assert (final / "f").read_text() == content
        with atomic_file(tmp_path / "files" / name) as f:
            f.write("x")
        assert (tmp_path / "files" / name).read_text() == "x"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["files", name])
        assert os.listdir(tmp_path / "files") == [name]
        stale = tmp_path / f".{_sibling_stem(final)}.tmp-999999999-abc"  # no such pid
        stale.mkdir()
        remove_stale_temps(final)
        assert not stale.exists()
        for p in (final, tmp_path / "files" / name):
            (p.unlink if p.is_file() else shutil.rmtree)(p)
    assert _sibling_stem(tmp_path / "short") == "short"


def test_a_dollar_in_a_directory_name_is_never_expanded_as_a_variable(tmp_path, monkeypatch):
    """`$HOME` in the name of the recipe's directory, a command line's path or the cache's: the recipe resolves its
    relative sources once, and the path is then used as it is (not expanded again into another directory)."""
    from dflash_export.models.sources import resolve_source
    from dflash_export.models.target import resolve_target_dir
    from dflash_export.recipes import load_recipe

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = tmp_path / "a $HOME ${HOME} b"
    for name in ("target", "drafter"):
        (base / name).mkdir(parents=True)
    (base / "target" / "config.json").write_text("{}")
    (base / "r.yaml").write_text("name: r\ntarget: target\ndrafter: drafter\n")
    recipe = load_recipe(str(base / "r.yaml"))
    assert recipe.target_path == str(base / "target") and recipe.drafter_path == str(base / "drafter")
    assert resolve_target_dir(recipe.target_path) == base / "target"
    assert resolve_source(recipe.drafter_path) == base / "drafter"
    assert resolve_target_dir(base / "target") == base / "target"  # a Path (a tiny pair in such a cache)
    cli = load_recipe(None, target=str(base / "target"), drafter=str(base / "drafter"))
    assert cli.missing_environment() == []
    assert resolve_target_dir(cli.target_path) == base / "target"
    monkeypatch.setenv("MODELS", str(base))  # a variable the user meant is still expanded
    assert resolve_source("$MODELS/target") == base / "target"


def test_a_path_option_joined_by_equals_gets_the_tilde_expansion_the_shell_gives_it(tmp_path, monkeypatch):
    """`--out=~/x` reaches the command as `~/x` (the shell expands `--out ~/x` only): expanded as the shell would,
    never a directory named `~` under the working directory; other options and arguments stay as they are."""
    from dflash_export.cli import expand_tilde_options

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert expand_tilde_options(["--out=~/e", "--engine=~", "--model-name=~x", "~/p", 8000, "--", "--out=~/q"]) == \
        [f"--out={home}/e", f"--engine={home}", "--model-name=~x", "~/p", 8000, "--", "--out=~/q"]
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "DFLASH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "dflash_export", "run", "--engine=~/no-engine", "hi"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and f"{home}/no-engine" in r.stderr, r.stderr
    assert not (tmp_path / "~").exists()


def test_deploy_prints_a_serve_command_the_shell_takes_whole(tmp_path):
    from deploy_support import make_torch_engine_dir

    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = tmp_path / "my 'repo' $x"
    r = subprocess.run([sys.executable, "-m", "dflash_export", "deploy", "--engine", str(engine), "--repo",
                        str(repo), "--no-stream"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("serve it with: "))
    assert shlex.split(line.removeprefix("serve it with: ")) == ["dflash-export", "serve", "--repo", str(repo)]


def test_a_colon_in_a_path_the_server_searches_is_one_error_naming_it(tmp_path):
    """LD_LIBRARY_PATH, PATH and PYTHONPATH are ':'-separated lists with no quoting: a path of tritonserver's
    environment holding a ':' (a checkout or cache dir named so) is refused naming it, not split into two."""
    from dflash_export.deploy.triton_install import TritonInstall, server_env
    from dflash_export.errors import DFlashError

    install = TritonInstall(tmp_path / "tritonserver", tmp_path / "backend", tmp_path / "stub", [tmp_path / "lib"])
    env = server_env(install, None, tmp_path / "stubenv" / "bin", base={"PATH": "/usr/bin"})
    assert env["PATH"].split(":")[0] == str(tmp_path / "stubenv" / "bin")
    for bad in (dict(stub_bin=tmp_path / "a:b" / "bin"), dict(stub_site=tmp_path / "c:d")):
        with pytest.raises(DFlashError, match="':' in this path") as e:
            server_env(install, bad.get("stub_site"), bad.get("stub_bin", tmp_path / "bin"), base={})
        assert ":" in str(e.value.path)


def test_native_path_names_the_same_file_in_utf8_for_the_c_plus_plus_bindings(tmp_path):
    """A path whose UTF-8 is its bytes is passed as it is; one through a directory whose name is not UTF-8 (held by
    Python as surrogate escapes) becomes the same file reached through a descriptor on that directory, a string that
    encodes to UTF-8; a file whose own name is not UTF-8 is one error naming it."""
    from dflash_export.errors import DFlashError
    from dflash_export.files import native_path

    plain = tmp_path / "g.onnx"
    plain.write_bytes(b"x")
    with native_path(plain) as name:
        assert name == str(plain)
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    odd.mkdir()
    (odd / "g.onnx").write_bytes(b"y")
    with native_path(odd / "g.onnx") as name:
        name.encode("utf-8")
        assert name.startswith("/proc/self/fd/") and name.endswith("/g.onnx")
        assert os.path.samefile(name, odd / "g.onnx") and Path(name).with_name("g.onnx").read_bytes() == b"y"
    with pytest.raises(DFlashError) as e:
        with native_path(tmp_path / os.fsdecode(b"g\xe9.onnx")):
            pass
    assert "not valid UTF-8" in str(e.value) and str(tmp_path) in str(e.value)


def test_a_target_and_a_drafter_in_a_directory_whose_name_is_not_utf8_load_as_anywhere_else(tmp_path):
    """transformers hands the weights' path to safetensors (Rust, UTF-8 paths only): a checkpoint under a directory
    whose name Python holds as surrogate escapes loads through a descriptor on that directory, the same weights as
    from its own place (the same logits, the same drafter tensors)."""
    import torch

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.sources import resolve_source
    from dflash_export.models.weights import load_state_dict

    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    odd.mkdir()
    for part in ("target", "drafter"):
        shutil.copytree(resolve_source(f"tiny:qwen3/{part}"), odd / part)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        want = load_target("tiny:qwen3/target").hf(ids).logits
        got = load_target(odd / "target").hf(ids).logits
    assert torch.equal(want, got)
    mine, theirs = load_state_dict(odd / "drafter"), load_state_dict(resolve_source("tiny:qwen3/drafter"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert load_drafter(odd / "drafter") is not None
