"""The wire schema: messages <-> protobuf chunks, and every check made before a message is accepted."""

import dataclasses
import math

import grpc
import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig
from ddiloco.downlink import DeltaDownlink
from ddiloco.fragments import FragmentPlan
from ddiloco.learner import Learner
from ddiloco.messages import (
    FragmentDelta,
    FragmentState,
    ModelSpec,
    Rejected,
    RejectReason,
    TensorSpec,
    Update,
    Welcome,
)
from ddiloco.transport import wire_pb2
from ddiloco.transport.grpc_codec import (
    MAX_CONFIG_JSON_CHARS,
    UpdateAssembler,
    WireError,
    WireModel,
    config_difference,
    decode_join,
    encode_join,
    encode_update,
    iter_data,
)
from ddiloco.transport.subscription import Subscription
from ddiloco.transport.syncer_handler import peer_host
from ddiloco.transport.syncer_stream import SyncerStreamDecoder, encode_syncer_message
from tests.helpers import TinyNet, params_of

CONFIG = DilocoConfig(num_fragments=2, sync_every=4, codec="int4")
SMALL_CHUNK = 32
"""Bytes per data chunk in these tests, so that every tensor spans several chunks."""


@pytest.fixture
def params():
    return params_of(TinyNet(seed=3))


@pytest.fixture
def model(params):
    return WireModel(ModelSpec.from_named_tensors(params.items()), FragmentPlan.for_tensors(params, CONFIG), "int4")


def _state(model, params, fragment=0, version=5):
    return FragmentState(fragment, version, {n: params[n] for n in model.plan.fragments[fragment]})


def _decode_all(decoder, chunks):
    out = [m for m in (decoder.feed(c) for c in chunks) if m is not None]
    return out


def _update(model, params, *, fragment=0, scale=0.01, **changes):
    codec = get_codec("int4")
    payload = {n: codec.encode(scale * params[n]) for n in model.plan.fragments[fragment]}
    fields = dict(learner_id=1, fragment=fragment, base_version=2, inner_step=10, steps=4, tokens=96,
                  codec="int4", payload=payload)
    fields.update(changes)
    return Update(**fields)


def _assemble(model, chunks):
    assembler = UpdateAssembler(model)
    iterator = iter(chunks)
    assembler.start(next(iterator))
    for chunk in iterator:
        assembler.add(chunk)
    return assembler.finish()


def test_iter_data_cuts_the_concatenation_into_chunks():
    blobs = [b"a" * 5, b"b" * 250, b"", b"c" * 3]
    chunks = list(iter_data(blobs, chunk_bytes=100))
    assert b"".join(chunks) == b"".join(blobs)
    assert [len(c) for c in chunks] == [100, 100, 58]


def test_fragment_state_and_welcome_round_trip_exactly(model, params):
    decoder = SyncerStreamDecoder(model)
    state = _state(model, params, fragment=1, version=7)
    chunks = list(encode_syncer_message(state, chunk_bytes=SMALL_CHUNK))
    assert len(chunks) > 3 and chunks[0].WhichOneof("kind") == "fragment_state"
    assert all(len(c.data) == SMALL_CHUNK for c in chunks[:-1]) and all(not c.WhichOneof("kind") for c in chunks[1:])
    (back,) = _decode_all(decoder, chunks)
    assert (back.fragment, back.version) == (1, 7)
    assert all(torch.equal(back.tensors[n], state.tensors[n]) for n in state.tensors)

    welcome = Welcome(4, (_state(model, params, 0, 3), _state(model, params, 1, 9)), CONFIG.fingerprint())
    rejected = Rejected(4, 1, 2, RejectReason.STALE, "5 versions behind")
    messages = [welcome, rejected, state]
    chunks = [c for m in messages for c in encode_syncer_message(m, chunk_bytes=SMALL_CHUNK)]
    back = _decode_all(decoder, chunks)
    assert [type(m) for m in back] == [Welcome, Rejected, FragmentState]
    assert back[1] == rejected
    assert [(s.fragment, s.version) for s in back[0].fragments] == [(0, 3), (1, 9)]
    for got, sent in zip(back[0].fragments, welcome.fragments, strict=True):
        assert all(torch.equal(got.tensors[n], sent.tensors[n]) for n in sent.tensors)


def test_decoder_refuses_tensors_of_another_model(model, params):
    state = FragmentState(0, 1, {n: torch.zeros(3, 3) for n in model.plan.fragments[0]})
    with pytest.raises(WireError, match="shape"):
        _decode_all(SyncerStreamDecoder(model), encode_syncer_message(state))
    with pytest.raises(WireError, match="without a header"):
        SyncerStreamDecoder(model).feed(wire_pb2.SyncerChunk(data=b"xx"))


def test_update_round_trips(model, params):
    update = _update(model, params)
    chunks = list(encode_update(update, model.spec, chunk_bytes=SMALL_CHUNK))
    assert chunks[0].HasField("header") and len(chunks[0].data) == SMALL_CHUNK and len(chunks) >= 2
    assert _assemble(model, chunks) == update
    timed = _update(model, params, step_time_s=0.0125, result_delay_s=0.75)  # times the learner measured
    back = _assemble(model, list(encode_update(timed, model.spec)))
    assert (back.step_time_s, back.result_delay_s) == (0.0125, 0.75)


@pytest.mark.parametrize(("edit", "reason", "needle"), [
    (lambda h: setattr(h.tensors[0], "dtype", "float16"), "malformed", "dtype 'float16'"),
    (lambda h: h.tensors[0].shape.append(2), "wrong_tensors", "shape"),
    (lambda h: setattr(h.tensors[0], "name", "mystery.weight"), "wrong_tensors", "mystery"),
    (lambda h: setattr(h, "codec", "fp32"), "wrong_codec", "fp32"),
    (lambda h: setattr(h, "fragment", 9), "bad_fragment", "fragment 9"),
    (lambda h: setattr(h, "steps", 0), "bad_counters", "steps=0"),
    (lambda h: setattr(h, "tokens", -5), "bad_counters", "tokens=-5"),
    (lambda h: setattr(h, "inner_step", 2), "bad_counters", "inner_step=2"),
    (lambda h: setattr(h, "step_time_s", math.nan), "bad_counters", "step_time_s=nan"),
    (lambda h: setattr(h, "step_time_s", -0.5), "bad_counters", "step_time_s=-0.5"),
    (lambda h: setattr(h, "result_delay_s", math.inf), "bad_counters", "result_delay_s=inf"),
    (lambda h: setattr(h.tensors[0], "nbytes", h.tensors[0].nbytes - 1), "malformed", "declares"),
    (lambda h: setattr(h.tensors[0], "nbytes", 10**12), "oversize", "at most"),
])
def test_bad_update_headers_are_refused_before_any_data(model, params, edit, reason, needle):
    chunks = list(encode_update(_update(model, params), model.spec))
    edit(chunks[0].header)
    with pytest.raises(WireError, match=needle) as caught:
        UpdateAssembler(model).start(chunks[0])
    assert caught.value.reason == reason


def test_an_update_with_extra_bytes_is_refused_at_the_first_extra_chunk(model, params):
    chunks = list(encode_update(_update(model, params), model.spec, chunk_bytes=SMALL_CHUNK))
    assembler = UpdateAssembler(model)
    assembler.start(chunks[0])
    for chunk in chunks[1:]:
        assembler.add(chunk)
    with pytest.raises(WireError, match="more than") as caught:
        assembler.add(wire_pb2.UpdateChunk(data=b"\0"))
    assert caught.value.reason == "oversize" and caught.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_truncated_update_is_refused(model, params):
    chunks = list(encode_update(_update(model, params), model.spec, chunk_bytes=SMALL_CHUNK))
    with pytest.raises(WireError, match="ended after") as caught:
        _assemble(model, chunks[:-1])
    assert caught.value.reason == "truncated"


def test_an_update_decoding_to_nan_is_refused(model, params):
    update = _update(model, params)
    name = model.plan.fragments[0][0]
    poisoned = bytearray(update.payload[name])
    poisoned[0:4] = bytes(bytearray(torch.tensor([math.nan]).numpy().tobytes()))  # the first block's scale
    update = Update(**{**update.__dict__, "payload": {**update.payload, name: bytes(poisoned)}})
    with pytest.raises(WireError, match="NaN") as caught:
        _assemble(model, list(encode_update(update, model.spec)))
    assert caught.value.reason == "non_finite"


def test_join_carries_spec_and_config(params, model):
    learner = Learner(CONFIG, learner_id=2, model=TinyNet(seed=0))
    join, config = decode_join(encode_join(learner.join_message(), CONFIG))
    assert join == learner.join_message()
    assert config_difference(CONFIG, config) is None
    other = DilocoConfig(num_fragments=2, sync_every=4, codec="int4", outer_lr=0.5)
    assert config_difference(other, config) == "outer_lr is 0.7 on the learner but 0.5 on the syncer"
    declared = Learner(CONFIG, learner_id=2, model=TinyNet(seed=0), max_tokens_per_step=4096).join_message()
    assert decode_join(encode_join(declared, CONFIG))[0].max_tokens_per_step == 4096
    request = encode_join(learner.join_message(), CONFIG)
    request.learner_id = -1
    with pytest.raises(WireError, match="learner_id=-1"):
        decode_join(request)


def _join_request(edit):
    request = encode_join(Learner(CONFIG, learner_id=1, model=TinyNet(seed=0)).join_message(), CONFIG)
    edit(request)
    return request


def _config_json(text):
    return lambda request: setattr(request, "diloco_config_json", text)


@pytest.mark.parametrize("edit, needle", [
    (_config_json("[" * 200_000 + "]" * 200_000), "at most 16384"),  # json.loads: RecursionError
    (_config_json("[" * 5000 + "]" * 5000), "nested more than 8"),   # short enough, too deep
    (_config_json('{"outer_lr": ' + "9" * 5000 + "}"), "5000 digits"),  # int(): ValueError past 4300 digits
    (_config_json('{"codec": "' + "x" * MAX_CONFIG_JSON_CHARS + '"}'), "characters"),
    (_config_json('{"a": "[[[", "b": {"c": [1, "]]]"]}}'), None),  # brackets in strings are no nesting
    (lambda request: request.model_spec.append(request.model_spec[0]), "twice"),
])
def test_a_join_is_decoded_or_refused_as_malformed_never_an_escaping_error(edit, needle):
    request = _join_request(edit)
    if needle is None:
        decode_join(request)
        return
    with pytest.raises(WireError, match=needle) as caught:
        decode_join(request)
    assert (caught.value.reason, caught.value.status) == ("malformed", grpc.StatusCode.INVALID_ARGUMENT)


def test_a_model_spec_names_each_tensor_once():
    tensor = TensorSpec("w", (2, 3), "float32")
    with pytest.raises(ValueError, match="'w' twice"):
        ModelSpec((tensor, TensorSpec("b", (3,), "float32"), tensor))


def test_a_config_difference_shows_a_long_value_shortened():
    difference = config_difference(CONFIG, {**CONFIG.to_dict(), "codec": "x" * 10_000})
    assert difference.startswith("codec is 'xxx") and len(difference) < 200


def test_a_peer_host_is_the_peer_without_its_port():
    assert peer_host("ipv4:127.0.0.1:59704") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:50051") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/syncer.sock") == "unix:/tmp/syncer.sock"
    assert peer_host("") == ""


def test_subscription_delivers_in_order_and_ends_when_closed(model, params):
    delivered = []
    subscription = Subscription(3, on_delivered=lambda state, seconds: delivered.append(state.version))
    subscription.put(_state(model, params, 0, 1))
    subscription.put(Rejected(3, 0, 1, RejectReason.DUPLICATE))
    subscription.put(_state(model, params, 0, 2))
    subscription.close()
    subscription.put(_state(model, params, 0, 3))  # after close: dropped
    back = _decode_all(SyncerStreamDecoder(model), _drain(subscription))
    assert [type(m).__name__ for m in back] == ["FragmentState", "Rejected"]  # version 2 took unsent 1's place
    assert [m.version for m in back if isinstance(m, FragmentState)] == [2] and delivered == [2]
    assert subscription.collapsed == 1


def _drain(subscription):
    """The chunks of every pending message, as the server's stream sends them."""
    while (item := subscription.take()) is not None:
        queued_at, message = item
        message = subscription.resolve(message)
        yield from encode_syncer_message(message)
        subscription.delivered(message, queued_at)


def test_a_subscriber_that_does_not_read_holds_one_pending_state_per_fragment(model, params):
    # Before: an unbounded queue; a subscriber that never read grew the syncer by 0.47 MB per round.
    newest = _state(model, params, 0, 99)
    subscription = Subscription(3, newest=lambda fragment: newest)
    for version in range(1, 50):
        subscription.put(_state(model, params, 0, version))
        subscription.put(_delta(model, params, fragment=1, version=version))
        subscription.put(Rejected(3, 0, version, RejectReason.DUPLICATE))
    assert subscription.pending() <= 2 + 64
    kinds = [type(subscription.resolve(m)).__name__ for _, m in iter(subscription.take, None)]
    assert kinds.count("FragmentState") == 2 and "FragmentDelta" not in kinds  # fragment 1: its newest state


def test_a_few_changes_behind_a_subscriber_still_gets_each_change(model, params):
    subscription = Subscription(3, newest=lambda fragment: pytest.fail("no full state needed"))
    for version in range(1, 5):
        subscription.put(_delta(model, params, fragment=1, version=version))
    messages = [subscription.resolve(m) for _, m in iter(subscription.take, None)]
    assert [(type(m).__name__, m.version) for m in messages] == [("FragmentDelta", v) for v in range(1, 5)]


# ---- fragment changes (the int8 downlink) ---------------------------------------------------------------


def _delta(model, params, *, fragment=1, version=8):
    names = model.plan.fragments[fragment]
    downlink = DeltaDownlink("int8", model.plan, {n: tuple(t.shape) for n, t in params.items()})
    tensors = {n: params[n].clone() for n in names}
    previous = downlink.before_step(fragment, tensors)
    for tensor in tensors.values():
        tensor.mul_(1.01)
    return downlink.after_step(fragment, version, previous, tensors)


def test_a_fragment_change_round_trips_between_other_messages(model, params):
    delta = _delta(model, params)
    assert isinstance(delta, FragmentDelta) and delta.payload_bytes < 0.3 * 4 * sum(
        params[n].numel() for n in model.plan.fragments[1])
    rejected = Rejected(4, 1, 2, RejectReason.STALE, "5 versions behind")
    chunks = [c for m in (delta, rejected, _state(model, params)) for c in
              encode_syncer_message(m, chunk_bytes=SMALL_CHUNK)]
    assert chunks[0].WhichOneof("kind") == "fragment_delta" and not chunks[1].WhichOneof("kind")
    back = _decode_all(SyncerStreamDecoder(model), chunks)
    assert [type(m) for m in back] == [FragmentDelta, Rejected, FragmentState]
    assert back[0] == delta  # payload bytes, counters, codec and checksum all came through


@pytest.mark.parametrize(("on_time", "margins"), [(None, None), ((), None), ((0, 3, 17), None),
                                                  ((0, 3, 17), (1.5, 0.25, 0.0))])
def test_a_round_result_says_who_was_on_time_and_an_unknown_stays_unknown(model, params, on_time, margins):
    delta = dataclasses.replace(_delta(model, params), on_time=on_time, margins=margins)
    state = dataclasses.replace(_state(model, params), on_time=on_time, margins=margins)
    chunks = [c for m in (delta, state) for c in encode_syncer_message(m, chunk_bytes=SMALL_CHUNK)]
    back = _decode_all(SyncerStreamDecoder(model), chunks)
    assert [(m.on_time, m.margins) for m in back] == [(on_time, margins), (on_time, margins)]


def _bad_delta_chunks(model, params, edit):
    chunks = list(encode_syncer_message(_delta(model, params)))
    edit(chunks[0].fragment_delta)
    return chunks


@pytest.mark.parametrize(("edit", "reason", "needle"), [
    (lambda h: setattr(h, "codec", "int4"), "wrong_codec", "'int4'"),
    (lambda h: setattr(h, "base_version", h.version), "bad_counters", "base_version = version - 1"),
    (lambda h: setattr(h, "version", 0), "bad_counters", "to 0"),
    (lambda h: setattr(h, "fragment", 9), "bad_fragment", "fragment 9"),
    (lambda h: setattr(h.tensors[0], "name", "mystery.weight"), "wrong_tensors", "mystery"),
    (lambda h: setattr(h.tensors[0], "nbytes", h.tensors[0].nbytes + 1), "malformed", "declares"),
    (lambda h: h.tensors[0].shape.append(2), "malformed", "dtype or shape"),
])
def test_bad_fragment_change_headers_are_refused_before_any_data(model, params, edit, reason, needle):
    chunks = _bad_delta_chunks(model, params, edit)
    with pytest.raises(WireError, match=needle) as caught:
        SyncerStreamDecoder(model).feed(chunks[0])
    assert caught.value.reason == reason


def test_a_fragment_change_whose_bytes_changed_in_flight_is_refused_as_corrupt(model, params):
    chunks = list(encode_syncer_message(_delta(model, params), chunk_bytes=SMALL_CHUNK))
    data = bytearray(chunks[2].data)
    data[0] ^= 0x01
    chunks[2].data = bytes(data)
    with pytest.raises(WireError) as caught:
        _decode_all(SyncerStreamDecoder(model), chunks)
    assert caught.value.reason == "corrupt"


def test_a_truncated_fragment_change_is_refused(model, params):
    chunks = list(encode_syncer_message(_delta(model, params), chunk_bytes=SMALL_CHUNK))
    decoder = SyncerStreamDecoder(model)
    assert _decode_all(decoder, chunks[:-1]) == []
    with pytest.raises(WireError, match="ended after"):
        decoder.feed(encode_syncer_message(Rejected(1, 0, 0, RejectReason.STALE)).__next__())


def test_tied_weights_whose_names_hold_an_equals_sign_join():
    # ModuleDict keys may hold "=" ("lang=en"): the join's "ALIAS=NAME" pair was split at its first "=", refused as
    # malformed, and the learner retried it for ever.
    from ddiloco.transport.grpc_codec import decode_aliases

    names = {"heads.lang=en.weight", "body.weight"}
    assert decode_aliases(["heads.lang=de.weight=heads.lang=en.weight"], names) == (
        ("heads.lang=de.weight", "heads.lang=en.weight"),)
    assert decode_aliases(["head=body.weight"], names) == (("head", "body.weight"),)
    for pair in ("heads.lang=de.weight", "=body.weight", "body.weight=heads.lang=en.weight", "x=y"):
        with pytest.raises(WireError, match="expected ALIAS=PARAMETER"):
            decode_aliases([pair], names)
    # Two readings (both "b=c" and "c" parameters of the model, neither side of either split one): refused.
    with pytest.raises(WireError, match="can be read two ways"):
        decode_aliases(["a=b=c"], {"b=c", "c"})
