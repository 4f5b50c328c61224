"""`ddiloco.watch`: evaluate the global model while a run trains, outside the syncer.

An evaluator is a read-only subscriber. It never joins as a learner (the syncer does not count it, wait
for it, or merge anything from it); it receives the whole global model every `every_s` seconds once
new rounds have committed (the Watch call), loads it into the user's model, with the model's buffers (BatchNorm's
running statistics) averaged over the learners' latest (`ddiloco.model_buffers`, when it knows the run directory),
and runs the user's function, which returns a loss or a dict of metrics:

```python
if env.role == "evaluator":                 # ddiloco run --evaluate starts one such copy of the script
    ddiloco.watch(model, evaluate)          # returns when the run ends
```

Metrics go to `DIR/evaluator/metrics.jsonl` as `eval/NAME` (step = rounds committed) and the latest
values to `DIR/evaluator/status.json`, which the live view, the report and the plots read.

It reaches the syncer as a learner does (`ConnectWatch`, the run config's `learner.connect_timeout_s`): each
connection opens with a Status call, an answer even before the run has a genesis (a Watch sends nothing until then).
A refusal (a wrong token or schema) ends it at once with `RefusedError` (exit status 3, the syncer's reason in its
last log line); a syncer that never answered, with `UnreachableError` (exit status 4) after the connect timeout, with
a warning naming the address after a few failed attempts. Once the syncer has answered, the evaluator reconnects
without a bound (a restarted syncer, or its standby, serves the same run on the same address).

SIGTERM (the end of the run) makes it evaluate the latest global model once more and return, and so does the death
of the launcher that started it (`ddiloco.launcher_watch`). Whatever it waits for then, it stops within about
`STATUS_TIMEOUT_S`: without a global model (no genesis) or a syncer to ask, there is no final evaluation (one line
says why), and the final model's download is bounded by `FINAL_WELCOME_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from ddiloco.backoff import Backoff
from ddiloco.checkpoint import atomic_write_json
from ddiloco.checks import invalid
from ddiloco.exit_status import RefusedError, UnreachableError
from ddiloco.fragments import FragmentPlan, embedding_names
from ddiloco.interrupts import SIGNAL_CHECK_S, StopFlag
from ddiloco.launcher_watch import watch_launcher
from ddiloco.learner_group import unwrap
from ddiloco.messages import ModelSpec, Welcome
from ddiloco.metrics import MetricSink, NullSink, run_dir_sink
from ddiloco.model_buffers import load_buffers, merged_buffers
from ddiloco.model_checks import check_materialized
from ddiloco.run_config import RunConfig
from ddiloco.transport.grpc_client import ConnectWatch, Fault, classify, error_text

logger = logging.getLogger(__name__)

DEFAULT_EVERY_S = 10.0
EVALUATOR_DIR = "evaluator"
RECONNECT_S = (0.2, 5.0)
"""(first, longest) delay between attempts to reach the syncer again."""
STATUS_TIMEOUT_S = 2.0
"""Deadline of the Status call that opens each connection and the final evaluation. A syncer answers it at once (it
moves no tensor); the bound is how long a stop may wait on a syncer that does not answer."""
FINAL_WELCOME_TIMEOUT_S = 30.0
"""Longest the final evaluation waits for the global model once the syncer said it has one (it sends it at once):
a syncer that hangs does not hold the evaluator until the launcher's SIGKILL (`syncer_stop_timeout_s`, 120 s)."""

Evaluate = Callable[[nn.Module], "float | Mapping[str, float]"]


def _as_metrics(result: Any) -> dict[str, float]:
    """`evaluate`'s result as named floats: a dict of numbers, or one number (the validation loss). Anything else
    raises TypeError naming what was returned (a string or None gave float()'s message, naming nothing)."""
    items = result.items() if isinstance(result, Mapping) else [("val_loss", result)]
    metrics = {}
    for key, value in items:
        try:
            metrics[str(key)] = float(value.detach() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError):
            where = f"metric {key!r}" if isinstance(result, Mapping) else "its result"
            raise TypeError(f"ddiloco.watch: the evaluate function returned {value!r} as {where}: expected a number "
                            "(a float, an int, a one-value tensor) or a dict of them") from None
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        logger.warning("[evaluator] non-finite metric(s) %s", bad)
    return metrics


@torch.no_grad()
def load_global(model: nn.Module, welcome: Welcome) -> int:
    """Copy the global parameters of `welcome` into `model`; returns the rounds committed (the sum of the
    fragment versions: every round moves one fragment one version on)."""
    params = dict(model.named_parameters())
    for state in welcome.fragments:
        for name, tensor in state.tensors.items():
            params[name].copy_(tensor)
    return sum(state.version for state in welcome.fragments)


class Watcher:
    """Runs `evaluate` on the global model as a run trains (see the module docstring)."""

    def __init__(self, model: nn.Module, evaluate: Evaluate, *, address: str, config: RunConfig,
                 every_s: float = DEFAULT_EVERY_S, token: str | None = None, run_dir: Path | None = None,
                 sink: MetricSink | None = None, tls_ca: bytes | None = None,
                 tls_server_name: str | None = None, declare_config: bool = False) -> None:
        if not (math.isfinite(every_s) and every_s >= 0):
            raise invalid("every_s", every_s, "seconds >= 0")
        from ddiloco.transport.grpc_client import SyncerClient
        from ddiloco.transport.grpc_codec import WireModel

        plain = unwrap(model)  # the run's names: without a DDP, DataParallel or torch.compile wrapper's prefix
        check_materialized(plain, caller="ddiloco.watch(...)")  # its plan and wire spec need every shape
        params = dict(plain.named_parameters())
        plan = FragmentPlan.for_tensors(params, config.diloco,
                                        embeddings=embedding_names(plain, config.diloco.embedding_pattern))
        # The global model is float32 on the wire whatever the model trains in (as a learner's spec): a bfloat16 or
        # float64 model takes the values cast (`load_global`).
        wire = WireModel(ModelSpec.from_named_tensors(params.items()).in_dtype("float32"), plan,
                         config.diloco.codec, config.diloco.downlink_codec)
        self.client = SyncerClient(address, model=wire, diloco_config=config.diloco, token=token,
                                   tls_root_certificates=tls_ca, tls_server_name=tls_server_name)
        self._connect = ConnectWatch(self.client.address, connect_timeout_s=config.learner.connect_timeout_s,
                                     started_at=time.monotonic())
        self.model = model
        self.evaluate = evaluate
        self.every_s = every_s
        self._declared = config.to_dict() if declare_config else None
        """The run config the model and validation data were built from (the built-in evaluator's), which the
        syncer checks against its run's; None for a script's model."""
        self.run_dir = run_dir
        self.directory = run_dir / EVALUATOR_DIR if run_dir is not None else None
        self.buffers_of: list[int] = []
        """The learners whose buffers the latest evaluation averaged (none: the model's own were used)."""
        self._buffers: dict[str, torch.Tensor] = {}
        """The buffers the latest evaluation loaded."""
        self.sink = sink or (run_dir_sink(self.directory) if self.directory is not None else NullSink())
        self._stop = StopFlag()
        self.evaluations = 0
        self.latest: dict[str, float] = {}
        self.rounds = -1

    def request_stop(self) -> None:
        """End the evaluation loop (from a signal handler or another thread): `_cancelled_when` ends the Watch."""
        self._stop.set()

    def run(self) -> None:
        """Evaluate until stopped; then once more on the latest global model. Raises `RefusedError` (exit status 3)
        when the syncer refuses the evaluator, `UnreachableError` (4) when it never answered within the run config's
        `learner.connect_timeout_s`."""
        backoff = Backoff(*RECONNECT_S)
        try:
            while not self._stop.is_set():
                try:
                    self._follow(backoff)
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        break
                    self._failed(exc)
                self._sleep(backoff.next_delay())
            self._final()
        finally:
            self.client.close()
            self.sink.close()

    def _follow(self, backoff: Backoff) -> None:
        """One connection: the Status call (the syncer's answer, with or without a genesis), then the Watch until it
        ends or a stop is requested."""
        status = self.client.status(timeout_s=STATUS_TIMEOUT_S)
        self._connect.reached()
        if not status.get("genesis", True):
            logger.info("[evaluator] the syncer at %s has no global model yet (no genesis): waiting for it",
                        self.client.address)
        with self._cancelled_when(self._stop.is_set):
            for welcome in self.client.watch(min_interval_s=self.every_s, run_config=self._declared):
                backoff.reset()
                self._evaluate(welcome)
                if self._stop.is_set():
                    break

    def _failed(self, error: grpc.RpcError) -> None:
        """A connection that failed with `error`: the learner's rules (`ConnectWatch`). Raises when it gives up."""
        text, address = error_text(error), self.client.address
        fault = classify(error)
        if fault is Fault.REFUSED:
            logger.error("[evaluator] refused by the syncer at %s: %s", address, text)
            raise RefusedError(text)
        if fault is not Fault.TRANSIENT:  # an answer, if not a model
            self._connect.reached()
            logger.warning("[evaluator] the syncer at %s answered %s; retrying", address, text)
            return
        verdict = self._connect.failed(time.monotonic(), text)
        if verdict.give_up is not None:
            logger.error("[evaluator] %s", verdict.give_up)
            raise UnreachableError(verdict.give_up)
        if verdict.warning is not None:
            logger.warning("[evaluator] %s", verdict.warning)
        else:
            logger.debug("[evaluator] syncer at %s unreachable (%s); retrying", address, text)
        if self.client.next_address():  # several addresses: a syncer and its standbys
            logger.warning("[evaluator] syncer at %s unreachable: trying %s", address, self.client.address)

    def _sleep(self, delay_s: float) -> None:
        """Wait `delay_s` or until a stop is requested, in slices: a SIGTERM that another thread received is
        handled on this (main) thread between two (`ddiloco.interrupts`)."""
        deadline = time.monotonic() + delay_s
        while (left := deadline - time.monotonic()) > 0 and not self._stop.wait(min(left, SIGNAL_CHECK_S)):
            pass

    @contextlib.contextmanager
    def _cancelled_when(self, due: Callable[[], bool]) -> Iterator[None]:
        """Cancel the Watch opened inside once `due()` turns true, checked every `SIGNAL_CHECK_S` by a thread of
        its own. Not from `request_stop`: a signal handler may run while this thread holds the client's lock, and
        a stop that came while the call was being opened would find no call to cancel; here every check cancels
        the call there is then, so it ends even when it was opened after the stop."""
        done = threading.Event()

        def guard() -> None:
            while not done.wait(SIGNAL_CHECK_S):
                if due():
                    self.client.cancel_subscription()

        thread = threading.Thread(target=guard, name="evaluator-watch-guard", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _final(self) -> None:
        """Evaluate the latest global model once more if it is new, or only the learners' buffers are (they write
        their last ones as they finish, after their last round). Skipped, in one line that says why, when the
        syncer does not answer or the run has no global model."""
        try:
            status = self.client.status(timeout_s=STATUS_TIMEOUT_S)
        except grpc.RpcError as exc:
            logger.info("[evaluator] no final evaluation: the syncer at %s did not answer (%s)", self.client.address,
                        error_text(exc))
            return
        if not status.get("genesis", True):
            logger.warning("[evaluator] no final evaluation: the run has no global model yet (no learner made its "
                           "genesis)")
            return
        deadline = time.monotonic() + FINAL_WELCOME_TIMEOUT_S
        try:
            with self._cancelled_when(lambda: time.monotonic() > deadline):
                welcomes = self.client.watch(min_interval_s=0.0)
                try:
                    welcome = next(welcomes, None)
                finally:
                    welcomes.close()
        except grpc.RpcError as exc:
            logger.warning("[evaluator] no final evaluation: the syncer at %s sent no global model (%s; the wait is "
                           "bounded by %g s)", self.client.address, error_text(exc), FINAL_WELCOME_TIMEOUT_S)
            return
        if welcome is not None and (sum(s.version for s in welcome.fragments) != self.rounds
                                    or self._buffers_changed()):
            self._evaluate(welcome)

    def _buffers_changed(self) -> bool:
        if self.run_dir is None:
            return False
        buffers, _ = merged_buffers(self.run_dir)
        return buffers.keys() != self._buffers.keys() or any(not torch.equal(t, self._buffers[n])
                                                             for n, t in buffers.items())

    def _evaluate(self, welcome: Welcome) -> None:
        rounds = load_global(unwrap(self.model), welcome)
        if self.run_dir is not None:
            buffers, learners = merged_buffers(self.run_dir)
            load_buffers(self.model, buffers)
            if learners != self.buffers_of:
                logger.info("[evaluator] the model's buffers: their mean over learners %s", learners)
            self.buffers_of, self._buffers = learners, buffers
        was_training = self.model.training
        self.model.eval()
        started = time.monotonic()
        with torch.no_grad():  # an evaluation keeps no activations for a backward (torch.enable_grad() inside for one)
            metrics = _as_metrics(self.evaluate(self.model))
        self.model.train(was_training)
        self.rounds, self.latest = rounds, metrics
        self.evaluations += 1
        self.sink.log({**{f"eval/{k}": v for k, v in metrics.items()}, "eval/rounds_committed": rounds,
                       "eval/seconds": time.monotonic() - started}, step=rounds)
        logger.info("[evaluator | round %d] %s", rounds, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if self.directory is not None:
            atomic_write_json(self.directory / "status.json",
                              {"time": time.time(), "pid": os.getpid(), "rounds_committed": rounds,
                               "evaluations": self.evaluations, "metrics": metrics,
                               "val_loss": metrics.get("val_loss")}, durable=False)


def watch(model: nn.Module, evaluate: Evaluate, *, every_s: float | None = None, syncer: str | None = None,
          run_dir: str | Path | None = None, token_file: str | Path | None = None, token: str | None = None,
          config: RunConfig | str | Path | None = None, tls_ca: str | Path | None = None,
          tls_server_name: str | None = None, declare_config: bool = False) -> Watcher:
    """Evaluate the run's global model with `evaluate(model)` (a float loss, or a dict of metrics) every
    `every_s` seconds until the run ends (SIGTERM); returns the finished `Watcher`. `evaluate` runs with the model in
    eval mode and under `torch.no_grad()` (`torch.enable_grad()` inside it for a metric that needs gradients). Where
    to connect comes from the environment `ddiloco run` sets, or from the keywords (as for `ddiloco.session`).
    `declare_config`: the model and the data `evaluate` reads were built from `config` (the built-in evaluator's), so
    the syncer refuses the watch when a model or data setting differs from its run's."""
    from ddiloco.environment import environment

    env = environment()
    address = syncer or env.syncer
    if address is None:
        raise ValueError("ddiloco.watch: no syncer to watch. Start the script with `ddiloco run --evaluate -- "
                         "python SCRIPT`, or pass syncer='host:port'")
    run_dir = Path(run_dir) if run_dir is not None else env.run_dir
    if isinstance(config, RunConfig):
        run_config = config
    elif config is not None:
        run_config = RunConfig.load(config)
    elif env.config is not None:
        run_config = RunConfig.load(env.config)
    elif run_dir is not None and (run_dir / "config.json").is_file():
        run_config = RunConfig.load(run_dir / "config.json")
    else:
        run_config = RunConfig()
    token_path = token_file if token_file is not None else env.token_file
    if token is None and token_path is not None:
        from ddiloco.transport.auth import read_token_file

        token = read_token_file(token_path)
    tls = None
    if tls_ca is not None:
        from ddiloco.transport.auth import read_ca_file

        tls = read_ca_file(tls_ca)
    period = every_s if every_s is not None else env.eval_every_s
    watcher = Watcher(model, evaluate, address=address, config=run_config, every_s=period, token=token,
                      run_dir=run_dir, tls_ca=tls, tls_server_name=tls_server_name, declare_config=declare_config)
    previous = {}

    def stop(signum: int, frame: object) -> None:
        watcher.request_stop()

    if threading.current_thread() is threading.main_thread():
        # SIGHUP too where it has Python's default (a closed terminal), as a learner's session takes it.
        stops = [signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL else [])
        previous = {signum: signal.signal(signum, stop) for signum in stops}
    # A launcher that is gone (killed) ends the run as its SIGTERM would, also behind a wrapper (launcher_watch).
    launcher = watch_launcher(env.launcher, name="evaluator", on_gone=watcher.request_stop)
    try:
        watcher.run()
    except KeyboardInterrupt:
        pass
    finally:
        if launcher is not None:
            launcher.stop()
        for signum, handler in previous.items():
            if signal.getsignal(signum) is stop:  # one the evaluation's code set meanwhile stays, as in a session
                signal.signal(signum, handler)
    return watcher
