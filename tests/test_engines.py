"""Training engines: DeepSpeed ZeRO 0-3 (CPU, gloo, one process) takes the same steps as the torch engine,
including gradient accumulation over several backward calls before one step."""

from __future__ import annotations

import pytest
import torch

from arpo_core.engines import DeepSpeedEngine, TorchEngine, make_engine


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def train(engine, steps=5):
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for _micro in range(2):  # two weighted micro-batches per optimizer step
            x = torch.randn(16, 8, generator=gen)
            y = torch.sin(x.sum(-1, keepdim=True))
            loss = ((engine.module(x) - y) ** 2).mean() * 0.5
            engine.backward(loss, boundary=_micro == 1)
        norms.append(engine.step())
    return params_of(engine), norms


def params_of(engine):
    if getattr(engine, "zero_stage", 0) == 3:  # ZeRO-3 partitions parameters: gather them to compare
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.model.parameters())):
            return [p.detach().clone() for p in engine.model.parameters()]
    return [p.detach().clone() for p in engine.model.parameters()]


@pytest.fixture(scope="module")
def torch_result():
    return train(TorchEngine(make_model(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_matches_torch_engine(stage, torch_result):
    params, norms = train(
        DeepSpeedEngine(make_model(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, zero_stage=stage)
    )
    ref_params, ref_norms = torch_result
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert max(ref_norms) > 0.5  # clipping was active at least once


def test_torch_engine_skips_non_finite_gradients():
    model = make_model()
    eng = TorchEngine(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    eng.backward(model(torch.full((2, 8), float("nan"))).sum())
    norm = eng.step()
    assert norm != norm  # NaN
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_torch_engine_state_round_trip(tmp_path):
    eng = TorchEngine(make_model(), lr=1e-2)
    train(eng, steps=2)
    eng.save(tmp_path)
    eng2 = TorchEngine(make_model(), lr=1e-2)
    eng2.load(tmp_path)
    s1, s2 = eng.optimizer.state_dict(), eng2.optimizer.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        torch.testing.assert_close(s1["state"][k]["exp_avg"], s2["state"][k]["exp_avg"])


def test_make_engine_rejects_unknown():
    with pytest.raises(ValueError, match="unknown engine 'jax'"):
        make_engine("jax", make_model(), lr=1e-3)
