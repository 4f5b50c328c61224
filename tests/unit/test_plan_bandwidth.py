"""The bandwidth planner and the run-bytes prediction, against bytes computed by hand."""

import argparse
import json

import pytest
import torch

from ddiloco.plan import commands
from ddiloco.plan.bandwidth import GBPS, WIRE_FORMATS, BandwidthConfig, encoded_nbytes, parse_regions, plan_bandwidth
from ddiloco.plan.run_bytes import even_fragments, fragment_numels, predict_run_bytes, rounds_due

# ---- codec bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "numel", "nbytes"), [
    ("fp32", 100, 400), ("bf16", 100, 200),
    ("fp8", 100, 4 + 100),                 # one float32 scale per tensor
    ("int8", 100, 4 + 100), ("int8", 257, 2 * 4 + 257),  # one scale per block of 256
    ("int4", 100, 2 * 4 + 50),             # 2 blocks of 64 -> 2 scales; 100 nibbles -> 50 bytes
    ("int4", 64, 4 + 32), ("int4", 1, 4 + 1),
    ("int2", 100, 2 * 4 + 25), ("int2", 3, 4 + 1),
])
def test_encoded_nbytes_by_hand(codec, numel, nbytes):
    assert encoded_nbytes(codec, numel) == nbytes


def test_wire_formats_match_ddiloco_compression():
    compression = pytest.importorskip("ddiloco.compression")
    for codec in WIRE_FORMATS:
        for numel in (0, 1, 2, 3, 63, 64, 65, 100, 4097, 10**9 + 7):
            assert encoded_nbytes(codec, numel) == compression.get_codec(codec).encoded_nbytes(numel), (codec, numel)


# ---- planner ------------------------------------------------------------------------------------


def test_twelve_b_model_across_four_regions_by_hand():
    plan = plan_bandwidth(BandwidthConfig(params=12e9, step_time_s=2.0, learners=4, num_fragments=24, sync_every=24,
                                          overlap_steps=2, codec="int4", downlink_codec="int4"))
    systems = plan.by_system()
    # One fragment of 5e8 values per inner step: 2.5e8 B of nibbles + 4 B per 64 values = 281.25 MB.
    fragment = 250_000_000 + 4 * 7_812_500
    decoupled = systems["decoupled"]
    assert decoupled.up_bytes_per_inner_step == fragment
    assert decoupled.learner.up_bps == pytest.approx(fragment * 8 / 2.0)   # 1.125 Gbps
    # Round trip (up + down) within tau = 2 steps of 2 s needs the same 1.125 Gbps.
    assert decoupled.learner.required_bps == pytest.approx(1.125 * GBPS)
    assert decoupled.syncer.up_bps == pytest.approx(4 * 1.125 * GBPS)
    # Data-parallel: ring over 4 regions, 2 * 3/4 * 24 GB of bf16 gradients per 2 s step = 144 Gbps.
    dp = systems["data_parallel"]
    assert dp.learner.required_bps == pytest.approx(2 * 3 / 4 * 24e9 * 8 / 2.0)
    assert dp.learner.required_bps / decoupled.learner.required_bps == pytest.approx(128, rel=1e-9)
    # Synchronous DiLoCo: 2 x 6.75 GB every 24 steps, allowed to add 5 % of 48 s: 2.4 s.
    sync = systems["synchronous_diloco"]
    assert sync.learner.required_bps == pytest.approx(2 * (6e9 + 4 * 187_500_000) * 8 / 2.4)
    assert sync.learner.up_bps == pytest.approx(decoupled.learner.up_bps)


def test_fp32_downlink_dominates_and_the_round_trip_window_can_bind():
    decoupled = plan_bandwidth(BandwidthConfig(params=24e6, step_time_s=1.0, num_fragments=4, sync_every=24,
                                               overlap_steps=1, codec="int4", downlink_codec="fp32")).systems[0]
    up, down = 6e6 * 0.5 + 4 * 93_750, 6e6 * 4
    # A round every 6 steps (averages low), but up + down must move within tau = 1 step.
    assert decoupled.learner.up_bps == pytest.approx(up * 8 / 6.0)
    assert decoupled.learner.down_bps == pytest.approx(down * 8 / 6.0)
    assert decoupled.learner.required_bps == pytest.approx((up + down) * 8 / 1.0)


def test_tau_zero_blocks_and_sizes_the_link_by_the_allowed_overhead():
    decoupled = plan_bandwidth(BandwidthConfig(params=24e6, step_time_s=1.0, num_fragments=24, sync_every=24,
                                               overlap_steps=0, codec="bf16", downlink_codec="bf16",
                                               blocking_overhead=0.1)).systems[0]
    assert decoupled.learner.required_bps == pytest.approx(2 * 2e6 * 8 / 0.1)


def test_regions_share_wan_links_and_the_syncer_region_stays_local():
    config = BandwidthConfig(params=24e6, learners=4, regions="east:2,west:1,eu:1", syncer_region="east")
    decoupled = plan_bandwidth(config).by_system()["decoupled"]
    links = {link.name: link for link in decoupled.regions}
    assert set(links) == {"WAN west", "WAN eu", "WAN east (syncer)"}
    assert links["WAN west"].up_bps == pytest.approx(decoupled.learner.up_bps)
    assert links["WAN east (syncer)"].up_bps == pytest.approx(2 * decoupled.learner.up_bps)
    assert decoupled.syncer.up_bps == pytest.approx(4 * decoupled.learner.up_bps)
    dp = plan_bandwidth(config).by_system()["data_parallel"]
    assert dp.learner.up_bps == pytest.approx(2 * 2 / 3 * 48e6 * 8 / config.step_time_s)  # 3 regions


@pytest.mark.parametrize(("spec", "learners", "match"), [("a:2,b", 4, "places 3 learners"),
                                                         ("a:0", 0 + 1, "regions="), ("a:1,a:1", 2, "distinct")])
def test_parse_regions_rejects_bad_specs(spec, learners, match):
    with pytest.raises(ValueError, match=match):
        parse_regions(spec, learners)


def test_parse_regions_default_is_one_region_per_learner():
    assert parse_regions("", 3) == {"region-0": 1, "region-1": 1, "region-2": 1}


def test_every_assumption_is_stated():
    text = " ".join(plan_bandwidth(BandwidthConfig()).assumptions)
    for needle in ("P = 24", "H = 24", "tau = 2", "int4", "int8", "fp32", "ring", "full duplex", "syncer's merge time"):
        assert needle in text


# ---- bytes of ddiloco's own runs ----------------------------------------------------------------


def test_rounds_due_counts_the_schedule():
    from ddiloco.fragments import due_step

    for sync_every, fragments in ((4, 2), (24, 24), (32, 4), (5, 3), (3, 5)):
        for steps in range(40):
            brute = sum(1 for r in range(200) if steps >= 1 and due_step(r, sync_every, fragments) <= steps)
            assert rounds_due(steps, sync_every, fragments) == brute


def test_predict_run_bytes_by_hand():
    # P = 2, H = 4: rounds due at inner steps 2, 4, 6, 8, 10 -> fragments 0, 1, 0, 1, 0 by step 10.
    bytes_ = predict_run_bytes(fragment_numels=[[100, 28], [64]], codec="int4", sync_every=4, inner_steps=10,
                               learners=3, downlink_codec="fp32", final_flush=False)
    fragment0 = (2 * 4 + 50) + (4 + 14)   # int4, each tensor encoded on its own: 58 + 18
    fragment1 = 4 + 32
    assert bytes_.rounds_per_learner == 5
    assert bytes_.learner_sent == 3 * fragment0 + 2 * fragment1 == 300
    # Join: the whole model in fp32 (192 values); then each round's merged fragment in fp32.
    assert bytes_.learner_received == 4 * 192 + 3 * 4 * 128 + 2 * 4 * 64 == 2816
    assert bytes_.syncer_received == 3 * 300 and bytes_.syncer_sent == 3 * 2816
    # The end: fragment 0's round fell due at step 10 (still waiting for its result), fragment 1 was
    # last synced at step 8 and trained 2 more steps: the final flush publishes fragment 1 once more.
    flushed = predict_run_bytes(fragment_numels=[[100, 28], [64]], codec="int4", sync_every=4, inner_steps=10,
                                learners=3, downlink_codec="fp32")
    assert flushed.flush_sent == fragment1 and flushed.learner_sent == 300 + fragment1
    assert flushed.flush_received_max == 3 * 4 * 64 and flushed.genesis_sent == 4 * 192


def test_predict_run_bytes_with_the_int8_downlink_by_hand():
    # As above, but each round sends the fragment's change in int8: per tensor 1 B/value + a 4 B scale
    # per 256 values. The join and the genesis stay float32.
    bytes_ = predict_run_bytes(fragment_numels=[[100, 28], [64]], codec="int4", sync_every=4, inner_steps=10,
                               learners=3, downlink_codec="int8")
    fragment0, fragment1 = (4 + 100) + (4 + 28), 4 + 64
    assert bytes_.learner_received == 4 * 192 + 3 * fragment0 + 2 * fragment1 == 1312
    assert bytes_.syncer_sent == 3 * 1312
    assert bytes_.flush_received_max == 3 * fragment1 and bytes_.genesis_sent == 4 * 192


def test_even_fragments_split_the_parameter_count():
    assert even_fragments(10, 3) == [[4], [3], [3]]
    with pytest.raises(ValueError, match="num_params"):
        even_fragments(2, 3)


@pytest.mark.parametrize("downlink_codec", ["fp32", "int8", "int4"])
def test_prediction_matches_a_real_in_process_run_exactly(downlink_codec):
    from ddiloco.config import DilocoConfig, QuorumConfig
    from ddiloco.inprocess import InProcessHub
    from ddiloco.learner import Learner
    from ddiloco.syncer import Syncer
    from tests.helpers import TinyNet

    config = DilocoConfig(num_fragments=3, sync_every=6, codec="int4", downlink_codec=downlink_codec)
    initial = dict(TinyNet(seed=0).named_parameters())
    # K = M and no grace: every round closes with both learners, once (the prediction's lockstep case).
    hub = InProcessHub(Syncer(config, QuorumConfig(min_quorum=2, grace="none"), initial_params=initial))
    learners = []
    for learner_id in range(2):
        model = TinyNet(seed=learner_id + 1)
        learner = Learner(config, learner_id=learner_id, model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        hub.join(learner)
        learners.append(learner)
    steps = 20
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for learner in learners:
            with torch.no_grad():  # a stand-in for an inner step: any change of the parameters
                for param in learner.model.parameters():
                    param.add_(0.01 * torch.randn(param.shape, generator=generator))
            hub.after_inner_step(learner, tokens=8)
    predicted = predict_run_bytes(fragment_numels=fragment_numels(initial, config), codec="int4",
                                  sync_every=6, inner_steps=steps, learners=2, downlink_codec=downlink_codec,
                                  final_flush=False)
    assert predicted.rounds_per_learner == hub.syncer.rounds_committed
    for learner in learners:
        assert learner.stats.bytes_sent == predicted.learner_sent
        assert learner.stats.bytes_received == predicted.learner_received
    assert hub.syncer.bytes_received == predicted.syncer_received
    assert hub.syncer.bytes_sent == predicted.syncer_sent


# ---- command line -------------------------------------------------------------------------------


def parser():
    top = argparse.ArgumentParser(prog="ddiloco")
    commands.add_parser(top.add_subparsers(dest="command", required=True))
    return top


def test_cli_bandwidth_json_last_and_assumptions_printed(capsys):
    args = parser().parse_args(["plan", "bandwidth", "--params", "12e9", "--regions", "a:1,b:1,c:1,d:1",
                                "--downlink-codec", "int4", "--no-plot", "--json"])
    assert commands.run(args) == 0
    out = capsys.readouterr().out
    payload = json.loads(out.strip().splitlines()[-1])
    systems = {s["system"]: s for s in payload["systems"]}
    assert systems["decoupled"]["learner_link"]["required_gbps"] == pytest.approx(1.125)
    assert "Assumptions" in out and payload["assumptions"]


@pytest.mark.parametrize(("argv", "flag"), [(["--codec", "int3"], "--codec='int3'"),
                                            (["--regions", "a:1"], "--regions='a:1'"),
                                            (["--step-time-s", "0"], "--step-time-s=0")])
def test_cli_bandwidth_bad_input_names_the_flag(capsys, argv, flag):
    assert commands.run(parser().parse_args(["plan", "bandwidth", "--no-plot", *argv])) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_a_run_of_links_with_the_same_figures_is_one_row_of_the_table_and_each_stays_in_the_json():
    # With one region per learner by default, `--learners 100000` printed 300,000 rows in 97 s (and 55 MB).
    from rich.console import Console

    from ddiloco.plan.report import COLLAPSE_LINKS_ABOVE, bandwidth_tables

    plan = plan_bandwidth(BandwidthConfig(learners=1000))
    console = Console(width=200, record=True)
    for table in bandwidth_tables(plan):
        console.print(table)
    text = console.export_text()
    assert text.count("WAN region-0 .. WAN region-999 (1,000 links, each)") == len(plan.systems), text[:2000]
    assert "WAN region-500 " not in text
    assert all(len(system.regions) == 1000 for system in plan.systems)  # --json keeps every link
    few = Console(width=200, record=True)
    for table in bandwidth_tables(plan_bandwidth(BandwidthConfig(learners=COLLAPSE_LINKS_ABOVE))):
        few.print(table)
    assert f"WAN region-{COLLAPSE_LINKS_ABOVE - 1} " in few.export_text()  # a few links: a row each, as before
