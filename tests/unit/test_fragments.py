import pytest
import torch

from ddiloco.config import DilocoConfig
from ddiloco.fragments import FragmentPlan, balanced, due_step, strided


def test_balanced_packs_largest_first_into_lightest():
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 2}
    # a->0 [10,0]; b->1 [10,7]; c->1 [10,12]; d->0 [13,12]; e->1 [13,14]
    assert balanced(sizes, 2) == [["a", "d"], ["b", "c", "e"]]


def test_balanced_is_independent_of_dict_order_and_breaks_ties_by_name():
    sizes = {f"t{i}": 4 for i in range(6)}
    shuffled = dict(reversed(list(sizes.items())))
    first = [sorted(f) for f in balanced(sizes, 3)]
    assert first == [sorted(f) for f in balanced(shuffled, 3)]
    assert first == [["t0", "t3"], ["t1", "t4"], ["t2", "t5"]]


def test_balanced_puts_every_tensor_in_exactly_one_fragment():
    generator = torch.Generator().manual_seed(0)
    sizes = {f"p{i}": int(s) for i, s in enumerate(torch.randint(1, 1000, (40,), generator=generator))}
    fragments = balanced(sizes, 7)
    flat = [name for frag in fragments for name in frag]
    assert sorted(flat) == sorted(sizes)
    loads = [sum(sizes[n] for n in frag) for frag in fragments]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_fragments=4 exceeds the 3 tensors.*use --num-fragments 3 or fewer"):
        balanced({"a": 1, "b": 1, "c": 1}, 4)


def test_strided_deals_blocks_round_robin():
    sizes = {"emb": 100, **{f"blocks.{i}.w": 10 for i in range(4)}, "head": 50}
    fragments = strided(sizes, 2)
    assert "blocks.0.w" in fragments[0] and "blocks.2.w" in fragments[0]
    assert "blocks.1.w" in fragments[1] and "blocks.3.w" in fragments[1]
    # emb (100) into the lighter bin (tie: 0), then head (50) into bin 1.
    assert fragments == [["emb", "blocks.0.w", "blocks.2.w"], ["blocks.1.w", "blocks.3.w", "head"]]


@pytest.mark.parametrize("prefix", ["model.layers", "transformer.h", "encoder.layer", "gpt_neox.layers",
                                    "model.decoder.layers", "transformer.blocks"])
def test_strided_finds_the_blocks_of_hugging_face_models(prefix):
    # Only `blocks.N.` was a block: a Llama's `model.layers.N.` or a GPT-2's `transformer.h.N.` matched nothing, and
    # --fragment-strategy strided was balanced's plan, with nothing said.
    sizes = {"embed.weight": 100, **{f"{prefix}.{i}.mlp.experts.{e}.w": 10 for i in range(4) for e in range(3)},
             "lm_head.weight": 50}
    fragments = strided(sizes, 2)
    for i in range(4):
        assert all(f"{prefix}.{i}.mlp.experts.{e}.w" in fragments[i % 2] for e in range(3)), fragments


def test_strided_says_when_no_parameter_name_holds_a_block_index(caplog):
    with caplog.at_level("WARNING", logger="ddiloco.fragments"):
        assert strided({"a": 3, "b": 2, "c": 1}, 2) == balanced({"a": 3, "b": 2, "c": 1}, 2)
    assert "no parameter name holds a block index" in caplog.text


def test_due_step_matches_the_formula_by_hand():
    assert [due_step(r, 8, 4) for r in range(8)] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [due_step(r, 24, 24) for r in range(5)] == [1, 2, 3, 4, 5]
    assert [due_step(r, 10, 3) for r in range(6)] == [3, 6, 10, 13, 16, 20]


@pytest.mark.parametrize(("sync_every", "num_fragments"), [(24, 24), (10, 3), (7, 7), (32, 4), (5, 2)])
def test_every_fragment_syncs_exactly_once_per_period(sync_every, num_fragments):
    for fragment in range(num_fragments):
        steps = [due_step(fragment + k * num_fragments, sync_every, num_fragments) for k in range(5)]
        assert all(b - a == sync_every for a, b in zip(steps, steps[1:], strict=False))
    rounds = [due_step(r, sync_every, num_fragments) for r in range(3 * num_fragments)]
    assert rounds == sorted(rounds)


def test_plan_marks_embeddings_by_pattern():
    tensors = {"token_embedding.weight": torch.zeros(4, 2), "blocks.0.weight": torch.zeros(2, 2),
               "lm_head.weight": torch.zeros(4, 2)}
    plan = FragmentPlan.for_tensors(tensors, DilocoConfig(num_fragments=2, codec="fp32", embedding_pattern="embedding"),
                                    embeddings=["lm_head.weight"])  # the pattern, when set, decides alone
    assert plan.embeddings == {"token_embedding.weight"}
    assert sorted(n for f in plan.fragments for n in f) == sorted(tensors)
    assert plan.fragment_of("lm_head.weight") in (0, 1)


def test_embeddings_are_found_by_module_type_whatever_their_names():
    """A Hugging Face style model names its tables wte/wpe and ties the output layer to wte: the default
    (no pattern) finds both tables by module type and counts the tied weight once."""
    from torch import nn

    from ddiloco.fragments import embedding_names

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(8, 4), nn.Embedding(6, 4)
            self.proj = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.wte.weight

    model = Tied()
    assert embedding_names(model) == {"wte.weight", "wpe.weight"}
    assert embedding_names(model, "proj") == {"proj.weight", "proj.bias"}
    params = dict(model.named_parameters())
    plan = FragmentPlan.for_tensors(params, DilocoConfig(num_fragments=2, codec="fp32"),
                                    embeddings=embedding_names(model))
    assert plan.embeddings == {"wte.weight", "wpe.weight"}
    with pytest.raises(ValueError, match="not a parameter"):
        FragmentPlan.for_tensors(params, DilocoConfig(num_fragments=2, codec="fp32"), embeddings=["nope.weight"])



def test_a_model_with_some_layers_in_bf16_is_cut_where_its_float32_copy_is():
    # The syncer holds every tensor in float32; a learner with a bf16 layer cut its model by bytes, elsewhere, and
    # every fragment it was sent then "carried the wrong tensors": it never joined.
    mixed = {"a": torch.zeros(1000), "b": torch.zeros(1000, dtype=torch.bfloat16), "c": torch.zeros(900)}
    as_float = {name: t.float() for name, t in mixed.items()}
    config = DilocoConfig(num_fragments=2, sync_every=4)
    assert FragmentPlan.for_tensors(as_float, config).fragments == (("a", "c"), ("b",))
    assert FragmentPlan.for_tensors(mixed, config) == FragmentPlan.for_tensors(as_float, config)
