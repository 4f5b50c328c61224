"""A learner's join describes every tensor of its model in one gRPC message. A model of 98,304 tensors (128 layers of
256 unfused experts, three tensors each) made a 6.0 MiB join, over the 5 MiB limit: the learner retried it for as long
as it ran (`RESOURCE_EXHAUSTED: CLIENT: Sent message larger than max (6296147 vs. 5242880); retrying`), and the run
showed it `joining` at inner step 0. It is refused when the session is made, saying why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.config import DilocoConfig
from ddiloco.messages import Join, ModelSpec, TensorSpec
from ddiloco.session_transport import check_join_fits


def join_of(count: int) -> Join:
    names = (f"model.layers.{i // 768}.mlp.experts.{i // 3 % 256}.{('gate', 'up', 'down')[i % 3]}_proj.weight"
             for i in range(count))
    return Join(0, ModelSpec(tuple(TensorSpec(name, (8, 8), "float32") for name in names)), "fingerprint")


def test_a_join_too_large_for_a_message_is_refused_saying_how_many_tensors_and_what_to_do():
    with pytest.raises(ValueError, match=r"the model has 98,304 parameter tensors: their description alone is "
                                         r"[4-9]\.\d MiB, more than the 4 MiB .*Fuse small tensors"):
        check_join_fits(join_of(98_304), DilocoConfig())
    check_join_fits(join_of(30_000), DilocoConfig())  # 61 layers of 256 experts x 3 (DeepSeek-V3's count): fits


class ManyTensors(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.experts = nn.ParameterDict({f"expert_{i:06d}_with_a_long_hugging_face_style_name": nn.Parameter(
            torch.zeros(1)) for i in range(count)})


def test_a_session_over_grpc_refuses_such_a_model_before_it_connects():
    model = ManyTensors(90_000)
    with pytest.raises(ValueError, match="Fuse small tensors"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), syncer="127.0.0.1:9", learner_id=0,
                        inner_steps=4)
