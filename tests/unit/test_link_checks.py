"""A `--link` on which a learner could never stay in its run is refused, and one that takes minutes to bring it the
global model is announced (`transport.link.check_link`, what a learner calls at its start)."""

from __future__ import annotations

import logging

import pytest
import torch

from ddiloco.config import DilocoConfig
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import ModelSpec
from ddiloco.transport.grpc_client import SyncerClient
from ddiloco.transport.grpc_codec import WireModel
from ddiloco.transport.link import EmulatedLink, check_link, parse_link

HEARTBEAT_TIMEOUT_S = 30.0
TINYGPT_BYTES = 1_900_000
"""About the built-in TinyGPT's float32 size (its Welcome)."""


def test_a_latency_of_at_least_the_heartbeat_timeout_is_refused_in_one_line():
    for text in ("1gbit,40s", "1gbit,30s"):
        with pytest.raises(ValueError, match="heartbeat timeout") as error:
            check_link(parse_link(text), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        assert "\n" not in str(error.value) and "--heartbeat-timeout-s" in str(error.value)
    assert check_link(parse_link("1gbit,29s"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) is None


def test_a_link_that_takes_minutes_to_bring_the_welcome_says_how_long():
    # 1.9 MB at 10 kbit/s: 1520 s of transfer, plus 10 ms.
    warning = check_link(parse_link("10kbit,10ms"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                         model_bytes=TINYGPT_BYTES)
    assert warning is not None and "25 min" in warning and "10 kbit/s" in warning and "joining" in warning
    assert check_link(parse_link("2.5gbit,40ms"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                      model_bytes=TINYGPT_BYTES) is None


def test_a_learners_client_warns_once_of_a_slow_link(caplog):
    params = {"w": torch.zeros(1000, 500)}  # 2 MB as float32
    config = DilocoConfig(num_fragments=1)
    wire = WireModel(ModelSpec.from_named_tensors(params.items()), FragmentPlan.for_tensors(params, config),
                     config.codec, config.downlink_codec)
    with caplog.at_level(logging.WARNING):
        client = SyncerClient("127.0.0.1:1", model=wire, diloco_config=config,
                              link=EmulatedLink(parse_link("10kbit,10ms")))
        client.close()
        fast = SyncerClient("127.0.0.1:1", model=wire, diloco_config=config,
                            link=EmulatedLink(parse_link("1gbit,10ms")))
        fast.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "27 min" in lines[0], lines


def test_ddiloco_run_refuses_a_link_no_learner_could_stay_on_before_anything_starts(tmp_path, capsys):
    from ddiloco.cli import main

    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--learners", "2", "--link", "1gbit,40s"]) == 2
    error = capsys.readouterr().err
    assert "link latency 40 s is invalid: it must be below the run's heartbeat timeout (30 s)" in error
    assert not run_dir.exists()


def test_a_scripts_session_refuses_such_a_link_at_its_start():
    import torch

    import ddiloco

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(2)))  # four tensors: four fragments
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (pytest.raises(ValueError, match="link latency 40 s is invalid"),
          ddiloco.session(model, optimizer, syncer="127.0.0.1:1", learner_id=0, link="1gbit,40s")):
        pass
