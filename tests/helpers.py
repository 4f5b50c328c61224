"""Shared test code: tiny models, synthetic data, and hand-rolled reference algorithms."""

from __future__ import annotations

import torch
from torch import nn

from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.data import DataConfig
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.messages import Update
from ddiloco.model import ModelConfig
from ddiloco.run_config import RunConfig
from ddiloco.syncer import Syncer


class TinyNet(nn.Module):
    """Embedding + two blocks + head: enough names for fragments, milliseconds per step."""

    def __init__(self, vocab: int = 16, width: int = 8, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.token_embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.lm_head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.token_embedding(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.lm_head(x)


def make_batches(count: int, *, seed: int, batch: int = 4, length: int = 6, vocab: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length + 1), generator=generator) for _ in range(count)]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> int:
    """One inner step on next-token prediction; returns the number of target tokens."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return targets.numel()


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def make_system(num_learners: int, config: DilocoConfig, quorum: QuorumConfig | None = None, *,
                optimizer=sgd, syncer_seed: int = 100):
    """A syncer (initialised from its own seed) and `num_learners` joined learners on a virtual clock.

    Each learner's model is initialised from a different seed, so a test can tell whether a
    learner's own initialisation ever leaked into global state.
    """
    syncer = Syncer(config, quorum or QuorumConfig(), initial_params=params_of(TinyNet(seed=syncer_seed)))
    clock = VirtualClock()
    hub = InProcessHub(syncer, clock=clock)
    learners = []
    for learner_id in range(num_learners):
        model = TinyNet(seed=learner_id)
        learner = Learner(config, learner_id=learner_id, model=model, optimizer=optimizer(model))
        hub.join(learner)
        learners.append(learner)
    return syncer, hub, clock, learners


def committed_rounds(rounds: int, config: DilocoConfig, *, syncer_seed: int = 100):
    """(the syncer, its first `rounds` round records) of two learners of `make_system` (K = M) training on fixed
    batches until that many rounds have committed."""
    syncer, hub, _, learners = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"),
                                           syncer_seed=syncer_seed)
    batches = make_batches(64, seed=1)
    step = 0
    while syncer.rounds_committed < rounds:
        for learner in learners:
            tokens = train_step(learner.model, learner.optimizer, batches[step % len(batches)])
            hub.after_inner_step(learner, tokens)
        step += 1
    return syncer, hub.round_log[:rounds]


def filled_update(syncer, learner_id: int, fragment: int, *, inner_step: int, value: float = 1e-3):
    """An fp32 Update of `fragment` from `learner_id` on the syncer's current version, every value `value`, counting
    `inner_step` steps and 10 tokens a step: what a one-learner quorum merges into a round at once."""
    from ddiloco.compression import get_codec
    from ddiloco.messages import Update

    codec = get_codec("fp32")
    shapes = {t.name: t.shape for t in syncer.spec.tensors}
    payload = {name: codec.encode(torch.full(shapes[name], value)) for name in syncer.plan.fragments[fragment]}
    return Update(learner_id, fragment, syncer.versions[fragment], inner_step, inner_step, 10 * inner_step, "fp32",
                  payload)


# ---- the protocol's tests (tests/unit/test_protocol*.py) ------------------------------------------------

FP32 = dict(codec="fp32", downlink_codec="fp32")
"""Exact both ways: for tests that compare with arithmetic written out by hand."""


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def single_fragment(**overrides) -> DilocoConfig:
    """One fragment, a round every inner step, tau = 8, fp32 both ways; `overrides`: other `DilocoConfig` fields."""
    fields = dict(num_fragments=1, fragment_strategy="single", sync_every=1, overlap_steps=8, **FP32)
    return DilocoConfig(**(fields | overrides))


def publish(hub: InProcessHub, learner: Learner, clock: VirtualClock, at: float) -> None:
    """Advance the virtual clock to `at`, then train one inner step of `learner` and publish."""
    clock.advance_to(at)
    hub.advance()
    batch = make_batches(1, seed=learner.learner_id * 100 + learner.inner_step)[0]
    hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batch))


def train_two_steps(learner: Learner, seed: int) -> list[Update]:
    """Two inner steps of `learner` (sync_every = 2: one update); returns what it published."""
    updates = []
    for batch in make_batches(2, seed=seed):
        updates += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
    return updates


# ---- real processes, for the runtime's integration tests ----------------------------------------------

TINY_MODEL_FLAGS = ("--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1",
                    "--model-context-len", "32", "--data-context-len", "32", "--data-batch-size", "4")
"""A TinyGPT of about 20 k parameters: an inner step takes milliseconds, so rounds come fast."""
TINY_RUN = RunConfig(model=ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32),
                    data=DataConfig(context_len=32, batch_size=4), diloco=DilocoConfig(num_fragments=2, sync_every=8),
                    num_learners=1)
"""The run config of the same TinyGPT with one learner, for a syncer service started in the test's own process."""
PROCESS_WAIT_S = 90.0
"""Hard limit on one wait in an integration test (starting a process that imports torch takes seconds
on a loaded 2-core machine)."""
POLL_INTERVAL_S = 0.05


def wait_until(condition, what: str, *, timeout_s: float = PROCESS_WAIT_S, alive=()):
    """Poll `condition()` until it returns a truthy value (returned) or `timeout_s` passes (test fails).
    `alive`: Popen objects that must not exit meanwhile (their exit fails the test at once)."""
    import time

    import pytest

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        for popen in alive:
            if popen.poll() is not None:
                pytest.fail(f"process {popen.args!r} exited with {popen.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


def flip_bit_in_tensor_data(path, *, byte: int = 0, mask: int = 0x01) -> None:
    """Flip one bit of a safetensors file's tensor data (not its header), as a failing disk would. By default
    the lowest mantissa bit of the first value: a change no check of shapes or finiteness can see."""
    from pathlib import Path

    data = bytearray(Path(path).read_bytes())
    data_start = 8 + int.from_bytes(data[:8], "little")  # the u64 header length, then the JSON header
    data[data_start + byte] ^= mask
    Path(path).write_bytes(bytes(data))


SMALL_RUN = ("--learners", "2", "--num-fragments", "2", "--sync-every", "8", "--threads", "1", "--no-progress")
"""`ddiloco run` flags of a small, fast run (add --inner-steps)."""


def ddiloco_run(run_dir, *flags: str, command, timeout_s: float) -> tuple[int, str]:
    """`ddiloco run --run-dir RUN_DIR FLAGS -- COMMAND` from the repository root, to its end: (exit status, output).
    Past `timeout_s` its whole process group (the syncer and the learners too) is killed and the test fails."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *flags, "--",
                              *command], cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        output, _ = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        output, _ = popen.communicate()
        pytest.fail(f"ddiloco run still running after {timeout_s} s:\n{output[-3000:]}")
    return popen.returncode, output


ODD_MODEL_SCRIPT = '''
import sys
import torch
from torch import nn
import ddiloco


class Odd(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        self.mix = nn.Parameter((torch.eye(3) + 0.01 * torch.randn(3, 3)).t())  # a strided view
        self.none = nn.Parameter(torch.empty(0, 4))
        if mode == "nan":
            with torch.no_grad():
                self.body[2].bias[1] = float("nan")

    def forward(self, x):
        return self.body(x) @ self.mix


def build(mode):
    torch.manual_seed(0)
    return Odd(mode)


if __name__ == "__main__":
    env = ddiloco.environment()
    model = build(sys.argv[1])
    assert not model.mix.is_contiguous() and model.none.numel() == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A schedule shorter than the run's budget: its step past the total raises, from its saved state too.
    total = 12 if sys.argv[1] == "short_schedule" else 1000
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
    generator = torch.Generator().manual_seed(env.learner_id)
    with ddiloco.session(model, optimizer, state={"scheduler": scheduler}) as sync:
        while not sync.done:
            x = torch.randn(32, 4, generator=generator)
            loss = nn.functional.mse_loss(model(x), x[:, :3].sin())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            sync.step(tokens=len(x), loss=loss.item())
'''
"""A learner script (`python SCRIPT MODE`) whose model has a parameter with no values and a strided one. MODE "nan"
puts a NaN in its initial parameters; "short_schedule" gives it a learning-rate schedule of 12 steps, shorter than
a run's budget, so it fails at the same step at every restart; any other MODE, a schedule of 1000 steps."""


def finish_run(popen, *, timeout_s: float, interrupt: bool = False) -> str:
    """The output of a `ddiloco run` started in its own session, once it exits (after a SIGINT when `interrupt`).
    Never leaves it running: past `timeout_s` its process group is killed (its children follow it)."""
    import os
    import signal

    try:
        if interrupt and popen.poll() is None:
            popen.send_signal(signal.SIGINT)
        return popen.communicate(timeout=timeout_s)[0]
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)  # its children follow it (PR_SET_PDEATHSIG)
            popen.communicate()


class Processes:
    """Starts `ddiloco` subcommands as real processes (one torch thread each), logs each to a file,
    and kills every one it started, by PID, in `kill_all` (call it from a fixture's finally)."""

    def __init__(self, log_dir) -> None:
        from pathlib import Path

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started = []

    def start(self, name: str, *args: str):
        import os
        import subprocess
        import sys

        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = (self.log_dir / f"{name}.log").open("ab")
        popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "-v", *args], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.started.append(popen)
        return popen

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(encoding="utf-8", errors="replace")

    def kill_all(self) -> None:
        import os
        import signal

        for popen in self.started:
            if popen.poll() is None:
                os.kill(popen.pid, signal.SIGKILL)
            popen.wait()


def tiny_sim_workload(*, inner_steps: int = 16, batch_size: int = 2, eval_points: int = 2, lr: float = 3e-3):
    """A TinyGPT workload for the virtual-time harness that trains in milliseconds per inner step (at its full rate
    from the first step: no warm-up in runs this short)."""
    from ddiloco.data import DataConfig
    from ddiloco.model import ModelConfig
    from ddiloco.sim.workload import WorkloadConfig
    from ddiloco.training import InnerConfig

    model = ModelConfig(width=16, num_layers=2, num_heads=2, context_len=16)
    return WorkloadConfig(model=model, data=DataConfig(batch_size=batch_size, context_len=16),
                          inner=InnerConfig(lr=lr, warmup_steps=0), inner_steps=inner_steps, eval_points=eval_points,
                          val_batches=1)


DECOUPLED_DILOCO = DilocoConfig(num_fragments=4, sync_every=8, overlap_steps=2)
"""`run_decoupled`'s default DiLoCo settings: four fragments, a round every 8 inner steps, 2 steps of overlap."""


def run_decoupled(*, num=3, quorum=None, faults=None, steps=16, cluster=None, learner=None, diloco=DECOUPLED_DILOCO,
                  seed=0):
    """A Decoupled DiLoCo run of the virtual-time harness on `tiny_sim_workload`: (the sim, its result)."""
    from ddiloco.config import LearnerConfig
    from ddiloco.sim.cluster import ClusterConfig
    from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig

    config = DecoupledSimConfig(workload=tiny_sim_workload(inner_steps=steps),
                                cluster=cluster or ClusterConfig(num_learners=num), diloco=diloco,
                                quorum=quorum or QuorumConfig(), learner=learner or LearnerConfig(), seed=seed)
    sim = DecoupledSim(config, faults=faults)
    return sim, sim.run()


def assert_global_state_is_the_replay(run_dir) -> None:
    """The syncer's latest full state in a run directory equals its genesis (DIR/genesis.safetensors, whatever
    the model) with every committed round of the round log replayed on top, bit for bit."""
    from pathlib import Path

    from safetensors.torch import load_file

    from ddiloco.checkpoint import load_latest_state
    from ddiloco.round_log import RoundLog
    from ddiloco.run_config import RunConfig
    from ddiloco.syncer import replay_rounds

    run_dir = Path(run_dir)
    config = RunConfig.load(run_dir / "config.json")
    records = list(RoundLog(run_dir).records())
    replayed = replay_rounds(config.diloco, load_file(run_dir / "genesis.safetensors"), records)
    state, _, serial = load_latest_state(run_dir / "checkpoints" / "syncer")
    assert serial == len(records) > 0
    for name, tensor in replayed.items():
        assert torch.equal(state["global"][name], tensor), name


def self_signed_pair(directory, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 made by the openssl command, and its RSA key: (cert path,
    key path) in `directory`."""
    import subprocess

    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


class StubSyncerClient:
    """A `SyncerClient` for `LearnerIO` unit tests that reaches no syncer: heartbeats, leaves and cancels do nothing; a
    subclass says what its `subscribe(join)` does."""

    address = "127.0.0.1:1"

    def subscribe(self, join):
        raise NotImplementedError

    def heartbeat(self, *args, **kwargs):
        return None

    def take_downlink_missed(self):
        return False

    def cancel_subscription(self):
        pass

    def leave(self, *args, **kwargs):
        pass

    def close(self):
        pass


def process_state(pid: int) -> str:
    """The state letter of `pid` in /proc/PID/stat (T: stopped by a signal, as a chaos `hang` leaves it)."""
    from pathlib import Path

    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def wait_process_stopped(pid: int, *, stopped: bool, timeout_s: float) -> bool:
    """Whether `pid` is stopped (`stopped`) or running again (not `stopped`) within `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (process_state(pid) == "T") == stopped:
            return True
        time.sleep(0.01)
    return False
