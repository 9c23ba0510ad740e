"""Triton python-backend model running the DFlash runtime (copied as `<repo>/<model>/1/model.py` by `deploy`).

Runs inside `triton_python_backend_stub`, whose `sys.path` comes from the stub environment `serve` makes on the
serving machine (deploy/triton_install.py): nothing of the deploying machine's paths is recorded in the repository
(an older repository's `sys_path` parameter is still honoured). `initialize` then checks that the
libraries loaded are the ones recorded, so a mismatched environment fails the model load with one clear message
instead of subtly different numerics. A load that fails because of the environment (those checks, a file it cannot
read, an optional library it cannot import) raises MissingDependency or DFlashError, whose name the python backend
reports and `serve` reads: one line, exit 2; any other exception is a bug (exit 3).

One engine per model instance. With `max_batch` 1 each instance handles its requests one after another (concurrency =
instance count); with `max_batch` > 1 every request gets a thread that feeds it into the instance's one shared
continuous batch (dflash_export.runtime.batching.BatchingService) and `execute` returns at once, responses going out
through each request's response sender (one response in the default mode, one per step when decoupled).
A bad request gets an error response naming the input (INVALID_ARG: HTTP 400); the instance keeps serving. Between
DFlash steps the request is checked for cancellation: Triton's own (a gRPC client that cancels or goes away) and the
front's cancel file (an HTTP client that went away, or a shutdown past its drain time, see deploy/front.py), so an
abandoned request holds its instance for at most one more step; a shared batch's own thread also looks for the cancel
file before each of its steps. Each cancel seen is logged (deploy/cancel_log.py) with the steps run after it.
"""

import errno
import json
import os
import re
import site
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(config: dict, key: str, default=None):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value is None else value


def _extend_sys_path(paths):
    for p in reversed(paths):
        if os.path.isdir(p):
            if p.endswith("site-packages"):
                site.addsitedir(p)  # also processes .pth files (editable installs)
            if p in sys.path:
                sys.path.remove(p)
            sys.path.insert(0, p)


def _input_error(message: str, kind: str = "MissingDependency", path=None) -> Exception:
    """`dflash_export.errors.<kind>(message, path=path)`: a load that failed because of the environment or the input.
    The python backend reports a failed initialize as "<class name>: <message>", and `serve` exits 2 on these names
    (triton_process._INPUT_ERROR); where the stub cannot import the project at all, a class of that name stands in."""
    try:
        from dflash_export import errors

        return getattr(errors, kind)(message, path=path)
    except ImportError:
        return type(kind, (RuntimeError,), {})(f"{path}: {message}" if path else message)


# How the libraries the load runs report an allocation that failed without raising MemoryError: ONNX Runtime's
# "Failed to allocate memory for requested buffer", a C++ std::bad_alloc passed on as text, PyTorch's CPU allocator.
_ALLOCATION_FAILED = re.compile(r"[Ff]ailed to allocate memory|\bbad[_ ]alloc(?:ation)?\b|[Cc]an't allocate memory")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether the load failed because an allocation did: MemoryError (numpy's, and a C++ std::bad_alloc that pybind11
    turns into one), an OSError ENOMEM, or a library's own allocation-failure message."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or bool(_ALLOCATION_FAILED.search(str(exc))))


def _environment_error(exc: BaseException) -> Exception | None:
    """The one-line error for an exception of the load that says the environment is wrong, not the code (None: a
    bug, reported as it is): as the CLI judges them, an allocation that failed (the machine has too little memory
    for the model: how much it has available is added), any other OSError (a file that cannot be read) and a failed
    import of one of the project's optional libraries (its install line added), or of the project itself."""
    if _out_of_memory(exc):
        try:
            from dflash_export.environment import memory_note

            note = memory_note()
        except ImportError:
            note = ""
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        return _input_error(f"out of memory while loading the model ({note or 'memory available unknown'}): {what}")
    if isinstance(exc, OSError):
        return _input_error(f"cannot read it ({exc.strerror or exc})" if exc.filename else str(exc.strerror or exc),
                            "DFlashError", exc.filename)
    if not isinstance(exc, ImportError) or not exc.name:
        return None
    if exc.name == "dflash_export":
        return _input_error(f"the project is not importable in the model stub (sys.path[:3]={sys.path[:3]}): start "
                            "the server with `dflash-export serve`")
    try:
        from dflash_export.environment import install_hint
    except ImportError:
        return None
    hint = install_hint(exc.name)
    return _input_error(f"{exc.name}: cannot be imported in the model stub ({exc}); {hint}") if hint else None


def _check_versions(expected: dict) -> None:
    import importlib
    import importlib.metadata as md

    for name, want in expected.items():
        if name == "numpy":
            continue
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            raise _input_error(f"{name} {want} was recorded at deploy time but is not importable here "
                               f"(sys.path[:3]={sys.path[:3]})") from None
        if have != want:
            raise _input_error(f"{name} {have} loaded, but the repository was deployed with {name} {want}: "
                               "serve from the same environment or redeploy")
    # numpy is imported by the backend utilities before this file runs. `serve` substitutes numpy 1 (the stub is built
    # against numpy 1) from a directory it marks; any other numpy means the server was started some other way.
    np_home = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    from_stub = os.path.isfile(os.path.join(np_home, "DFLASH_STUB_NUMPY"))
    if "numpy" in expected and np.__version__ != expected["numpy"] and not from_stub:
        raise _input_error(f"numpy {np.__version__}, deployed with {expected['numpy']}, and not from the numpy "
                           f"directory `serve` marks for the stub: start the server with `dflash-export serve` "
                           f"(numpy imported from {np.__file__})")
    if "onnxruntime" in expected:
        importlib.import_module("onnxruntime")


def _log_kv(nbytes: int, slots: int, capacity: int) -> None:
    """One log line per K/V reallocation of the shared batch (benchmarks/soak.py reads them)."""
    import time

    print(f"dflash-kv: {time.time():.3f} pid {os.getpid()}: {nbytes} bytes, {slots} slots x {capacity} tokens",
          file=sys.stderr, flush=True)


def _kv_bound(config, engine_dir: str, instances: int, max_batch: int) -> int | None:
    """The K/V token bound of this instance's shared batch: the config's `max_kv_tokens`, or (0, or a repository
    written before it) the one the memory available now allows (deploy/kv_memory.py `default_kv_tokens`), logged.
    That memory is shared by the config's `kv_instances`: every instance of the deployment, each model's (deploy
    writes it); a config without it counts this model's `instances` alone (serve accepts that only where the
    deployment has one model)."""
    from dflash_export.deploy.kv_memory import default_kv_tokens
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.environment import available_memory_bytes

    tokens = int(_param(config, "max_kv_tokens", "0"))
    if tokens <= 0:
        manifest = read_manifest(engine_dir, verify_files=False)
        sharing = int(_param(config, "kv_instances", str(instances)))
        tokens = default_kv_tokens(manifest, sharing, max_batch, available_memory_bytes())
    print(f"dflash-kv-bound: pid {os.getpid()}: {tokens if tokens else 'unbounded'} K/V tokens", file=sys.stderr,
          flush=True)
    return tokens or None


def _cancel_age_ms(token):
    """Milliseconds since the front wrote this request's cancel file, by its modification time (None without one)."""
    import time

    from dflash_export.deploy.front import CANCEL_DIR_ENV

    d = os.environ.get(CANCEL_DIR_ENV)
    try:
        return 1000 * (time.time() - os.stat(os.path.join(d, token)).st_mtime) if d and token else None
    except OSError:
        return None


class _TimedSteps(list):
    """RunStats.acceptance_lengths (one entry per DFlash step the runtime ran for the request) that also keeps when
    each entry was appended, on `clock`: when each step ended."""

    def __init__(self, lengths, clock):
        super().__init__(lengths)
        self.clock = clock
        self.ends = [clock()] * len(self)

    def append(self, length) -> None:
        super().append(length)
        self.ends.append(self.clock())

    def ended_after(self, t: int) -> int:
        import bisect

        return len(self.ends) - bisect.bisect_right(self.ends, t)


class TritonPythonModel:
    def initialize(self, args):
        try:
            self._initialize(args)
        except Exception as e:  # noqa: BLE001 - re-raised: as one input error when the environment is to blame
            error = _environment_error(e)
            if error is None:
                raise
            raise error from e

    def _initialize(self, args):
        self.model_config = config = json.loads(args["model_config"])
        _extend_sys_path(json.loads(_param(config, "sys_path", "[]")))
        _check_versions(json.loads(_param(config, "library_versions", "{}")))

        from dflash_export.deploy.handler import RequestRunner
        from dflash_export.engines.registry import load_engine
        from dflash_export.runtime.single import DFlashRuntime

        engine_dir = _param(config, "engine_dir")
        if not os.path.isabs(engine_dir):
            engine_dir = os.path.join(args["model_repository"], engine_dir)
        threads = int(_param(config, "threads", "0"))
        count = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        if threads <= 0:
            # Instances are separate processes sharing the machine: split the cores rather than oversubscribe them.
            # Split by this model's instances only: another model's instances (dflash_stream beside dflash) take
            # cores only while they have requests, and a model serving alone is the common case. The K/V bound is
            # split over every model's instances (_kv_bound): memory must suffice when all of them are full at once.
            threads = max(1, len(os.sched_getaffinity(0)) // count)
        self.engine = load_engine(os.path.normpath(engine_dir), threads=threads)
        numerics = getattr(self.engine, "numerics", None)
        if numerics is not None:  # the serving log says what this CPU's kernels guarantee, once per instance
            print(f"dflash-numerics: pid {os.getpid()}: {numerics.statement}", file=sys.stderr, flush=True)
        self.max_batch = int(_param(config, "max_batch", "1"))
        mode = _param(config, "mode", "dflash")  # "ar": plain decoding on the same engine (deploy --plain)
        self.service = None
        if self.max_batch > 1:
            from dflash_export.runtime.batching import BatchingService

            self.service = BatchingService(self.engine, self.max_batch,
                                           int(_param(config, "max_queued_tokens", "65536")), on_resize=_log_kv)
            # Worked out once the batched graph (a second copy of the target's weights) is loaded: from the memory
            # that is left, not from memory that load then takes.
            self.service.runtime.set_kv_bound(_kv_bound(config, engine_dir, count, self.max_batch))
            self.runner = RequestRunner(self.service, mode, engine_dir)
        else:
            self.runner = RequestRunner(DFlashRuntime(self.engine), mode, engine_dir)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        from dflash_export.deploy.cancel_log import CancelLog

        self.cancel_log = CancelLog()  # this instance's cancel lines: the first ones, then a summary a minute
        self.output_names = [o["name"] for o in config["output"]]

    # Adapters -------------------------------------------------------------------------------------------------------
    def _response(self, chunk) -> "pb_utils.InferenceResponse":
        values = {
            "text_output": np.array([chunk.text.encode("utf-8")], dtype=np.object_),
            "finish_reason": np.array([(chunk.finish_reason or "").encode()], dtype=np.object_),
            "completion_tokens": np.array([chunk.completion_tokens], dtype=np.int32),
            "accepted_tokens": np.array([chunk.accepted_tokens], dtype=np.int32),
            "drafted_tokens": np.array([chunk.drafted_tokens], dtype=np.int32),
            "acceptance_length": np.array([chunk.acceptance_length], dtype=np.float32),
            "prompt_tokens": np.array([chunk.prompt_tokens], dtype=np.int32),
            "step_stats": np.array([json.dumps(chunk.step_stats).encode() if chunk.step_stats else b""],
                                   dtype=np.object_),
        }
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, values[n]) for n in self.output_names])

    @staticmethod
    def _error(exc: BaseException) -> "pb_utils.InferenceResponse":
        from dflash_export.deploy.handler import RequestCancelled
        from dflash_export.errors import DFlashError
        from dflash_export.models.tokenization import ChatTemplateError

        codes = pb_utils.TritonError
        if isinstance(exc, RequestCancelled):
            message, code = f"cancelled: {exc}", getattr(codes, "CANCELLED", getattr(codes, "UNAVAILABLE", None))
        elif isinstance(exc, DFlashError) and exc.field == "max_queued_tokens":  # the batch's queue is full: 503
            message, code = str(exc), getattr(codes, "UNAVAILABLE", None)
        elif isinstance(exc, ChatTemplateError):  # the server's template failed on these messages: 400, no path
            message, code = exc.served_message(), getattr(codes, "INVALID_ARG", None)
        elif isinstance(exc, DFlashError):  # the request's fault: 400, naming the input (never a server's file)
            message = str(exc) if exc.path is None else f"{exc.field}: {exc.message}" if exc.field else exc.message
            code = getattr(codes, "INVALID_ARG", None)
        else:
            message, code = f"internal error: {type(exc).__name__}: {exc}", getattr(codes, "INTERNAL", None)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def _cancel_checks(self, request, sender, stats):
        """The checks `RequestRunner.run` makes for this request: `cancelled`, asked between steps (and, `queued=True`,
        while the request waits to join a shared batch): why the request is cancelled, or None; and `stopped`, the
        cheap one a shared batch makes on its own thread before each step: whether the front's cancel file is there.
        `stats`: the RunStats the runtime fills for the request; each DFlash step's acceptance length it appends is
        timed, and a cancel's line counts the steps that ended after the front's stamp of its cancel file (read once
        the file was visible), or, without a stamp, after the last check that saw no cancel began."""
        from dflash_export.deploy.front import cancel_clock_ns, cancel_path, cancel_record
        from dflash_export.deploy.upstream import CANCEL_PARAMETER

        try:
            token = json.loads(request.parameters() or "{}").get(CANCEL_PARAMETER)
        except (ValueError, AttributeError):
            token = None
        token = token if isinstance(token, str) else None
        native = [f for f in (getattr(sender, "is_cancelled", None), getattr(request, "is_cancelled", None)) if f]
        import time

        steps = stats.acceptance_lengths = _TimedSteps(stats.acceptance_lengths, cancel_clock_ns)
        last = [None]  # when the previous check between steps began (None: none has yet)

        def cancelled(queued: bool = False):
            began = cancel_clock_ns()
            why = at = None
            for is_cancelled in native:
                try:
                    if is_cancelled():
                        why = "the client cancelled the request"
                except Exception:  # noqa: BLE001 - a stub without the call: rely on the cancel file
                    pass
            record = cancel_record(token)
            for _ in range(20):  # a file not stamped yet: the front stamps it right after writing it
                if record is None or record[1] is not None:
                    break
                time.sleep(0.001)
                record = cancel_record(token) or record
            if record is not None:
                why, at = why or record[0], record[1]
            late = _cancel_age_ms(token) if at is None else max(0.0, (began - at) / 1e6)
            if why is not None and (last[0] is None or queued):
                self.cancel_log.record(why, late, None, 0)
            elif why is not None:
                self.cancel_log.record(why, late, (began - last[0]) / 1e6,
                                       steps.ended_after(at if at is not None else last[0]))
            elif not queued:
                last[0] = began
            return why

        path = cancel_path(token)
        return cancelled, (lambda: os.path.exists(path)) if path is not None else None

    @staticmethod
    def _inputs(request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        return get

    # Execution ------------------------------------------------------------------------------------------------------
    def execute(self, requests):
        from dflash_export.deploy.handler import generate_text, parse_request
        from dflash_export.runtime.single import RunStats

        if self.service is not None:  # every request joins the shared batch on its own thread
            import threading

            for request in requests:
                target = self._stream if self.decoupled else self._generate_one
                threading.Thread(target=target, args=(request,), daemon=True).start()
            return None
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        responses = []
        for request in requests:
            try:
                stats = RunStats()
                cancelled, _ = self._cancel_checks(request, None, stats)  # no shared batch to stop it
                responses.append(self._response(generate_text(self.runner, parse_request(self._inputs(request)),
                                                              cancelled, stats)))
            except Exception as e:  # noqa: BLE001 - any failure becomes this request's error, never the model's
                responses.append(self._error(e))
        return responses

    def _generate_one(self, request) -> None:
        """The default-mode model with a shared batch: one response through the request's sender."""
        from dflash_export.deploy.handler import generate_text, parse_request
        from dflash_export.runtime.single import RunStats

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stats = RunStats()
        try:
            cancelled, stopped = self._cancel_checks(request, sender, stats)
            response = self._response(generate_text(self.runner, parse_request(self._inputs(request)), cancelled,
                                                    stats, stopped))
        except Exception as e:  # noqa: BLE001 - any failure becomes this request's error, never the model's
            response = self._error(e)
        try:
            sender.send(response, flags=final)
        except Exception:  # noqa: BLE001 - a cancelled request's sender may refuse: nobody is listening
            pass

    def _stream(self, request) -> None:
        from dflash_export.deploy.handler import parse_request
        from dflash_export.runtime.single import RunStats

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stats = RunStats()
        try:
            cancelled, stopped = self._cancel_checks(request, sender, stats)
            for chunk in self.runner.run(parse_request(self._inputs(request)), cancelled, stats, stopped):
                sender.send(self._response(chunk), flags=final if chunk.finish_reason else 0)
        except Exception as e:  # noqa: BLE001
            try:
                sender.send(self._error(e), flags=final)
            except Exception:  # noqa: BLE001 - a cancelled request's sender may refuse: nobody is listening
                pass

    def finalize(self):
        if getattr(self, "cancel_log", None) is not None:
            self.cancel_log.flush()
        if getattr(self, "service", None) is not None:
            self.service.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
