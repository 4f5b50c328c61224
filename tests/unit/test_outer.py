import torch

from ddiloco.outer import OuterOptimizer


def _fragments():
    return [{"a": torch.tensor([1.0, 2.0])}, {"b": torch.tensor([-1.0]), "c": torch.tensor([0.5, 0.5])}]


def test_nesterov_step_matches_the_formula_by_hand():
    lr, mu = 0.7, 0.9
    fragments = _fragments()
    outer = OuterOptimizer(fragments, lr=lr, momentum=mu)
    theta, m = torch.tensor([1.0, 2.0]), torch.zeros(2)
    for delta in (torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.0]), torch.tensor([-0.1, 0.1])):
        outer.step(0, {"a": delta})
        m = mu * m + delta
        theta = theta - lr * (delta + mu * m)
        torch.testing.assert_close(fragments[0]["a"], theta)


def test_a_fragment_step_touches_only_that_fragment():
    fragments = _fragments()
    outer = OuterOptimizer(fragments, lr=0.7, momentum=0.9)
    outer.step(0, {"a": torch.tensor([1.0, 1.0])})
    torch.testing.assert_close(fragments[1]["b"], torch.tensor([-1.0]))
    torch.testing.assert_close(fragments[1]["c"], torch.tensor([0.5, 0.5]))
    states = outer.state_dict()
    assert states[0]["state"] and not states[1]["state"]


def test_state_dict_round_trip_continues_identically():
    first, second = _fragments(), _fragments()
    a = OuterOptimizer(first, lr=0.5, momentum=0.9)
    a.step(1, {"b": torch.tensor([0.2]), "c": torch.tensor([0.1, -0.1])})
    with torch.no_grad():
        for frag_a, frag_b in zip(first, second, strict=True):
            for name in frag_a:
                frag_b[name].copy_(frag_a[name])
    b = OuterOptimizer(second, lr=0.5, momentum=0.9)
    b.load_state_dict(a.state_dict())
    delta = {"b": torch.tensor([-0.3]), "c": torch.tensor([0.0, 0.4])}
    a.step(1, delta)
    b.step(1, delta)
    for name in ("b", "c"):
        assert torch.equal(first[1][name], second[1][name])
