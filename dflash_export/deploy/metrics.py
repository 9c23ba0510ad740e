"""What the front exposes on `/metrics` (Prometheus text format, through `prometheus_client`): DFlash's own figures
next to the request counts, taken from each finished generation's statistics (deploy/handler.py `step_stats`).

- `dflash_acceptance_length`: histogram of the tokens each DFlash step added to the answer (accepted drafts + the
  target's own token; the last step cut where the answer ends: max_tokens, a stop token or a stop string), one
  observation per step (the prefill's token is no step's); its mean is tau as `run` and `bench` report it, and a
  generation's lengths add up to its tokens after the first. Drafts the engine accepted past a stop string are
  not counted: they are in no answer. Its buckets: every length 1..16 and on to the engine's block (no step adds
  more), past 64 doubling.
- `dflash_tau`: tau over the generations that finished in the last `window_s` seconds; NaN (Prometheus' no value)
  while none with a step did, so that an idle server reads as no data, not as a tau of 0 an alert would fire on.
- `dflash_accepted_tokens_total`: the accepted drafts within those lengths (each step's length less one);
  `dflash_drafted_tokens_total`: the drafts the target verified, every step in full (the engine's work).
- `dflash_draft_seconds_total`, `dflash_verify_seconds_total`, `dflash_steps_total`: drafter and target time and
  step count (draft / verify time per step is their ratio; `dflash_step_seconds` holds the recent means, NaN as
  `dflash_tau` is).
- `dflash_generated_tokens_total`, `dflash_prompt_tokens_total`, `dflash_tokens_per_second` (recent window).
- `dflash_requests_in_flight` (the front's queue depth: requests sent to the engine and not yet answered, on any
  model), `dflash_batch_occupancy{model}` (one series per Triton model of the deployment, `dflash` and
  `dflash_stream`, which batch apart, each in its own instances: the model's in-flight requests over the sequences
  it decodes at once, instances x max batch, capped at 1; no series without the label, as one figure over both
  models would read full while each has free slots), `dflash_requests_total{route, code}` (code: the answer's HTTP
  status; for a stream that ended with an error event, after its head said 200, the status of that error).
- `dflash_admission_wait_seconds`: histogram of the seconds each generation waited to join its instance's shared
  batch before its prefill (behind `max_batch`, the K/V bound, or the step under way; 0 where instances run one
  request at a time: their queue is Triton's); its buckets reach the request timeout (a request that waits longer
  is answered 504, its wait never observed). `dflash_kv_token_limit{model}`: the K/V token bound of the shared batch
  the last generation finished on that model ran in (runtime/batching.py `max_kv_tokens`, which each instance works
  out when it loads; 0: unbounded, or no shared batch); no series for a model before one of its generations ends.
The `model` label takes only the deployment's own model names, never a name a request sent.
Figures a generation's statistics give that are not of their type, negative, not finite or past 2^53 are left out.
"""

from __future__ import annotations

import collections
import math
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dflash_export.decoding.request import is_int

__all__ = ["FrontMetrics", "CONTENT_TYPE_LATEST"]

ACCEPT_BUCKETS = tuple(float(b) for b in range(1, 17))  # at least these: a block of 16 (z-lab's drafters)
EVERY_LENGTH_UP_TO = 64  # past it, acceptance-length buckets double up to the block
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LONG_WAITS = (300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)  # to the longest request timeout (connection.py)
MAX_COUNT = 2 ** 53  # counts past it are not a generation's (nor exact as floats)


def accept_buckets(block_size: int | None) -> tuple[float, ...]:
    """Upper bounds of the acceptance-length histogram, from 1 to the block (`block_size`, the most tokens a step
    adds; 16 when smaller or not known): every length up to EVERY_LENGTH_UP_TO, then doubling, the block the last."""
    top = block_size if is_int(block_size) and block_size > len(ACCEPT_BUCKETS) else len(ACCEPT_BUCKETS)
    bounds = list(range(1, min(top, EVERY_LENGTH_UP_TO) + 1))
    while bounds[-1] < top:
        bounds.append(min(top, 2 * bounds[-1]))
    return tuple(float(b) for b in bounds)


def wait_buckets(timeout_s: float | None) -> tuple[float, ...]:
    """Upper bounds of the admission-wait histogram: WAIT_BUCKETS, then LONG_WAITS until one is at or past
    `timeout_s`, the request timeout (None: not known, WAIT_BUCKETS alone)."""
    bounds = list(WAIT_BUCKETS)
    for b in LONG_WAITS:
        if timeout_s is None or bounds[-1] >= timeout_s:
            break
        bounds.append(b)
    return tuple(bounds)


def _count(value) -> int | None:
    """A non-negative integer below MAX_COUNT (an integral float taken as one; not a bool); None for anything else."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if is_int(value) and 0 <= value < MAX_COUNT else None


def _seconds(value) -> float | None:
    """A finite, non-negative number (not a bool) as a float; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class FrontMetrics:
    """`models`: the deployment's Triton models (the only values of the `model` label); `capacity`: the sequences
    each of them decodes at once (instances x max batch); `block_size`: the engine's block (None: not known);
    `request_timeout_s`: the front's request timeout (the longest admission wait observed)."""

    def __init__(self, window_s: float = 60.0, capacity: int = 1, models: tuple[str, ...] = ("dflash", "dflash_stream"),
                 block_size: int | None = None, request_timeout_s: float | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.window_s = window_s
        self.capacity = max(1, capacity)
        self.models = tuple(dict.fromkeys(models))
        self.requests = Counter("dflash_requests", "HTTP requests answered by the front, by route and status (a "
                                "stream that ended with an error event: that error's status)", ["route", "code"],
                                registry=r)
        self.client_gone = Counter("dflash_requests_client_gone", "Generation requests whose client left before "
                                   "the answer (never answered, so not in dflash_requests); each was cancelled in "
                                   "the engine", registry=r)
        self.accept = Histogram("dflash_acceptance_length",
                                "Tokens each DFlash step added to the answer (accepted drafts + the target's token; "
                                "the last step cut where the answer ends at max_tokens, a stop token or a stop "
                                "string); its mean is tau, as run and bench report it",
                                buckets=accept_buckets(block_size), registry=r)
        self.draft_s = Counter("dflash_draft_seconds", "Seconds spent drafting", registry=r)
        self.verify_s = Counter("dflash_verify_seconds", "Seconds spent verifying with the target", registry=r)
        self.steps = Counter("dflash_steps", "DFlash steps (one target verification each)", registry=r)
        self.generated = Counter("dflash_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("dflash_prompt_tokens", "Prompt tokens processed", registry=r)
        self.drafted = Counter("dflash_drafted_tokens", "Draft tokens the target verified (every step in full)",
                               registry=r)
        self.accepted = Counter("dflash_accepted_tokens", "Accepted draft tokens added to the answer (each step's "
                                "acceptance length less one; none past where the answer ends)", registry=r)
        self.in_flight = Gauge("dflash_requests_in_flight", "Generation requests sent to the engine, not answered",
                               registry=r)
        self.occupancy = Gauge("dflash_batch_occupancy",
                               "In-flight requests on the model over the sequences it decodes at once (instances x "
                               "max batch; <= 1)", ["model"], registry=r)
        for model in self.models:
            self.occupancy.labels(model=model).set(0)
        self.tau = Gauge("dflash_tau", "tau: tokens added to the answer per DFlash step (the mean acceptance length, "
                         "the engine's decoding, adaptive) over the generations finished in the recent window (NaN: "
                         "none)", registry=r)
        self.tps = Gauge("dflash_tokens_per_second", "Generated tokens per second over the recent window",
                         registry=r)
        self.step_s = Gauge("dflash_step_seconds", "Mean seconds per step in the recent window (NaN: none)", ["phase"],
                            registry=r)
        self.admission_wait = Histogram("dflash_admission_wait_seconds",
                                        "Seconds each generation waited to join its instance's shared batch before "
                                        "its prefill (0 where instances run one request at a time)",
                                        buckets=wait_buckets(request_timeout_s), registry=r)
        self.upstream_waiting = Gauge("dflash_upstream_calls_waiting", "Calls to tritonserver waiting for one of "
                                      "the front's --max-upstream-calls slots (each choice of a request is a call)",
                                      registry=r)
        self.kv_limit = Gauge("dflash_kv_token_limit", "K/V token bound of the shared batch the last generation "
                              "finished on the model ran in (0: unbounded, or no shared batch)", ["model"],
                              registry=r)
        self._lock = threading.Lock()
        self._recent: collections.deque = collections.deque()  # (time, tokens, steps, committed, draft_s, verify_s)

    def set_in_flight(self, n: int, per_model: dict[str, int] | None = None) -> None:
        """`n` requests in flight in all, `per_model` of them on each model (a model left out: none; a name that is
        not one of the deployment's models is not counted in any occupancy)."""
        self.in_flight.set(n)
        per_model = per_model or {}
        for model in self.models:
            self.occupancy.labels(model=model).set(min(1.0, per_model.get(model, 0) / self.capacity))

    def observe_request(self, route: str, code: int) -> None:
        self.requests.labels(route=route, code=str(code)).inc()

    def observe_generation(self, completion_tokens: int, prompt_tokens: int, stats: dict | None,
                           model: str | None = None) -> None:
        """One finished generation on Triton model `model`: its token counts and `step_stats` (acceptance lengths
        per step, seconds, the admission wait and K/V bound). Every figure is checked before any is recorded; the
        K/V bound is recorded only for one of the deployment's models."""
        stats = stats if isinstance(stats, dict) else {}
        given = stats.get("acceptance_lengths")
        lengths = [n for n in map(_count, given if isinstance(given, list) else []) if n]
        draft_s = _seconds(stats.get("draft_s")) or 0.0
        verify_s = _seconds(stats.get("verify_s")) or 0.0
        completion_tokens = _count(completion_tokens) or 0
        prompt_tokens = _count(prompt_tokens) or 0
        wait_s = _seconds(stats.get("admission_wait_s"))
        kv_limit = _count(stats.get("kv_token_limit"))
        for n in lengths:
            self.accept.observe(n)
        self.steps.inc(len(lengths))
        self.draft_s.inc(draft_s)
        self.verify_s.inc(verify_s)
        self.generated.inc(completion_tokens)
        self.prompt.inc(prompt_tokens)
        self.drafted.inc(_count(stats.get("drafted_tokens")) or 0)
        self.accepted.inc(_count(stats.get("accepted_tokens")) or 0)
        if wait_s is not None:
            self.admission_wait.observe(wait_s)
        if kv_limit is not None and model in self.models:
            self.kv_limit.labels(model=model).set(kv_limit)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, completion_tokens, len(lengths), sum(lengths), draft_s, verify_s))
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        tokens = sum(r[1] for r in self._recent)
        steps = sum(r[2] for r in self._recent)
        committed = sum(r[3] for r in self._recent)
        # Means over no step have no value (NaN): 0 would read as a collapsed tau or free steps.
        self.tau.set(committed / steps if steps else math.nan)
        self.tps.set(tokens / self.window_s)
        self.step_s.labels(phase="draft").set(sum(r[4] for r in self._recent) / steps if steps else math.nan)
        self.step_s.labels(phase="verify").set(sum(r[5] for r in self._recent) / steps if steps else math.nan)

    def render(self) -> bytes:
        with self._lock:
            self._refresh(time.monotonic())
        return generate_latest(self.registry)
