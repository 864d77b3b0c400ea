"""Clipped policy loss, KL estimators and aggregation modes: hand-computed values and a loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_core.algorithm.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossOutput,
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
)
from arpo_core.config import LossSection


def arpo(**overrides) -> dict:
    """The loss settings of params' `train.loss` (LossSection holds the only defaults), with overrides."""
    s = LossSection()
    names = ("clip_low", "clip_high", "clip_dual", "kl_coef", "kl_estimator", "agg", "sum_norm")
    return {n: getattr(s, n) for n in names} | overrides


def test_arpo_settings_are_the_papers() -> None:
    assert arpo() == {
        "clip_low": 0.2,
        "clip_high": 0.3,
        "clip_dual": 3.0,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "agg": "token-mean",
        "sum_norm": None,
    }


# One token per clip case; old_logps = 0, so ratio = exp(logps) = r. ARPO's clip 0.2 / 0.3 / dual 3.
#            adv    r    per-token loss (hand-computed)                 which clip
CASES = [
    (+1.0, 1.1, -1.1),  # unclipped: -A r
    (+1.0, 1.5, -1.3),  # high: -A (1 + 0.3)                                   high
    (-1.0, 0.5, 0.8),  # low: -A (1 - 0.2)                                      low
    (-1.0, 1.5, 1.5),  # A<0 above 1.3: max(1.5, 1.3), below the dual bound 3
    (-1.0, 4.0, 3.0),  # dual: min(max(4, 1.3), 3)                              dual
    (+1.0, 0.5, -0.5),  # A>0 below 0.8 is not clipped: max(-0.5, -0.8)
    (-2.0, 0.9, 1.8),  # inside the trust region
]
CLIPPED = [False, True, True, False, True, False, False]


def _case_batch(garbage: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, 8) batch: the 7 CASES then one masked token holding `garbage`."""
    adv = torch.tensor([[a for a, _, _ in CASES] + [5.0]])
    logps = torch.tensor([[math.log(r) for _, r, _ in CASES] + [garbage]], requires_grad=True)
    old = torch.zeros(1, 8)
    mask = torch.tensor([[1] * 7 + [0]])
    return logps, old, adv, mask


def test_each_clip_hand_computed() -> None:
    logps, old, adv, mask = _case_batch()
    out = policy_loss(logps, old, adv, mask, **arpo())
    expected = sum(x for _, _, x in CASES) / 7  # 4.2 / 7
    assert expected == pytest.approx(0.6)
    torch.testing.assert_close(out.loss, torch.tensor(0.6))
    torch.testing.assert_close(out.pg_loss, torch.tensor(0.6))
    for frac in (out.clip_low_frac, out.clip_high_frac, out.clip_dual_frac):
        torch.testing.assert_close(frac, torch.tensor(1 / 7))
    assert out.kl is None and out.entropy is None


def test_gradient_zero_on_clipped_tokens_and_padding() -> None:
    logps, old, adv, mask = _case_batch()
    policy_loss(logps, old, adv, mask, **arpo()).loss.backward()
    # d(-A r)/d logp = -A r on unclipped tokens, / 7 for the token mean; clipped and padded: exactly 0.
    expected = [0.0 if c else -a * r / 7 for (a, r, _), c in zip(CASES, CLIPPED, strict=True)] + [0.0]
    torch.testing.assert_close(logps.grad, torch.tensor([expected]))
    assert all((g == 0) == c for g, c in zip(logps.grad[0, :7].tolist(), CLIPPED, strict=True))


def test_dual_clip_off() -> None:
    logps, old, adv, mask = _case_batch()
    out = policy_loss(logps, old, adv, mask, **arpo(clip_dual=None))
    torch.testing.assert_close(out.loss, torch.tensor((4.2 - 3.0 + 4.0) / 7))  # token 4 pays 4, not 3
    assert out.clip_dual_frac == 0


def test_symmetric_clip_changes_high_case() -> None:
    logps, old, adv, mask = _case_batch()
    out = policy_loss(logps, old, adv, mask, **arpo(clip_high=0.2))
    # token 1: -1.2 instead of -1.3; token 3 (A<0, r 1.5): max(1.5, 1.2) = 1.5 unchanged
    torch.testing.assert_close(out.loss, torch.tensor((4.2 + 0.1) / 7))


def test_sequence_advantages_broadcast_like_token_advantages() -> None:
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(3, 5, generator=g) * 0.3
    old = torch.randn(3, 5, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5)
    a = policy_loss(logps, old, adv, mask, **arpo())
    b = policy_loss(logps, old, adv[:, None].expand(3, 5), mask, **arpo())
    for x, y in zip(a, b, strict=True):
        if x is not None:
            torch.testing.assert_close(x, y)


# ---- aggregation -------------------------------------------------------------------------------------

# per-token losses: row 0 has 3 tokens (-1, -2, -3), row 1 has 1 token (-4); T = 4
AGG_LOSS = torch.tensor([[-1.0, -2.0, -3.0, 99.0], [-4.0, 99.0, 99.0, 99.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("agg", "sum_norm", "expected"),
    [
        ("token-mean", None, -10 / 4),
        ("seq-mean-token-mean", None, (-2 + -4) / 2),
        ("seq-mean-token-sum", None, (-6 + -4) / 2),
        ("seq-mean-token-sum-norm", None, -10 / 4),  # verl: batch sum / T (T = 4), not / (B * T)
        ("seq-mean-token-sum-norm", 8.0, -10 / 8),  # a fixed normaliser (max response length)
    ],
)
def test_aggregate_hand_computed(agg: str, sum_norm: float | None, expected: float) -> None:
    torch.testing.assert_close(aggregate(AGG_LOSS, AGG_MASK, agg, sum_norm), torch.tensor(expected))


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", -2.5),
        ("seq-mean-token-mean", -3.0),
        ("seq-mean-token-sum", -5.0),
        ("seq-mean-token-sum-norm", -2.5),
    ],
)
def test_policy_loss_aggregation_modes(agg: str, expected: float) -> None:
    # ratio 1 everywhere, so the per-token loss is -A: the AGG_LOSS table above.
    adv = -AGG_LOSS
    logps = torch.full((2, 4), -0.7)
    out = policy_loss(logps, logps.clone(), adv, AGG_MASK, **arpo(agg=agg))
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    torch.testing.assert_close(out.pg_loss, torch.tensor(expected))


def test_empty_mask_gives_zero_not_nan() -> None:
    logps = torch.zeros(2, 3, requires_grad=True)
    for agg in AGGREGATIONS:
        out = policy_loss(logps, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), **arpo(agg=agg))
        assert out.loss == 0 and out.clip_high_frac == 0 and out.approx_kl == 0
        out.loss.backward()
        assert torch.equal(logps.grad, torch.zeros(2, 3))


def test_seq_mean_token_mean_with_an_empty_row() -> None:
    # An empty row contributes 0 and still counts in the mean over B (TRL's clamp(min=1)).
    loss = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    torch.testing.assert_close(aggregate(loss, mask, "seq-mean-token-mean", None), torch.tensor(1.5))


# ---- KL ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "d", "expected"),
    [
        ("k1", 0.5, 0.5),
        ("k1", -1.0, -1.0),
        ("k2", 0.5, 0.125),
        ("k2", -1.0, 0.5),
        ("k3", 0.5, math.exp(-0.5) + 0.5 - 1),  # 0.10653
        ("k3", -1.0, math.e - 2),  # 0.71828
        ("k3", 0.0, 0.0),
        ("k3", -5.0, 10.0),  # exp(5) - 6 = 142.4, clamped to 10 as verl's low_var_kl
        ("k3", 30.0, 10.0),  # exp(-30) + 29 -> 10
        ("k3", -30.0, 10.0),  # log-ratio clamped to 20 first, then the result
    ],
)
def test_kl_estimators_hand_computed(estimator: str, d: float, expected: float) -> None:
    ref = torch.tensor([[-2.0]])
    got = kl_estimate(ref + d, ref, estimator)
    torch.testing.assert_close(got, torch.tensor([[expected]]))


def test_kl_added_before_aggregation() -> None:
    # A = 0 and ratio 1: the loss is kl_coef * aggregated KL. Row 0: d = (0.5, -1), row 1: d = (2, pad).
    ref = torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    d = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    logps = (ref + d).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    k2 = [0.125, 0.5, 2.0]
    out = policy_loss(
        logps,
        logps.detach(),
        torch.zeros(2),
        mask,
        ref_logps=ref,
        **arpo(kl_coef=0.1, kl_estimator="k2", agg="seq-mean-token-mean"),
    )
    expected = 0.1 * ((0.125 + 0.5) / 2 + 2.0) / 2
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    torch.testing.assert_close(out.kl, torch.tensor(sum(k2) / 3))  # the metric is always a token mean
    torch.testing.assert_close(out.pg_loss, torch.tensor(0.0))
    out.loss.backward()
    # d/dlogp 0.1 * 0.5 d^2 = 0.1 d, times the aggregation weights 1/(2*2), 1/(2*2), 1/(2*1)
    torch.testing.assert_close(logps.grad, torch.tensor([[0.1 * 0.5 / 4, 0.1 * -1 / 4], [0.1 * 2 / 2, 0.0]]))


def test_kl_metric_reported_with_zero_coef() -> None:
    logps = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[-1.0, 1.0]])
    out = policy_loss(logps, logps, torch.ones(1), torch.ones(1, 2), ref_logps=ref, **arpo(kl_estimator="k1"))
    torch.testing.assert_close(out.kl, torch.tensor(0.0))  # k1: (1 + -1) / 2
    torch.testing.assert_close(out.loss, torch.tensor(-1.0))  # KL does not enter with coef 0


def test_approx_kl_and_entropy() -> None:
    lr = torch.tensor([[0.1, -0.2, 5.0]])  # last one masked
    mask = torch.tensor([[1, 1, 0]])
    ent = torch.tensor([[1.0, 3.0, float("nan")]])
    out = policy_loss(lr, torch.zeros(1, 3), torch.ones(1), mask, entropy=ent, **arpo())
    k3 = [(math.exp(x) - 1) - x for x in (0.1, -0.2)]
    torch.testing.assert_close(out.approx_kl, torch.tensor(sum(k3) / 2))
    torch.testing.assert_close(out.entropy, torch.tensor(2.0))


# ---- masks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("garbage", [float("-inf"), float("nan"), 1e4, -1e4])
def test_masked_tokens_never_affect_loss_or_grad(estimator: str, agg: str, garbage: float) -> None:
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    base = torch.randn(3, 5, generator=g) * 0.5 - 1
    old = torch.randn(3, 5, generator=g) * 0.5 - 1
    ref = torch.randn(3, 5, generator=g) * 0.5 - 1
    adv = torch.randn(3, 5, generator=g)
    ent = torch.rand(3, 5, generator=g)

    def run(fill: float | None) -> tuple[LossOutput, torch.Tensor]:
        def f(t: torch.Tensor) -> torch.Tensor:
            return t if fill is None else torch.where(mask.bool(), t, fill)

        logps = f(base).clone().requires_grad_()
        out = policy_loss(
            logps,
            f(old),
            f(adv),
            mask,
            ref_logps=f(ref),
            entropy=f(ent),
            **arpo(kl_coef=0.05, kl_estimator=estimator, agg=agg),
        )
        out.loss.backward()
        return out, logps.grad

    clean, clean_grad = run(None)
    dirty, dirty_grad = run(garbage)
    for x, y in zip(clean, dirty, strict=True):
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(clean_grad, dirty_grad)
    assert torch.equal(dirty_grad[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))
    assert torch.isfinite(dirty_grad).all()


def test_bool_and_float_masks_agree() -> None:
    logps, old, adv, mask = _case_batch()
    a = policy_loss(logps, old, adv, mask.bool(), **arpo())
    b = policy_loss(logps, old, adv, mask.float(), **arpo())
    torch.testing.assert_close(a.loss, b.loss)


# ---- reference loop ------------------------------------------------------------------------------


def _loop_reference(logps, old, adv, mask, ref, kl_coef, estimator, agg, cl, ch, cd):
    """Token by token, with scalar tensor ops so autograd can check the gradient too."""
    B, T = logps.shape
    per_token = [[None] * T for _ in range(B)]
    n_low = n_high = n_dual = n = 0
    kls = []
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            n += 1
            a = float(adv[b])
            r = torch.exp(logps[b, t] - old[b, t])
            pg1 = -a * r
            pg2 = -a * torch.clamp(r, 1 - cl, 1 + ch)
            loss = torch.maximum(pg1, pg2)
            if a < 0:
                loss = torch.minimum(loss, torch.tensor(-a * cd))
            rv = float(r.detach())
            n_low += a < 0 and rv < 1 - cl
            n_high += a > 0 and rv > 1 + ch
            n_dual += a < 0 and rv > cd
            d = logps[b, t] - ref[b, t]
            kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.clamp(torch.exp(-d) + d - 1, max=10.0)}[estimator]
            kls.append(float(kl.detach()))
            per_token[b][t] = loss + kl_coef * kl
    rows = [[x for x in row if x is not None] for row in per_token]
    if agg == "token-mean":
        total = sum(sum(row) for row in rows) / n
    elif agg == "seq-mean-token-mean":
        total = sum(sum(row) / len(row) for row in rows) / B
    elif agg == "seq-mean-token-sum":
        total = sum(sum(row) for row in rows) / B
    else:
        total = sum(sum(row) for row in rows) / T
    return total, n_low / n, n_high / n, n_dual / n, sum(kls) / n


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_reference_on_random_inputs(agg: str, estimator: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    old = -torch.rand(B, T, generator=g) * 3
    logps = (old + torch.randn(B, T, generator=g)).requires_grad_()  # ratios ~0.1..10: all clips
    ref = old + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, generator=g)
    lengths = [7, 3, 5, 1]
    mask = torch.tensor([[1] * k + [0] * (T - k) for k in lengths])

    out = policy_loss(
        logps, old, adv, mask, ref_logps=ref, **arpo(kl_coef=0.1, kl_estimator=estimator, agg=agg)
    )
    out.loss.backward()
    grad = logps.grad.clone()

    logps.grad = None
    total, low, high, dual, kl = _loop_reference(
        logps, old, adv, mask.tolist(), ref, 0.1, estimator, agg, 0.2, 0.3, 3.0
    )
    total.backward()
    torch.testing.assert_close(out.loss, total.detach())
    torch.testing.assert_close(grad, logps.grad)
    torch.testing.assert_close(out.clip_low_frac, torch.tensor(low))
    torch.testing.assert_close(out.clip_high_frac, torch.tensor(high))
    torch.testing.assert_close(out.clip_dual_frac, torch.tensor(dual))
    torch.testing.assert_close(out.kl, torch.tensor(kl))
    assert low > 0 and high > 0 and dual > 0  # the random batch exercises every clip


# ---- types, dtypes and errors ------------------------------------------------------------------------


def test_output_fields_detached_except_loss() -> None:
    logps, old, adv, mask = _case_batch()
    out = policy_loss(logps, old, adv, mask, ref_logps=old, entropy=torch.ones(1, 8), **arpo(kl_coef=0.1))
    assert out.loss.requires_grad and out.loss.dim() == 0
    for name in (
        "pg_loss",
        "kl",
        "clip_low_frac",
        "clip_high_frac",
        "clip_dual_frac",
        "approx_kl",
        "entropy",
    ):
        value = getattr(out, name)
        assert value.dim() == 0 and not value.requires_grad, name


def test_bf16_inputs_compute_in_float32() -> None:
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    out = policy_loss(logps, logps.detach() - 0.1, torch.ones(1), torch.ones(1, 2), **arpo())
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert logps.grad is not None and logps.grad.dtype == torch.bfloat16 and (logps.grad != 0).all()


def test_old_logps_and_advantages_get_no_gradient() -> None:
    logps = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -0.1, requires_grad=True)
    adv = torch.ones(1, requires_grad=True)
    policy_loss(logps, old, adv, torch.ones(1, 2), **arpo()).loss.backward()
    assert old.grad is None and adv.grad is None and logps.grad is not None


def test_masked_mean() -> None:
    v = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    m = torch.tensor([[1, 0], [1, 1]])
    torch.testing.assert_close(masked_mean(v, m), torch.tensor(3.0))
    assert masked_mean(v, torch.zeros(2, 2)) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"agg": "sum"}, r"unknown agg 'sum'; valid: \['seq-mean-token-mean', 'seq-mean-token-sum', "),
        ({"kl_estimator": "low_var_kl"}, r"valid: \['k1', 'k2', 'k3'\]"),
        ({"clip_dual": 1.0}, "clip_dual must be > 1"),
        ({"clip_low": 1.0}, "clip_low < 1"),
        ({"clip_high": -0.1}, "clip_high >= 0"),
        ({"kl_coef": 0.1}, "needs ref_logps"),
        ({"sum_norm": 0.0}, "sum_norm must be > 0"),
        ({"advantages": torch.ones(3)}, "advantages must be"),
        ({"mask": torch.ones(2, 5)}, "mask has shape"),
        ({"old_logps": torch.ones(2, 3)}, "old_logps has shape"),
        ({"ref_logps": torch.ones(2)}, "ref_logps has shape"),
        ({"logps": torch.zeros(2, 4, 1)}, r"logps must be \(B, T\)"),
    ],
)
def test_errors(kwargs: dict, match: str) -> None:
    args = {
        "logps": torch.zeros(2, 4),
        "old_logps": torch.zeros(2, 4),
        "advantages": torch.ones(2),
        "mask": torch.ones(2, 4),
        **arpo(),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(**args)


def test_loss_settings_have_no_defaults() -> None:
    """LossSection is the one place with defaults: leaving a setting out is an error, not ARPO's value."""
    logps, old, adv, mask = _case_batch()
    for name in arpo():
        kw = arpo()
        del kw[name]
        with pytest.raises(TypeError, match=name):
            policy_loss(logps, old, adv, mask, **kw)


def test_aggregate_and_kl_estimate_unknown_names() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(AGG_LOSS, AGG_MASK, "mean", None)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "kl")
