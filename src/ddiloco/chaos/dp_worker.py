"""One rank of the synchronous data-parallel baseline: `python -m ddiloco.chaos.dp_worker ...`.

Ordinary DistributedDataParallel training, the way a torchrun job trains: M rank processes (M =
`RunConfig.num_learners`), torch.distributed over gloo on 127.0.0.1, rank r reading shard r of M, AdamW
with the run's `InnerConfig`, and DDP averaging the gradients in every backward (global batch = M x the
per-rank batch). `ddiloco.chaos.data_parallel.DataParallelJob` starts, watches and restarts the ranks; this
module owns what one rank does and the files they share (`JobPaths`).

One inner step: `ddiloco.training.inner_step` on the DDP-wrapped model (DDP's all-reduce runs inside its
backward, through `_GradientHook`), the emulated faults, then one all-reduce (MAX) of three control flags:
stop requested (SIGTERM), checkpoint due (rank 0's decision, by wall time) and non-finite loss or gradient.
So every rank acts on the same step: they checkpoint together, stop together and fail together. A step
count fixed from the wall time at start would not do: stragglers and link faults change the step time.

Checkpoints (model, AdamW state, global step, every rank's data cursor): each rank writes its cursor
durably to `checkpoints/cursors/R.json`, all ranks pass a barrier, then rank 0 reads the cursors and
writes the whole state with `ddiloco.checkpoint.save_state` (serial = global step; its JSON file is the
commit point). A new attempt loads the latest state, so the steps since it are computed again on the same
batches. On SIGTERM the ranks agree on a last step, rank 0 evaluates and they write a final checkpoint.

Faults from the rank's control file (`ddiloco.fault_control`), checked once per step:

- straggler (factor f): the rank sleeps (f - 1) x its compute time of the step (forward, backward with
  DDP's loopback all-reduce inside it, optimizer step); the others wait for it in the next collective.
- latency L / bandwidth B: the rank sleeps the extra time a ring all-reduce over its slowed link would take,
  `emulated_allreduce_s`: 2 (M - 1) x L + 2 (M - 1) / M x gradient_bytes / B. A ring moves at the pace of its
  slowest link, and the sleeps of several slowed ranks overlap, so the job pays the largest one. A stop request
  (SIGTERM) cuts any of these sleeps short.
- partition: the rank cannot take part in collectives, so it stalls (sleeps) while partitioned; the
  others block in their all-reduce until the gloo timeout, and the agent sees no progress.
- drop (probability p per step): a message of the collective is lost; gloo has no message-level
  recovery, so the rank fails the step (exit code EXIT_DROPPED) and the job restarts.
- corrupt (probability p per step): one byte of one element of the rank's gradient is flipped before the
  all-reduce (nothing in gloo checks it). If the loss or the averaged gradient becomes non-finite, every
  rank exits (EXIT_NONFINITE) and the job restarts from its checkpoint; otherwise the corrupted gradient
  is applied like any other (after gradient clipping), and training carries it.

For the agent, a rank rewrites `ranks/R/status.json` after every step (and with `waiting_since` set while it
waits for its peers in a collective), and a thread touches `ranks/R/alive` every ALIVE_EVERY_S.

Exit codes: 0 stopped by SIGTERM, 2 bad arguments, config or checkpoint, 3 dropped message, 4 non-finite loss
or gradient, 5 a collective failed (a peer died or the gloo timeout fired); 1 is an uncaught error (a bug).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddiloco.chaos.dp_common import (
    ALIVE_EVERY_S,
    EXIT_BAD_ARGS,
    EXIT_COLLECTIVE_FAILED,
    EXIT_DROPPED,
    EXIT_NONFINITE,
    EXIT_OK,
    LOOPBACK,
    PARTITION_POLL_S,
    JobPaths,
    RankConfig,
    emulated_allreduce_s,
    fault_seed,
    flip_byte,
    gradient_bytes,
    params_digest,
)
from ddiloco.checkpoint import atomic_write_json, load_latest_state, read_json, save_state
from ddiloco.data import load_corpus, shard_stream, validation_batches
from ddiloco.fault_control import ChaosControl
from ddiloco.metrics import JsonlSink
from ddiloco.model import build_model, estimate_loss
from ddiloco.run_config import RunConfig
from ddiloco.training import apply_inner_lr, inner_step, make_inner_optimizer

logger = logging.getLogger(__name__)

_STOP, _CHECKPOINT, _NONFINITE = range(3)
"""Positions of the control flags in the per-step all-reduce."""


class RankFailure(Exception):
    """This rank cannot go on; the job restarts. `exit_code` is one of the EXIT_* codes."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---- one rank -----------------------------------------------------------------------------------------------


class _GradientHook:
    """DDP communication hook: the default averaging all-reduce, plus the corrupt fault on the bytes that
    go on the wire (this rank's share of the average, before it is summed with the others)."""

    def __init__(self, world_size: int, rng: random.Random, *, before_send: Callable[[], None]) -> None:
        self.world_size = world_size
        self.rng = rng
        self.before_send = before_send
        self.corrupt_next = False

    # No annotations: DDP checks a hook's annotations against its own classes, and `from __future__ import
    # annotations` turns them into strings. bucket: dist.GradBucket; returns a Future of the averaged bucket.
    def allreduce(self, process_group, bucket):
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        if self.corrupt_next:
            self.corrupt_next = False
            element, byte = self.rng.randrange(buffer.numel()), self.rng.randrange(buffer.element_size())
            flip_byte(buffer, element=element, byte=byte)
            logger.warning("corrupt fault: flipped byte %d of gradient element %d before the all-reduce", byte,
                           element)
        self.before_send()
        future = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
        return future.then(lambda done: done.value()[0])


class DataParallelRank:
    """One rank's training loop (see the module docstring). `run()` returns the process's exit code."""

    def __init__(self, config: RankConfig, *, run_config: RunConfig, control: ChaosControl | None) -> None:
        if config.rank >= run_config.num_learners:
            raise ValueError(f"rank={config.rank} is invalid: the run has {run_config.num_learners} ranks "
                             f"(num_learners), so expected 0..{run_config.num_learners - 1}")
        self.config = config
        self.run_config = run_config
        self.control = control
        self.paths = JobPaths(Path(config.job_dir))
        self.rank = config.rank
        self.world_size = run_config.num_learners
        self.stop_requested = False
        self.step = 0
        self.from_step = 0
        self.val_loss: float | None = None
        self.checkpoint_step: int | None = None
        self._digest: tuple[int, str] | None = None
        self.sink = JsonlSink(self.paths.rank_metrics(self.rank))
        self._hook = _GradientHook(self.world_size, random.Random(fault_seed(run_config.seed, config.rank,
                                                                              config.attempt, stream=1)),
                                   before_send=self._mark_waiting)
        self._waiting_since: float | None = None

    def request_stop(self) -> None:
        """Safe from a signal handler: the ranks stop together after the current step."""
        self.stop_requested = True

    # ---- start ----

    def _build(self) -> None:
        """Model, optimizer, data and the checkpoint to resume from: all before the rendezvous, so a slow
        rank does not make the others wait inside gloo (where the short collective timeout applies)."""
        torch.manual_seed(self.run_config.seed)
        self.model = build_model(self.run_config.model)
        self.optimizer = make_inner_optimizer(self.model, self.run_config.inner)
        corpus = load_corpus()
        self.stream = shard_stream(corpus, self.run_config.data, shard=self.rank, num_shards=self.world_size)
        self.val_batches = validation_batches(corpus, self.run_config.data, num_batches=self.config.eval_batches)
        self.grad_bytes = gradient_bytes(self.model)
        latest = load_latest_state(self.paths.checkpoints)
        if latest is None:
            return
        state, _, serial = latest
        cursors = state["cursors"]
        if sorted(cursors) != [str(r) for r in range(self.world_size)]:
            raise ValueError(f"checkpoint at step {serial} holds data cursors of ranks {sorted(cursors)}, "
                             f"but this job has {self.world_size} ranks: use a fresh job directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(cursors[str(self.rank)])
        self.step = self.from_step = self.checkpoint_step = serial
        logger.info("[rank %d | step %d] resumed from checkpoint", self.rank, serial)

    def _join(self) -> None:
        timeout = datetime.timedelta(seconds=self.config.start_timeout_s)
        store = dist.TCPStore(LOOPBACK, self.config.master_port, self.world_size, is_master=self.rank == 0,
                              timeout=timeout)
        # Every rank is here (past its slow start) before gloo connects with its short timeout.
        store.set(f"arrived/{self.rank}", "1")
        store.wait([f"arrived/{r}" for r in range(self.world_size)], timeout)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))
        self.ddp = DistributedDataParallel(self.model)
        self.ddp.register_comm_hook(None, self._hook.allreduce)

    # ---- the loop ----

    def run(self, *, on_joined: Callable[[], None] = lambda: None) -> int:
        """Build, join, train until stopped; the exit code. `on_joined` runs once the rank is in the process
        group (the process installs its SIGTERM handler there: before, a plain SIGTERM ends a rank that may be
        blocked in the rendezvous, where a Python handler would not run)."""
        self._write_status("starting")
        threading.Thread(target=self._touch_alive, name="alive", daemon=True).start()
        try:
            self._build()
        except ValueError as exc:
            logger.error("[rank %d] %s", self.rank, exc)
            self.sink.close()
            return EXIT_BAD_ARGS
        try:
            self._collective(self._join, "joining the process group")
            on_joined()
            self._write_status("ready")
            self._train()
        except RankFailure as failure:
            logger.error("[rank %d | step %d] %s: exiting with code %d", self.rank, self.step, failure,
                         failure.exit_code)
            self._write_status("failed", error=str(failure))
            return failure.exit_code
        finally:
            self.sink.close()
        self._write_status("stopped")
        dist.destroy_process_group()
        return EXIT_OK

    def _train(self) -> None:
        started = time.monotonic()
        next_eval = started + self.config.eval_every_s
        next_checkpoint = started + self.config.checkpoint_every_s
        if self.rank == 0 and self.step == 0:
            self._evaluate()
        while True:
            step_started = time.monotonic()
            self._stall_while_partitioned()
            if self.control is not None and self.control.should_drop():
                raise RankFailure(EXIT_DROPPED, "a message of the all-reduce was dropped (drop fault); gloo cannot "
                                                "recover a lost message, so the step fails")
            self._hook.corrupt_next = self.control is not None and self.control.should_corrupt()
            compute_started = time.monotonic()
            batch = self.stream.next_batch()
            apply_inner_lr(self.optimizer, self.run_config.inner, self.step, self.run_config.inner_steps)
            loss = self._collective(lambda b=batch: inner_step(self.ddp, self.optimizer, b,
                                                               grad_clip=self.run_config.inner.grad_clip),
                                    "the gradient all-reduce")
            self._waiting_since = None
            compute_s = time.monotonic() - compute_started
            self._emulate_slow_rank_and_link(compute_s)
            checkpoint_due = self.rank == 0 and time.monotonic() >= next_checkpoint
            self._mark_waiting()
            flags = self._agree(stop=self.stop_requested, checkpoint=checkpoint_due,
                                nonfinite=not (math.isfinite(loss) and self._gradients_finite()))
            self._waiting_since = None
            if flags[_NONFINITE]:
                raise RankFailure(EXIT_NONFINITE, "the loss or the averaged gradient is not finite on some rank")
            self.step += 1
            self.sink.log({f"dp/{self.rank}/loss": loss, f"dp/{self.rank}/step_s": time.monotonic() - step_started,
                           "attempt": self.config.attempt}, step=self.step)
            if flags[_STOP]:
                if self.rank == 0:
                    self._evaluate()
                self._checkpoint()
                logger.info("[rank %d | step %d] stopped", self.rank, self.step)
                return
            if flags[_CHECKPOINT]:
                self._checkpoint()
                next_checkpoint = time.monotonic() + self.config.checkpoint_every_s
            if self.rank == 0 and time.monotonic() >= next_eval:
                self._evaluate()
                next_eval = time.monotonic() + self.config.eval_every_s
            self._write_status("training")

    def _stall_while_partitioned(self) -> None:
        while self.control is not None and self.control.partitioned() and not self.stop_requested:
            time.sleep(PARTITION_POLL_S)

    def _emulate_slow_rank_and_link(self, compute_s: float) -> None:
        if self.control is None:
            return
        delay_s = (self.control.slowdown() - 1.0) * compute_s
        delay_s += emulated_allreduce_s(self.world_size, self.grad_bytes, latency_s=self.control.extra_latency_s(),
                                        bytes_per_s=self.control.bandwidth_bytes_per_s())
        # In slices, not one time.sleep: the control file bounds the delay (`fault_control.value_bounds`), but a
        # long one must still end at a stop request, and none may overflow the platform's sleep.
        deadline = time.monotonic() + delay_s
        while not self.stop_requested and (left_s := deadline - time.monotonic()) > 0:
            time.sleep(min(left_s, PARTITION_POLL_S))

    def _gradients_finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self.model.parameters() if p.grad is not None)

    def _agree(self, *, stop: bool, checkpoint: bool, nonfinite: bool) -> list[bool]:
        flags = torch.tensor([float(stop), float(checkpoint), float(nonfinite)])
        self._collective(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX), "the control all-reduce")
        return [bool(value) for value in flags.tolist()]

    def _collective(self, action, what: str):
        """Run `action`; a gloo error (a dead peer, a timeout) fails this rank with EXIT_COLLECTIVE_FAILED.
        gloo raises plain RuntimeError, so this wraps only calls that communicate."""
        try:
            return action()
        except RuntimeError as exc:
            raise RankFailure(EXIT_COLLECTIVE_FAILED, f"{what} failed: {exc}") from exc

    # ---- checkpoints, evaluation, status ----

    def _checkpoint(self) -> None:
        atomic_write_json(self.paths.cursor(self.rank), {"step": self.step, "cursor": self.stream.state_dict()})
        self._mark_waiting()
        self._collective(dist.barrier, "the checkpoint barrier")
        self._waiting_since = None
        if self.rank == 0:
            cursors = {}
            for rank in range(self.world_size):
                record = read_json(self.paths.cursor(rank))
                if record is None or record.get("step") != self.step:
                    raise RankFailure(EXIT_COLLECTIVE_FAILED, f"rank {rank}'s data cursor for step {self.step} "
                                                              f"is missing from {self.paths.cursor(rank)}")
                cursors[str(rank)] = record["cursor"]
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "cursors": cursors}
            save_state(self.paths.checkpoints, state, serial=self.step,
                       meta={"attempt": self.config.attempt, "time": time.time()})
        self.checkpoint_step = self.step
        self._digest = (self.step, params_digest(self.model))
        logger.info("[rank %d | step %d] checkpoint", self.rank, self.step)

    def _evaluate(self) -> None:
        self.val_loss = estimate_loss(self.model, self.val_batches)
        self.sink.log({"dp/val_loss": self.val_loss, "attempt": self.config.attempt}, step=self.step)
        logger.info("[rank 0 | step %d] validation loss %.4f", self.step, self.val_loss)

    def _touch_alive(self) -> None:
        path = self.paths.rank_alive(self.rank)
        while True:
            path.touch()
            time.sleep(ALIVE_EVERY_S)

    def _mark_waiting(self) -> None:
        """Tell the agent this rank is about to wait for its peers (once per step): a rank that then shows no
        progress is waiting for a hung peer, not hung itself."""
        if self._waiting_since is None:
            self._waiting_since = time.time()
            self._write_status("training")

    def _write_status(self, phase: str, **extra: Any) -> None:
        """The heartbeat the agent watches: atomic, not fsynced (it is rewritten every step)."""
        status = {"rank": self.rank, "attempt": self.config.attempt, "phase": phase, "step": self.step,
                  "from_step": self.from_step, "time": time.time(), "checkpoint_step": self.checkpoint_step,
                  "val_loss": self.val_loss, "grad_bytes": getattr(self, "grad_bytes", None),
                  "waiting_since": self._waiting_since, **extra}
        if self._digest is not None:
            status["params_step"], status["params_sha256"] = self._digest
        atomic_write_json(self.paths.rank_status(self.rank), status, durable=False)


# ---- the process ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddiloco.chaos.dp_worker",
                                     description="One rank of ddiloco's synchronous data-parallel baseline "
                                                 "(started by DataParallelJob).")
    parser.add_argument("--settings", type=Path, required=True, metavar="FILE",
                        help="the rank's settings (RankConfig as JSON), written by its agent")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        config = RankConfig.load(args.settings)
        run_config = RunConfig.load(JobPaths(config.job_dir).config)
        control = None
        if config.chaos_control is not None:
            control = ChaosControl(config.chaos_control, seed=fault_seed(run_config.seed, config.rank, config.attempt,
                                                                         stream=0))
        rank = DataParallelRank(config, run_config=run_config, control=control)
    except ValueError as exc:
        print(f"dp_worker: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    torch.set_num_threads(config.threads)

    def stop_on_signals() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: rank.request_stop())

    return rank.run(on_joined=stop_on_signals)


if __name__ == "__main__":
    sys.exit(main())
