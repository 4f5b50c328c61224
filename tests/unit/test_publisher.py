"""The publisher (`ddiloco.publisher`): a deferred publish sends exactly what an inline one would, from the values
at the moment of the publish, in the session's order; a non-finite pseudo-gradient is withheld and forgotten."""

from __future__ import annotations

import copy

import pytest
import torch

from ddiloco.compression import to_host
from ddiloco.config import DilocoConfig
from ddiloco.learner import Learner
from ddiloco.messages import FragmentState, Join, Update
from ddiloco.publisher import SAME_STREAM, DeferredPayload, DeviceOrder, Publisher
from tests.helpers import TinyNet, make_batches, sgd, train_step

CONFIG = DilocoConfig(num_fragments=2, sync_every=2, overlap_steps=1)


def joined(model: torch.nn.Module, *, deferred: bool) -> Learner:
    learner = Learner(CONFIG, learner_id=0, model=model, optimizer=sgd(model))
    params = dict(model.named_parameters())
    for p, names in enumerate(learner.plan.fragments):
        learner._apply(FragmentState(p, 0, {n: params[n].detach().clone() for n in names}), force=True)
    learner.joined = True
    learner.deferred = deferred
    return learner


def twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    first, second = TinyNet(seed=3), TinyNet(seed=3)
    for batch in make_batches(3, seed=1):
        train_step(first, sgd(first), batch)
        train_step(second, sgd(second), batch)
    return first, second


def test_a_deferred_update_carries_the_bytes_an_inline_one_does_from_the_values_at_publish_time():
    inline_model, deferred_model = twins()
    inline, deferred = joined(inline_model, deferred=False), joined(deferred_model, deferred=True)
    (expected,) = inline.after_inner_step(8)
    (update,) = deferred.after_inner_step(8)
    assert isinstance(update.payload, DeferredPayload)
    with torch.no_grad():
        for param in deferred_model.parameters():
            param.add_(1.0)  # training goes on before the publisher's thread encodes: it must not see this
    assert dict(update.payload) == dict(expected.payload)
    assert (update.fragment, update.base_version, update.steps, update.tokens) == (
        expected.fragment, expected.base_version, expected.steps, expected.tokens)


def test_the_publisher_sends_in_order_and_counts_bytes_once_encoded():
    model, _ = twins()
    learner = joined(model, deferred=True)
    sent: list = []
    counted: list[int] = []
    publisher = Publisher(sent.append, on_sent=lambda u: counted.append(u.payload_bytes))
    (first,) = learner.after_inner_step(4)
    publisher.send(first)
    publisher.send(Join(0, learner.spec, "f"))
    (second,) = learner.after_inner_step(4)
    publisher.send(second)
    assert publisher.drain(10.0)
    assert [type(m) for m in sent] == [Update, Join, Update]
    assert [m.fragment for m in sent if isinstance(m, Update)] == [first.fragment, second.fragment]
    assert counted == [first.payload_bytes, second.payload_bytes] and all(counted)
    publisher.close(10.0)


def test_a_non_finite_pseudo_gradient_is_withheld_and_the_learner_forgets_that_publish():
    model, _ = twins()
    learner = joined(model, deferred=True)
    sent: list = []
    publisher = Publisher(sent.append, on_sent=lambda u: None)
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.fill_(float("nan"))
    fragment = learner.plan.fragment_of(name)
    updates: list[Update] = []
    while not any(u.fragment == fragment for u in updates):
        updates = learner.after_inner_step(4)
    (bad,) = [u for u in updates if u.fragment == fragment]
    for update in updates:
        publisher.send(update)
    assert publisher.drain(10.0)
    withheld = publisher.take_withheld()
    assert [(w.update, w.tensor) for w in withheld] == [(bad, name)]
    assert bad not in sent
    assert fragment in learner.sent  # published, as far as the learner knew
    sent_before = learner.stats.updates_sent
    learner.withdraw(bad)
    assert fragment not in learner.sent  # so the waiting rule never waits for its round
    assert learner.stats.updates_withheld_non_finite == 1 and learner.stats.updates_sent == sent_before - 1
    publisher.close(10.0)


def test_on_the_cpu_the_publisher_stays_on_the_callers_thread_order_and_to_host_copies_nothing():
    values = {"w": torch.arange(6.0)}
    assert DeviceOrder.of(values) is SAME_STREAM
    with SAME_STREAM.side_stream({}) as entered:
        assert entered is None  # a nullcontext: no stream switch
    scale, codes = torch.ones(2), torch.arange(4, dtype=torch.uint8)
    host_scale, host_codes = to_host(scale, codes)
    assert host_scale is scale and host_codes is codes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the side stream and pinned copies")
def test_on_a_gpu_the_pseudo_gradient_is_encoded_while_the_training_stream_is_still_busy():
    device = torch.device("cuda")
    model, _ = twins()
    cpu_learner = joined(copy.deepcopy(model), deferred=False)
    gpu_learner = joined(model.to(device), deferred=True)
    streams: dict = {}
    # A first publish, resolved while the GPU is idle: the first launch of each kernel loads its module (CUDA's
    # lazy loading), which waits for the whole device, the training stream too. Measured on an H200: that first
    # resolve took 0.51 s behind a busy training stream, the next ones 3-5 ms while it was still busy.
    (first,) = gpu_learner.after_inner_step(8)
    assert first.payload.resolve(streams) is not None
    cpu_learner.after_inner_step(8)
    (expected,) = cpu_learner.after_inner_step(16)
    (update,) = gpu_learner.after_inner_step(16)
    torch.cuda._sleep(2_000_000_000)  # the training stream's next inner steps: about a second of GPU time
    assert update.payload.resolve(streams) is not None
    assert not torch.cuda.current_stream(device).query()  # encoded without waiting for the training stream
    assert set(streams) == {next(model.parameters()).device}  # one side stream, on the parameters' GPU
    assert dict(update.payload) == dict(expected.payload)
    host_codes = to_host(torch.arange(4, dtype=torch.uint8, device=device))[0]
    assert host_codes.is_pinned() and host_codes.tolist() == [0, 1, 2, 3]


def test_an_update_that_fails_on_the_publishers_thread_is_raised_on_the_training_thread_and_nothing_waits():
    # A RuntimeError in the pseudo-gradient (a parameter resized in place) killed the thread: the learner trained on,
    # sent nothing and never said why, its run at 0 rounds for as long as it ran.
    model, _ = twins()
    learner = joined(model, deferred=True)
    sent, dropped = [], []
    publisher = Publisher(sent.append, on_sent=lambda u: None, on_dropped=lambda u, why: dropped.append(why))
    (update,) = learner.after_inner_step(4)
    update.payload._base = {name: value.flatten()[:3] for name, value in update.payload._base.items()}  # other shapes
    publisher.send(update)
    assert publisher.drain(5.0)  # the thread goes on
    with pytest.raises(RuntimeError, match="an update could not be computed on the publisher's thread") as raised:
        publisher.raise_failure()
    assert "must match the size" in str(raised.value.__cause__)
    (later,) = learner.after_inner_step(4)
    publisher.send(later)
    assert publisher.drain(5.0) and sent == [] and dropped == ["failed", "failed"]
    publisher.close(1.0)
