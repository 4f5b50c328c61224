"""The pure parts of the data-parallel baseline: emulated all-reduce time, the corrupt fault's byte flip, step
accounting over attempts, exit causes, and argument checks. The processes are tested in
tests/integration/test_chaos_data_parallel.py."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from ddiloco.chaos.data_parallel import (
    DataParallelAgentConfig,
    DataParallelJob,
    computed_steps,
    exit_cause,
    job_account,
)
from ddiloco.chaos.dp_common import (
    EXIT_BAD_ARGS,
    RankConfig,
    committed_steps,
    emulated_allreduce_s,
    fault_seed,
    flip_byte,
    gradient_bytes,
    params_digest,
)
from ddiloco.chaos.dp_worker import main
from ddiloco.data_parallel import StepAccount, account_steps, ring_allreduce_bytes, ring_allreduce_s
from ddiloco.model import ModelConfig, build_model
from ddiloco.run_config import RunConfig

# ---- emulated link time --------------------------------------------------------------------------------------


def test_emulated_allreduce_is_the_ring_formula():
    # M = 4: 2 (M - 1) = 6 latency hops; 2 (M - 1) / M = 1.5 gradients through the slow link.
    assert emulated_allreduce_s(4, 1000, latency_s=0.1, bytes_per_s=None) == pytest.approx(0.6)
    assert emulated_allreduce_s(4, 1000, latency_s=0.0, bytes_per_s=500.0) == pytest.approx(3.0)
    assert emulated_allreduce_s(4, 1000, latency_s=0.1, bytes_per_s=500.0) == pytest.approx(3.6)
    assert emulated_allreduce_s(2, 1000, latency_s=0.1, bytes_per_s=1000.0) == pytest.approx(0.2 + 1.0)


def test_a_single_rank_has_no_all_reduce_to_slow_down():
    assert emulated_allreduce_s(1, 10**9, latency_s=1.0, bytes_per_s=1.0) == 0.0


def test_one_ring_formula_for_the_emulation_the_harness_and_the_planner():
    # 1 MB over 4 replicas at 8 Mbit/s (1 MB/s) and 1 ms: 1.5 MB through every link, 6 hops.
    assert ring_allreduce_s(4, 10**6, latency_s=0.001, bandwidth_bps=8e6) == pytest.approx(1.5 + 0.006)
    assert emulated_allreduce_s(4, 10**6, latency_s=0.001, bytes_per_s=1e6) == pytest.approx(1.5 + 0.006)
    assert ring_allreduce_bytes(4, 1000) == 1500 and ring_allreduce_bytes(1, 1000) == 0


# ---- the corrupt fault ----------------------------------------------------------------------------------------


def test_flip_byte_inverts_exactly_one_byte_of_one_element():
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0])
    flip_byte(flat, element=2, byte=3)
    expected = bytearray(struct.pack("<f", 3.0))
    expected[3] ^= 0xFF
    assert flat[2].item() == struct.unpack("<f", bytes(expected))[0]
    assert flat[[0, 1, 3]].tolist() == [1.0, 2.0, 4.0]


def test_flipping_the_top_byte_of_a_float32_can_make_it_non_finite():
    flat = torch.tensor([1.0])  # 0x3F800000 -> 0xC0800000
    flip_byte(flat, element=0, byte=3)
    assert flat.item() == -4.0
    flat = torch.tensor([torch.finfo(torch.float32).tiny])  # 0x00800000 -> 0xFF800000
    flip_byte(flat, element=0, byte=3)
    assert flat.item() == -math.inf


@pytest.mark.parametrize(("element", "byte", "message"), [(4, 0, "element=4 is out of range"),
                                                          (-1, 0, "element=-1 is out of range"),
                                                          (0, 4, "byte=4 is out of range")])
def test_flip_byte_rejects_positions_outside_the_tensor(element, byte, message):
    with pytest.raises(ValueError, match=message):
        flip_byte(torch.zeros(4), element=element, byte=byte)


def test_flip_byte_needs_a_flat_tensor():
    with pytest.raises(ValueError, match="1-D contiguous"):
        flip_byte(torch.zeros(2, 2), element=0, byte=0)


# ---- step accounting -------------------------------------------------------------------------------------------


def steps_of(attempts: dict[int, range]) -> set[tuple[int, int]]:
    return {(attempt, step) for attempt, steps in attempts.items() for step in steps}


def test_rolled_back_steps_are_computed_twice_and_kept_once():
    # Attempt 1 trains 0 -> 50 and dies; the checkpoint was at 40. Attempt 2 dies before its first step.
    # Attempt 3 resumes at 40 and ends at 100 (its final checkpoint).
    account = job_account(steps_of({1: range(1, 51), 3: range(41, 101)}), {1: 0, 2: 40, 3: 40}, final_step=100)
    assert account == StepAccount(computed=50 + 60, kept=100)
    assert account.rolled_back == 10


def test_a_job_killed_while_waiting_keeps_only_its_checkpoint():
    account = job_account(steps_of({1: range(1, 74)}), {1: 0}, final_step=60)
    assert (account.computed, account.kept, account.rolled_back) == (73, 60, 13)


def test_the_analysis_and_the_summary_count_kept_steps_by_one_rule():
    # The analysis of a run directory has rank 0's step lines and no final checkpoint (final_step None: the
    # window's end cuts it); the same lines with the final step of the last attempt give the same account.
    lines = [(1, s) for s in range(1, 11)] + [(2, s) for s in range(6, 21)]
    assert account_steps(lines, {1: 0, 2: 5}) == StepAccount(computed=25, kept=20)
    assert account_steps(lines, {1: 0, 2: 5}, final_step=20) == account_steps(lines, {1: 0, 2: 5})
    assert account_steps(lines, {1: 0, 2: 5}, final_step=15) == StepAccount(computed=25, kept=15)


def test_step_accounting_rejects_impossible_logs():
    with pytest.raises(ValueError, match="attempt\\(s\\) \\[2\\], which never started"):
        job_account(steps_of({1: range(1, 6), 2: range(6, 10)}), {1: 0}, final_step=5)
    with pytest.raises(ValueError, match="attempt 2 logged step 3, before the step 10"):
        job_account(steps_of({1: range(1, 13), 2: range(3, 4)}), {1: 0, 2: 10}, final_step=10)
    with pytest.raises(ValueError, match="ends at step 20 but computed only 12"):
        job_account(steps_of({1: range(1, 13)}), {1: 0}, final_step=20)


def test_computed_steps_reads_step_lines_only_and_skips_a_torn_line():
    lines = [json.dumps({"step": 1, "time": 0.0, "dp/0/loss": 5.0, "attempt": 1}),
             json.dumps({"step": 0, "time": 0.0, "dp/val_loss": 5.5, "attempt": 1}),
             json.dumps({"step": 2, "time": 0.0, "dp/0/loss": 4.9, "attempt": 1}),
             json.dumps({"step": 1, "time": 0.0, "dp/0/loss": 5.0, "attempt": 2}),
             '{"step": 7, "ti']
    assert computed_steps(lines) == {(1, 1), (1, 2), (2, 1)}


def test_committed_steps_are_the_checkpoint_json_files(tmp_path):
    for name in ("state_000000040.json", "state_000000040.safetensors", "state_000000007.json",
                 ".state_000000050.json.123.tmp", "other.json"):
        (tmp_path / name).write_text("{}")
    assert committed_steps(tmp_path) == [7, 40]
    assert committed_steps(tmp_path / "missing") == []


# ---- exit causes -------------------------------------------------------------------------------------------------


def test_exit_causes_name_the_signal_or_the_meaning():
    assert exit_cause(-9) == "signal SIGKILL"
    assert exit_cause(-15) == "signal SIGTERM"
    assert exit_cause(3) == "exit code 3 (a message of the all-reduce was dropped)"
    assert exit_cause(4) == "exit code 4 (non-finite loss or gradient)"
    assert exit_cause(1) == "exit code 1"


# ---- replicas and seeds --------------------------------------------------------------------------------------------


def test_params_digest_tells_replicas_apart_bitwise():
    config = ModelConfig(width=16, num_heads=2, num_layers=1, context_len=8)
    torch.manual_seed(0)
    a = build_model(config)
    torch.manual_seed(0)
    b = build_model(config)
    assert params_digest(a) == params_digest(b)
    with torch.no_grad():
        b.lm_head.weight.view(-1)[0] = torch.nextafter(b.lm_head.weight.view(-1)[0], torch.tensor(1.0))
    assert params_digest(a) != params_digest(b)
    assert gradient_bytes(a) == 4 * sum(p.numel() for p in a.parameters())


def test_fault_seeds_repeat_per_run_and_differ_per_rank_attempt_and_stream():
    seeds = {fault_seed(0, rank, attempt, stream=stream) for rank in (0, 1) for attempt in (1, 2)
             for stream in (0, 1)}
    assert len(seeds) == 8
    assert fault_seed(0, 1, 2, stream=0) == fault_seed(0, 1, 2, stream=0)
    assert fault_seed(1, 1, 2, stream=0) != fault_seed(0, 1, 2, stream=0)


# ---- argument checks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("threads", 0), ("eval_batches", 0), ("hang_timeout_s", 0.0),
                                              ("checkpoint_every_s", -1.0), ("eval_every_s", math.nan),
                                              ("stop_timeout_s", math.inf), ("poll_s", "0.1")])
def test_data_parallel_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        DataParallelAgentConfig(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("rank", -1), ("attempt", 0), ("master_port", 70000),
                                              ("collective_timeout_s", 0.0), ("eval_batches", 0)])
def test_rank_config_names_the_bad_field(tmp_path, field, value):
    values = {"job_dir": tmp_path, "rank": 0, "attempt": 1, "master_port": 29500, field: value}
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        RankConfig(**values)


def test_the_job_checks_ranks_and_hold_times(tmp_path):
    job = DataParallelJob(DataParallelAgentConfig(), run_config=RunConfig(num_learners=2), job_dir=tmp_path)
    with pytest.raises(ValueError, match="rank=2 is invalid: the job has ranks 0..1"):
        job.hold(2, 0.0)
    with pytest.raises(ValueError, match="until=inf is invalid"):
        job.hold(0, math.inf)
    with pytest.raises(ValueError, match="rank=-1 is invalid"):
        job.control_file(-1)
    with pytest.raises(ValueError, match="duration_s=0 is invalid"):
        job.run(0)
    with pytest.raises(RuntimeError, match="never started"):
        job.stop()
    assert job.control_file(1) == tmp_path / "ranks" / "1" / "chaos.json"
    assert job.pids() == {} and not job.running and not job.finished


def _settings(tmp_path, rank: int) -> list[str]:
    path = RankConfig(job_dir=tmp_path, rank=rank, attempt=1, master_port=29500).save(tmp_path / "rank.json")
    return ["--settings", str(path)]


def test_worker_rejects_a_rank_outside_the_run(tmp_path, capsys):
    RunConfig(num_learners=2).save(tmp_path / "config.json")
    code = main(_settings(tmp_path, 2))
    assert code == EXIT_BAD_ARGS
    assert "rank=2 is invalid: the run has 2 ranks (num_learners), so expected 0..1" in capsys.readouterr().err


def test_worker_names_a_missing_config(tmp_path, capsys):
    code = main(_settings(tmp_path, 0))
    assert code == EXIT_BAD_ARGS
    assert f"run config {tmp_path / 'config.json'} does not exist" in capsys.readouterr().err


def test_rank_settings_go_through_their_file_unchanged_and_a_bad_file_is_named(tmp_path, capsys):
    settings = RankConfig(job_dir=tmp_path, rank=1, attempt=3, master_port=29501, eval_every_s=2.5, threads=2,
                          chaos_control=tmp_path / "ranks" / "1" / "chaos.json")
    assert RankConfig.load(settings.save(tmp_path / "settings" / "rank-1.json")) == settings
    (tmp_path / "bad.json").write_text('{"rank": 0, "nonsense": 1}')
    assert main(["--settings", str(tmp_path / "bad.json")]) == EXIT_BAD_ARGS
    assert f"settings file {tmp_path / 'bad.json'} is invalid" in capsys.readouterr().err
