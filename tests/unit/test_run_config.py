"""The run config as a user writes it: JSON values of the wrong type, unreadable files, and what `--resume`
may change. Every bad value is refused with a `ValueError` naming the field, the expected type and the value,
checked once where the JSON is read, never a `TypeError` from deep inside a `__post_init__`."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from ddiloco.config import DilocoConfig
from ddiloco.run_config import RUN_FIELDS, SECTIONS, RunConfig, check_resume


@pytest.mark.parametrize(("data", "needles"), [
    ({"inner": {"lr": "1e-3"}}, ['inner.lr = "1e-3"', "expected a number", "without quotes"]),
    ({"num_learners": "3"}, ['num_learners = "3"', "expected an integer", "without quotes"]),
    ({"data": {"batch_size": 4.5}}, ["data.batch_size = 4.5", "expected an integer"]),
    ({"seed": True}, ["seed = true", "expected an integer"]),
    ({"inner": {"lr": False}}, ["inner.lr = false", "expected a number"]),
    ({"quorum": {"min_quorum": [2]}}, ["quorum.min_quorum = [2]", "expected an integer"]),
    ({"learner": {"max_wait_s": None}}, ["learner.max_wait_s = null", "expected a number"]),
    ({"diloco": {"codec": 4}}, ["diloco.codec = 4", "expected a string"]),
    ({"quorum": {"grace_s": {"value": 1}}}, ['quorum.grace_s = {"value": 1}', "expected a number"]),
    ({"inner": [1]}, ["inner = [1]", "expected a JSON object"]),
    ({"model": "tiny"}, ['model = "tiny"', "expected a JSON object"]),
])
def test_a_value_of_the_wrong_type_names_the_field_the_type_and_the_value(data, needles):
    with pytest.raises(ValueError) as caught:
        RunConfig.from_dict(data)
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def _fields():
    for section, (cls, _) in SECTIONS.items():
        for field in dataclasses.fields(cls):
            yield section, field.name
    for name in RUN_FIELDS:
        yield None, name


@pytest.mark.parametrize(("section", "name"), list(_fields()))
def test_every_field_is_type_checked_where_the_json_is_read(section, name):
    # One check at the loading, not one per field: a list where a scalar belongs is refused by name everywhere.
    data = {section: {name: ["x"]}} if section else {name: ["x"]}
    dotted = f"{section}.{name}" if section else name
    with pytest.raises(ValueError, match=f'{dotted} = \\["x"\\]'):
        RunConfig.from_dict(data)


def test_an_integer_for_a_float_field_is_accepted_as_written():
    # Not converted: every process reading the file computes the same algorithm fingerprint as before.
    data = {**RunConfig().to_dict(), "diloco": {**RunConfig().to_dict()["diloco"], "outer_lr": 1}}
    config = RunConfig.from_dict(data)
    assert config.diloco.outer_lr == 1 and config.to_dict() == data
    assert config.diloco.fingerprint() == RunConfig.from_dict(config.to_dict()).diloco.fingerprint()


def test_a_saved_config_loads_back_equal(tmp_path):
    config = RunConfig(num_learners=3, inner_steps=48, seed=5)
    config.save(tmp_path / "config.json")
    assert RunConfig.load(tmp_path / "config.json") == config


def test_a_run_saved_before_the_shard_layouts_resumes_on_the_contiguous_shards_it_trained_on(tmp_path):
    saved = RunConfig(num_learners=3).to_dict()
    del saved["data"]["shard_layout"], saved["data"]["shard_block_bytes"]  # as a run of 2026-12-03 wrote it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert RunConfig.load(tmp_path / "config.json").data.shard_layout == "contiguous"
    # A user's data section that names some fields only takes today's default layout.
    assert RunConfig.from_dict({"data": {"batch_size": 8}}).data.shard_layout == "whole"
    assert RunConfig().data.shard_layout == "whole"


def test_a_run_saved_before_the_cooldown_resumes_at_the_constant_rate_it_trained_with(tmp_path):
    saved = RunConfig(num_learners=3).to_dict()
    del saved["inner"]["cooldown"], saved["inner"]["warmup_steps"]  # as a run of 2026-12-04's morning wrote it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = RunConfig.load(tmp_path / "config.json").inner
    assert (loaded.cooldown, loaded.warmup_steps) == (0, 0)
    assert RunConfig.from_dict({"inner": {"lr": 1e-3}}).inner.cooldown == 0.2 == RunConfig().inner.cooldown


def test_a_run_saved_before_the_warm_up_resumes_without_one(tmp_path):
    saved = RunConfig(num_learners=3).to_dict()
    del saved["inner"]["warmup_steps"]  # as a run of 2026-12-04's evening wrote it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = RunConfig.load(tmp_path / "config.json").inner
    assert (loaded.warmup_steps, loaded.cooldown) == (0, 0.2)
    # A user's inner section that names some fields only takes today's warm-up.
    assert RunConfig.from_dict({"inner": {"lr": 1e-3}}).inner.warmup_steps == RunConfig().inner.warmup_steps > 0


def test_a_run_saved_before_the_grace_floor_resumes_without_one(tmp_path):
    saved = RunConfig(num_learners=3).to_dict()
    del saved["quorum"]["grace_min_steps"]  # as a run of 2026-12-05's morning wrote it
    del saved["quorum"]["max_norm_ratio"]
    del saved["quorum"]["progress_timeout_s"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    quorum = RunConfig.load(tmp_path / "config.json").quorum
    assert quorum.grace_min_steps == 0 and quorum.max_norm_ratio == 0
    assert RunConfig.from_dict({"quorum": {"min_quorum": 2}}).quorum.grace_min_steps == 0.25


def test_a_run_saved_before_the_norm_cap_resumes_without_one(tmp_path):
    saved = RunConfig(num_learners=3).to_dict()
    del saved["quorum"]["max_norm_ratio"]  # as a run of 2026-12-05's third session wrote it
    del saved["quorum"]["progress_timeout_s"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    quorum = RunConfig.load(tmp_path / "config.json").quorum
    assert quorum.max_norm_ratio == 0 and quorum.grace_min_steps == 0.25
    assert RunConfig.from_dict({"quorum": {"min_quorum": 2}}).quorum.max_norm_ratio == 10


def test_a_run_saved_before_the_round_margins_resumes_without_them_and_its_fingerprint_is_recognised(tmp_path):
    # The fingerprint a syncer state holds is a hash of the diloco section as its version held it (without the fields
    # added since): runs of 2026-12-01 and of 2026-12-02's evening were refused as "a different algorithm config".
    for dropped, margins in ((("round_margin_steps", "round_margin_gain"), (0, 0)), (("round_margin_gain",), (1.5, 0))):
        saved = RunConfig(num_learners=3).to_dict()
        for name in dropped:
            del saved["diloco"][name]
        (tmp_path / "config.json").write_text(json.dumps(saved))
        diloco = RunConfig.load(tmp_path / "config.json").diloco
        assert (diloco.round_margin_steps, diloco.round_margin_gain) == margins
        then = hashlib.sha256(json.dumps(saved["diloco"], sort_keys=True).encode()).hexdigest()[:16]
        assert diloco.fingerprint() != then and then in diloco.fingerprints()
    # Today's margins are not what those versions trained with: their hashes are not this config's.
    assert len(DilocoConfig(round_margin_gain=0.25).fingerprints()) == 1
    assert len(DilocoConfig().fingerprints()) == 2  # the default's 0 drift: as 2026-12-02's evening computed it
    assert RunConfig.from_dict({"diloco": {"sync_every": 8}}).diloco.round_margin_steps == 1.5


def test_unknown_fields_are_named():
    with pytest.raises(ValueError, match="unknown run config field.*learners"):
        RunConfig.from_dict({"learners": 3})
    with pytest.raises(ValueError, match="unknown field.*'inner'.*learning_rate"):
        RunConfig.from_dict({"inner": {"learning_rate": 1e-3}})


def test_a_file_that_does_not_hold_an_object_is_refused_by_name(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1]")
    with pytest.raises(ValueError, match=f"run config {path}: expected a JSON object"):
        RunConfig.load(path)


def test_a_bad_value_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"inner": {"lr": "1e-3"}}))
    with pytest.raises(ValueError, match=f'run config {path}: inner.lr = "1e-3"'):
        RunConfig.load(path)
    path.write_text(json.dumps({"inner": {"lr": -1.0}}))  # __post_init__'s own checks name the file too
    with pytest.raises(ValueError, match=f"run config {path}: lr=-1.0 is invalid"):
        RunConfig.load(path)


def test_a_directory_or_an_unreadable_path_is_refused_with_a_message(tmp_path):
    with pytest.raises(ValueError, match=f"run config {tmp_path} is a directory"):
        RunConfig.load(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("{}")
    with pytest.raises(ValueError, match=f"run config {afile / 'config.json'} cannot be read"):
        RunConfig.load(afile / "config.json")  # ENOTDIR: any OSError, not only a missing file
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ValueError, match=f"run config {binary} is not UTF-8 text"):
        RunConfig.load(binary)


# ---- what --resume may change ------------------------------------------------------------------------------

def test_resume_refuses_a_different_number_of_learners_naming_both_values():
    saved = RunConfig(num_learners=3)
    with pytest.raises(ValueError) as caught:
        check_resume(saved, dataclasses.replace(saved, num_learners=5))
    message = str(caught.value)
    assert "--learners 5" in message and "the run has 3" in message


def test_resume_names_every_setting_that_cannot_change():
    saved = RunConfig()
    wanted = RunConfig.from_dict({**saved.to_dict(), "seed": 7, "model": {**saved.to_dict()["model"], "width": 64},
                                  "diloco": {**saved.to_dict()["diloco"], "codec": "int8"},
                                  "inner": {**saved.to_dict()["inner"], "lr": 1e-3}})
    message = str(pytest.raises(ValueError, check_resume, saved, wanted).value)
    for needle in ("--seed 7 (the run has 0)", "--model-width 64 (the run has 128)",
                   "--codec int8 (the run has int4)", "--inner-lr 0.001 (the run has 0.003)"):
        assert needle in message, message


def test_resume_may_extend_the_budget_and_change_the_quorum_and_learner_policies():
    saved = RunConfig(inner_steps=100)
    wanted = RunConfig.from_dict({**saved.to_dict(), "inner_steps": 400,
                                  "quorum": {**saved.to_dict()["quorum"], "min_quorum": 2, "grace": "none"},
                                  "learner": {**saved.to_dict()["learner"], "max_wait_s": 5.0}})
    check_resume(saved, wanted)  # no error
    check_resume(saved, saved)
