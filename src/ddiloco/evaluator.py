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
values to `DIR/evaluator/status.json`, which the live view, the report and the plots read. When the
syncer goes away the evaluator reconnects (a restarted syncer serves the same run); SIGTERM (the end of
the run) makes it evaluate the latest global model once more and return, and so does the death of the launcher that
started it (`ddiloco.launcher_watch`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from ddiloco.checkpoint import atomic_write_json
from ddiloco.checks import invalid
from ddiloco.fragments import FragmentPlan, embedding_names
from ddiloco.launcher_watch import watch_launcher
from ddiloco.learner_group import unwrap
from ddiloco.messages import ModelSpec, Welcome
from ddiloco.metrics import MetricSink, NullSink, run_dir_sink
from ddiloco.model_buffers import load_buffers, merged_buffers
from ddiloco.run_config import RunConfig

logger = logging.getLogger(__name__)

DEFAULT_EVERY_S = 10.0
EVALUATOR_DIR = "evaluator"
RECONNECT_S = (0.2, 5.0)
"""(first, longest) delay between attempts to reach the syncer again."""

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
                 tls_server_name: str | None = None) -> None:
        if not (math.isfinite(every_s) and every_s >= 0):
            raise invalid("every_s", every_s, "seconds >= 0")
        from ddiloco.transport.grpc_client import SyncerClient
        from ddiloco.transport.grpc_codec import WireModel

        plain = unwrap(model)  # the run's names: without a DDP or torch.compile wrapper's prefix
        params = dict(plain.named_parameters())
        plan = FragmentPlan.for_tensors(params, config.diloco,
                                        embeddings=embedding_names(plain, config.diloco.embedding_pattern))
        wire = WireModel(ModelSpec.from_named_tensors(params.items()), plan, config.diloco.codec,
                         config.diloco.downlink_codec)
        self.client = SyncerClient(address, model=wire, diloco_config=config.diloco, token=token,
                                   tls_root_certificates=tls_ca, tls_server_name=tls_server_name)
        self.model = model
        self.evaluate = evaluate
        self.every_s = every_s
        self.run_dir = run_dir
        self.directory = run_dir / EVALUATOR_DIR if run_dir is not None else None
        self.buffers_of: list[int] = []
        """The learners whose buffers the latest evaluation averaged (none: the model's own were used)."""
        self._buffers: dict[str, torch.Tensor] = {}
        """The buffers the latest evaluation loaded."""
        self.sink = sink or (run_dir_sink(self.directory) if self.directory is not None else NullSink())
        self._stop = threading.Event()
        self.evaluations = 0
        self.latest: dict[str, float] = {}
        self.rounds = -1

    def request_stop(self) -> None:
        self._stop.set()
        threading.Thread(target=self.client.cancel_subscription, daemon=True).start()

    def run(self) -> None:
        """Evaluate until stopped; then once more on the latest global model."""
        delay = RECONNECT_S[0]
        while not self._stop.is_set():
            try:
                for welcome in self.client.watch(min_interval_s=self.every_s):
                    self._evaluate(welcome)
                    delay = RECONNECT_S[0]
                    if self._stop.is_set():
                        break
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    logger.info("[evaluator] syncer unreachable (%s); retrying", exc.code() if hasattr(exc, "code")
                                else exc)
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, RECONNECT_S[1])
        self._final()
        self.client.close()
        self.sink.close()

    def _final(self) -> None:
        try:
            welcome = next(iter(self.client.watch(min_interval_s=0.0)), None)
        except grpc.RpcError:
            welcome = None  # the syncer is gone already: the last evaluation stands
        # Also when only the buffers changed: the learners write their last ones as they finish, after their last round.
        if welcome is None:
            return
        if sum(s.version for s in welcome.fragments) != self.rounds or self._buffers_changed():
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
          tls_server_name: str | None = None) -> Watcher:
    """Evaluate the run's global model with `evaluate(model)` (a float loss, or a dict of metrics) every
    `every_s` seconds until the run ends (SIGTERM); returns the finished `Watcher`. `evaluate` runs with the model in
    eval mode and under `torch.no_grad()` (`torch.enable_grad()` inside it for a metric that needs gradients). Where
    to connect comes from the environment `ddiloco run` sets, or from the keywords (as for `ddiloco.session`)."""
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
                      run_dir=run_dir, tls_ca=tls, tls_server_name=tls_server_name)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: watcher.request_stop())
    # A launcher that is gone (killed) ends the run as its SIGTERM would, also behind a wrapper (launcher_watch).
    launcher = watch_launcher(env.launcher, name="evaluator", on_gone=watcher.request_stop)
    try:
        watcher.run()
    except KeyboardInterrupt:
        pass
    finally:
        if launcher is not None:
            launcher.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return watcher
