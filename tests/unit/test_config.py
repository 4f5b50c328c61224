import dataclasses

import pytest

from ddiloco.compression import CODEC_NAMES
from ddiloco.config import CODEC_CHOICES, DilocoConfig, LearnerConfig, QuorumConfig


def test_config_codec_choices_are_the_codecs_that_exist():
    # config.py stays free of torch, so it keeps its own copy of the names; they must agree.
    assert CODEC_CHOICES == CODEC_NAMES


@pytest.mark.parametrize(("cls", "field", "value"), [
    (DilocoConfig, "num_fragments", 0), (DilocoConfig, "sync_every", 0), (DilocoConfig, "overlap_steps", -1),
    (DilocoConfig, "merge", "median"), (DilocoConfig, "codec", "int3"), (DilocoConfig, "outer_lr", 0.0),
    (DilocoConfig, "outer_momentum", 1.0), (DilocoConfig, "embedding_pattern", "("),
    (DilocoConfig, "round_margin_steps", -0.5), (DilocoConfig, "round_margin_steps", float("inf")),
    (DilocoConfig, "round_margin_gain", -0.1), (DilocoConfig, "round_margin_gain", 1.5),
    (QuorumConfig, "min_quorum", 0), (QuorumConfig, "grace", "sometimes"), (QuorumConfig, "grace_s", -1.0),
    (QuorumConfig, "max_staleness", -1), (QuorumConfig, "heartbeat_timeout_s", 0.0),
    (QuorumConfig, "max_tokens_per_step", 0), (QuorumConfig, "max_weight_ratio", 0.5),
    (QuorumConfig, "max_weight_ratio", float("inf")), (QuorumConfig, "grace_max_steps", -1.0),
    (QuorumConfig, "grace_max_steps", float("nan")),
    (LearnerConfig, "max_wait_s", -1.0),
])
def test_bad_values_name_the_field_and_value(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


def test_fingerprint_changes_with_any_algorithm_field():
    base = DilocoConfig()
    assert base.fingerprint() == DilocoConfig().fingerprint()
    changes = dict(num_fragments=2, sync_every=8, overlap_steps=1, fragment_strategy="strided",
                   embedding_pattern="emb", merge="mean", outer_lr=0.5, outer_momentum=0.8, codec="bf16",
                   downlink_codec="int4", keep_overlap_work=False, pace_rounds=True,
                   round_margin_steps=0.5, round_margin_gain=0.5)
    assert set(changes) == {f.name for f in dataclasses.fields(DilocoConfig)}
    for name, value in changes.items():
        assert dataclasses.replace(base, **{name: value}).fingerprint() != base.fingerprint(), name
