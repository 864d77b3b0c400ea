"""HF generation: nucleus filter, batched == one-at-a-time, behaviour log-probs == recomputed log-probs."""

import sys

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_core.policy.generate import Generation, HFGenerator, VLLMGenerator, sample_next, top_p_filter
from arpo_core.policy.model import Policy, build_tiny_policy
from arpo_core.policy.prompt import PromptInput, PromptSpec, Reply
from arpo_core.policy.sequences import (
    collate,
    encode_prompt,
    encode_trajectory,
    encode_trajectory_windows,
    sequence_logprobs,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Policy:
    return build_tiny_policy(tmp_path_factory.mktemp("tiny"), size="xs", seed=0)


def screen(i: int) -> Image.Image:
    im = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(im).rectangle([10 + 25 * i, 30 + 15 * i, 40 + 25 * i, 50 + 15 * i], fill=(200, 40 * i, 60))
    return im


def prompts() -> list[PromptInput]:
    """Three prompts with 1, 2 and 3 screenshots (different lengths -> real left padding)."""
    return [
        PromptInput("Click the red box.", (screen(0),)),
        PromptInput("Type hello.", (screen(1), screen(2)), (Reply("Thought: a.\nAction: wait()"),)),
        PromptInput(
            "Scroll down.",
            (screen(3), screen(4), screen(5)),
            (
                Reply("Thought: b.\nAction: click(start_box='(9,9)')"),
                Reply("Thought: c.\nAction: press(key='tab')"),
            ),
        ),
    ]


def test_top_p_filter_hand_computed():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]])
    assert torch.allclose(top_p_filter(p, 0.6), torch.tensor([[0.625, 0.375, 0.0], [0.0, 0.625, 0.375]]))
    # mass strictly ahead of the second token is 0.5, not < 0.5: only the top token survives
    assert torch.allclose(top_p_filter(p, 0.5), torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert torch.equal(top_p_filter(p, 1.0), p)


def test_sample_next_greedy_and_top_p_tiny():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.9]])
    assert sample_next(logits, 0.0, 1.0, None).tolist() == [1, 0]
    for u in (1e-9, 0.5, 1.0):  # top_p -> only the argmax is left, whatever the draw
        assert sample_next(logits, 1.0, 1e-6, torch.tensor([u, u])).tolist() == [1, 0]
    with pytest.raises(ValueError, match="one uniform draw per row"):
        sample_next(logits, 1.0, 1.0, None)


def test_sample_next_inverse_cdf_matches_the_distribution():
    """Row b takes the first token whose cumulative probability reaches u_b: the boundaries are exact,
    zero-probability tokens are never taken, and uniform draws give the softmax frequencies."""
    logits = torch.log(torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]]))
    at = lambda u: int(sample_next(logits, 1.0, 1.0, torch.tensor([u]))[0])  # noqa: E731
    assert [at(u) for u in (1e-9, 0.1999, 0.2001, 0.6999, 0.7001, 1.0)] == [0, 0, 2, 2, 3, 3]
    probs = torch.tensor([0.1, 0.6, 0.3])
    u = 1.0 - torch.rand(40000, generator=torch.Generator().manual_seed(0))
    drawn = sample_next(torch.log(probs).expand(40000, 3), 1.0, 1.0, u)
    freq = torch.bincount(drawn, minlength=3).float() / 40000
    assert torch.allclose(freq, probs, atol=0.01), freq  # 0.01 is > 4 standard errors at n = 40000


@pytest.mark.parametrize("system", ["compact", "uitars"])
def test_batched_equals_one_at_a_time_greedy(policy, system):
    gen = HFGenerator(policy, spec=PromptSpec(system, None))
    batched = gen.generate(prompts(), temperature=0.0, top_p=1.0, max_new_tokens=12)
    for b, p in enumerate(prompts()):
        single = gen.generate([p], temperature=0.0, top_p=1.0, max_new_tokens=12)[0]
        assert single.token_ids == batched[b].token_ids
        assert single.logprobs == pytest.approx(batched[b].logprobs, abs=1e-4)


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12}


def test_batched_equals_one_at_a_time_sampled(policy):
    """Prompt b is sampled with its own seed `seeds[b]` (generate.py, decision "Own decode loop"), whatever
    its row."""
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    seeds = [7, 1234567890123, 7]  # equal seeds for different prompts are fine: each has its own generator
    batched = gen.generate(prompts(), seeds=seeds, **SAMPLED)
    for b, p in enumerate(prompts()):
        single = gen.generate([p], seeds=[seeds[b]], **SAMPLED)[0]
        assert single.token_ids == batched[b].token_ids
    again = gen.generate(prompts(), seeds=seeds, **SAMPLED)
    assert [g.token_ids for g in again] == [g.token_ids for g in batched]
    other = gen.generate(prompts(), seeds=[8, 9, 10], **SAMPLED)
    assert [g.token_ids for g in other] != [g.token_ids for g in batched]


def test_reply_follows_its_seed_not_its_row(policy):
    """Reordering the batch (and its seeds) reorders the replies and changes nothing else: what a rollout
    needs so that which env an episode runs on, and with whom it shares a batch, does not matter."""
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    seeds = [11, 22, 33]
    forward = gen.generate(prompts(), seeds=seeds, **SAMPLED)
    backward = gen.generate(prompts()[::-1], seeds=seeds[::-1], **SAMPLED)
    assert [g.token_ids for g in backward[::-1]] == [g.token_ids for g in forward]
    pair = gen.generate(prompts()[1:], seeds=seeds[1:], **SAMPLED)
    assert [g.token_ids for g in pair] == [g.token_ids for g in forward[1:]]


def test_seeds_are_checked(policy):
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    with pytest.raises(ValueError, match="one seed per prompt"):
        gen.generate(prompts(), **SAMPLED)  # sampling needs seeds
    with pytest.raises(ValueError, match="3 prompts need 3 seeds, got 2"):
        gen.generate(prompts(), seeds=[1, 2], **SAMPLED)
    with pytest.raises(TypeError, match="max_new_tokens"):
        gen.generate(prompts(), temperature=0.0, top_p=1.0)  # no default: params own it
    with pytest.raises(TypeError, match="spec"):
        HFGenerator(policy)  # no default prompt: params own it


def test_generation_fields(policy):
    g = HFGenerator(policy, spec=PromptSpec("compact", None)).generate(
        prompts()[:1], temperature=1.0, top_p=1.0, max_new_tokens=5, seeds=[0]
    )[0]
    assert isinstance(g, Generation)
    assert len(g.token_ids) == len(g.logprobs) <= 5
    assert all(lp <= 0.0 for lp in g.logprobs)
    assert g.finish_reason == ("stop" if g.token_ids[-1] in (policy.im_end_id, policy.pad_id) else "length")
    assert g.text == policy.tokenizer.decode(g.token_ids, skip_special_tokens=True)


def _rollout(gen: HFGenerator, instructions: list[str], n_steps: list[int], temperature: float, top_p: float):
    """Play episodes step-synchronously in one batch; returns trajectories and per-episode behaviour logps."""
    shots = [[screen(3 * e)] for e in range(len(instructions))]
    replies: list[list[Reply]] = [[] for _ in instructions]
    logps: list[list[float]] = [[] for _ in instructions]
    for step in range(max(n_steps)):
        live = [e for e in range(len(instructions)) if step < n_steps[e]]
        batch = [PromptInput(instructions[e], tuple(shots[e]), tuple(replies[e])) for e in live]
        seeds = [100 * step + e for e in live]
        outs = gen.generate(batch, temperature=temperature, top_p=top_p, max_new_tokens=16, seeds=seeds)
        for e, out in zip(live, outs, strict=True):
            replies[e].append(Reply(out.text, out.token_ids))
            logps[e].extend(out.logprobs)
            if step + 1 < n_steps[e]:
                shots[e].append(screen(3 * e + step + 1))
    trajs = [
        Trajectory(
            "run",
            "test",
            0,
            "miniwob",
            "t",
            instructions[e],
            [
                Step(i, png_bytes(s), 160, 210, r.text, response_token_ids=list(r.token_ids))
                for i, (s, r) in enumerate(zip(shots[e], replies[e], strict=True))
            ],
        )
        for e in range(len(instructions))
    ]
    return trajs, logps


@pytest.mark.parametrize(("system", "temperature", "top_p"), [("compact", 1.0, 1.0), ("uitars", 0.7, 0.9)])
def test_generation_logprobs_match_recomputed(policy, system, temperature, top_p):
    """Multi-turn episodes of 2-3 screenshots: the behaviour log-probs returned by generation equal the
    log-probs recomputed in one right-padded training forward (fp32), token for token."""
    gen = HFGenerator(policy, spec=PromptSpec(system, None))
    trajs, gen_logps = _rollout(
        gen, ["Click the red box.", "Enter the text.", "Select alpha."], [2, 3, 3], temperature, top_p
    )
    seqs = [encode_trajectory(policy, t, spec=PromptSpec(system, None)) for t in trajs]
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
    max_diff = 0.0
    for b in range(len(trajs)):
        rec = logps[b][mask[b]]
        assert rec.shape[0] == len(gen_logps[b])
        max_diff = max(max_diff, float((rec - torch.tensor(gen_logps[b])).abs().max()))
    print(f"max |gen logp - recomputed logp| ({system}, T={temperature}, top_p={top_p}): {max_diff:.2e}")
    assert max_diff < 1e-4


@pytest.mark.parametrize("k", [1, 2])
def test_history_window_logprobs_match_recomputed(policy, k):
    """sequences.py, decision "History windows": with a history window K shorter than the episode, every reply
    recomputed over the trajectory's windows (as training encodes it) has the log-probs it was sampled with;
    one sequence of the whole episode gives the earlier replies other contexts (checked to differ)."""
    gen = HFGenerator(policy, spec=PromptSpec("compact", k))
    trajs, gen_logps = _rollout(gen, ["Click the red box.", "Enter the text."], [3, 2], 1.0, 1.0)
    for traj, expected in zip(trajs, gen_logps, strict=True):
        windows = encode_trajectory_windows(policy, traj, spec=PromptSpec("compact", k))
        assert len(windows) == max(1, len(traj.steps) - k + 1)
        with torch.no_grad():
            logps, mask = sequence_logprobs(
                policy.model, collate(windows, policy.pad_id, policy.image_token_id)
            )
        rec = torch.cat([logps[b][mask[b]] for b in range(len(windows))])
        assert rec.shape[0] == len(expected)
        assert float((rec - torch.tensor(expected)).abs().max()) < 1e-4
        if len(traj.steps) > k:
            one = encode_trajectory(policy, traj, spec=PromptSpec("compact", k))
            with torch.no_grad():
                lp1, m1 = sequence_logprobs(
                    policy.model, collate([one], policy.pad_id, policy.image_token_id)
                )
            assert float((lp1[0][m1[0]] - torch.tensor(expected)).abs().max()) > 1e-3


def test_logprob_gap_over_history_windows(policy):
    """The trainer's generator-vs-trainer diagnostic pairs each reply with its own window's sums (update.py,
    decision "Windowed trajectories"): on episodes sampled at K = 1 every reply is compared and the gap is
    float noise."""
    import dataclasses

    from arpo_core.algorithm.trainer import logprob_gap
    from arpo_core.algorithm.update import compute_logps, encode_trajectories

    gen = HFGenerator(policy, spec=PromptSpec("compact", 1))
    trajs, gen_logps = _rollout(
        gen, ["Click the red box.", "Enter the text.", "Select alpha."], [3, 1, 2], 1.0, 1.0
    )
    stamped = []
    for t, lps in zip(trajs, gen_logps, strict=True):
        steps, k = [], 0
        for st in t.steps:
            n = len(st.response_token_ids)
            steps.append(dataclasses.replace(st, gen_logprob_sum=float(sum(lps[k : k + n]))))
            k += n
        stamped.append(dataclasses.replace(t, steps=steps))
    seqs = encode_trajectories(policy, stamped, spec=PromptSpec("compact", 1))
    assert len(seqs) == 6
    gap = logprob_gap(stamped, seqs, compute_logps(policy, seqs, micro_batch_size=4, bf16=False))
    assert gap["logprob/replies_compared"] == 6
    assert gap["logprob/gen_vs_train_max_abs_per_token"] < 1e-4


def test_vllm_backend_import_guard(policy, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on this CPU machine: vLLM is not installed
    with pytest.raises(ImportError, match="separate GPU environment"):
        VLLMGenerator(policy, "/nonexistent", spec=PromptSpec("compact", None), max_images=3)


def test_vllm_backend_prompt_tokens(policy):
    """The vLLM prompt is the HF prompt with each image collapsed to one <|image_pad|> (vLLM expands it)."""
    gen = object.__new__(VLLMGenerator)  # no engine needed to build prompts
    gen.policy, gen.spec = policy, PromptSpec("compact", None)
    sampled = (Reply("Thought: a.\nAction: wait()", (17, 18, policy.im_end_id)),)
    p = PromptInput("Type hello.", (screen(1), screen(2)), sampled)
    vllm_prompt = gen._prompt(p)
    hf = encode_prompt(policy, p, spec=PromptSpec("compact", None))
    collapsed = [
        t for i, t in enumerate(hf.input_ids) if t != policy.image_token_id or hf.input_ids[i - 1] != t
    ]
    assert vllm_prompt["prompt_token_ids"] == collapsed
    assert len(vllm_prompt["multi_modal_data"]["image"]) == 2
    assert [17, 18, policy.im_end_id] in [collapsed[i : i + 3] for i in range(len(collapsed))]


def test_sample_next_never_draws_banned_ids():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.9]])
    banned = torch.tensor([1, 0])
    assert sample_next(logits, 0.0, 1.0, None, banned).tolist() == [2, 2]
    g = torch.Generator().manual_seed(0)
    assert all(
        sample_next(logits, 5.0, 1.0, 1.0 - torch.rand(2, generator=g), banned).tolist() == [2, 2]
        for _ in range(20)
    )


def test_vision_tokens_never_generated_and_logps_stay_raw(tmp_path):
    """A policy that prefers `<|image_pad|>` above everything still never emits it (the next prompt would
    otherwise have a wrong image-token count), and the recorded log-probs are the raw model's."""
    pol = build_tiny_policy(tmp_path, size="xs", seed=1)
    assert pol.image_token_id in pol.vision_token_ids and len(pol.vision_token_ids) >= 3
    head = pol.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[pol.image_token_id] = 50.0
    pol.model.lm_head = biased
    gen = HFGenerator(pol, spec=PromptSpec("compact", None))
    for temperature in (0.0, 1.0):
        outs = gen.generate(prompts(), temperature=temperature, top_p=1.0, max_new_tokens=6, seeds=[3, 4, 5])
        for o in outs:
            assert not set(o.token_ids) & set(pol.vision_token_ids)
            assert all(lp < -40 for lp in o.logprobs)  # the raw distribution puts ~all mass on image_pad
    # and the reply can go back into a prompt as history without breaking the next step
    nxt = PromptInput("Click.", (screen(0), screen(1)), (Reply(outs[0].text, outs[0].token_ids),))
    assert len(gen.generate([nxt], temperature=0.0, top_p=1.0, max_new_tokens=3)) == 1


@pytest.mark.parametrize("size", ["xs", "s"])
def test_lean_decoder_equals_the_stock_forward(tmp_path, size):
    """decode.py, decision "Same arithmetic": decode steps through `LeanDecoder` give the stock forward's
    tokens, and log-probs within float rounding, greedy and sampled, over a left-padded batch with history."""
    from arpo_core.policy.decode import LeanDecoder

    pol = build_tiny_policy(tmp_path / size, size=size, seed=1)
    lean = HFGenerator(pol, spec=PromptSpec("compact", None))
    stock = HFGenerator(pol, spec=PromptSpec("compact", None))
    stock.lean_decode = False
    assert lean.use_lean_decoder(pol.model) and not stock.use_lean_decoder(pol.model)
    calls = []
    orig_step = LeanDecoder.step

    def counted(self, ids):
        calls.append(ids.shape[0])
        return orig_step(self, ids)

    LeanDecoder.step = counted
    try:
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.8, 0.9)):
            kw = {"temperature": temperature, "top_p": top_p, "max_new_tokens": 40, "seeds": [3, 4, 5]}
            a = stock.generate(prompts(), **kw)
            n = len(calls)
            b = lean.generate(prompts(), **kw)
            assert len(calls) > n  # the lean path ran
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
                torch.testing.assert_close(
                    torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=1e-5
                )
    finally:
        LeanDecoder.step = orig_step


def test_lean_decoder_only_where_it_applies(policy):
    """decode.py, decision "Applicability check": a model in training mode or with a non-stock attention
    kernel takes the stock forward."""
    from arpo_core.policy.decode import LeanDecoder

    model = policy.model
    assert LeanDecoder.supports(model)
    model.train()
    try:
        assert not LeanDecoder.supports(model)
    finally:
        model.eval()
    cfg = model.model.language_model.config
    impl = cfg._attn_implementation
    try:
        cfg._attn_implementation = "flash_attention_2"
        assert not LeanDecoder.supports(model)
    finally:
        cfg._attn_implementation = impl
    assert LeanDecoder.supports(model)


def test_generates_in_eval_mode_and_restores_the_mode(policy):
    """After an update the trainer leaves the model in train mode: generation still runs in eval mode
    (the lean decoder applies) and hands the model back in the mode it found it."""
    from arpo_core.policy.decode import LeanDecoder

    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    seen = []
    orig = LeanDecoder.__init__

    def spy(self, model, *a, **k):
        seen.append(model.training)
        orig(self, model, *a, **k)

    LeanDecoder.__init__ = spy
    try:
        policy.model.train()
        gen.generate(prompts()[:1], temperature=0.0, top_p=1.0, max_new_tokens=4)
        assert seen == [False] and policy.model.training
        policy.model.eval()
        gen.generate(prompts()[:1], temperature=0.0, top_p=1.0, max_new_tokens=4)
        assert seen == [False, False] and not policy.model.training
    finally:
        LeanDecoder.__init__ = orig
        policy.model.eval()


def test_shared_prefix_len_stops_at_the_first_difference_or_image():
    from arpo_core.policy.generate import shared_prefix_len
    from arpo_core.policy.sequences import EncodedSequence

    def seq(ids):
        return EncodedSequence(ids, [False] * len(ids), None, None)

    assert shared_prefix_len([seq([1, 2, 3, 4]), seq([1, 2, 5])], image_token_id=9) == 2
    assert shared_prefix_len([seq([1, 2, 9, 9]), seq([1, 2, 9, 9])], image_token_id=9) == 2  # never an image
    assert shared_prefix_len([seq([1, 2]), seq([1, 2, 3])], image_token_id=9) == 2
    assert shared_prefix_len([seq([7]), seq([1])], image_token_id=9) == 0


@pytest.mark.parametrize("system", ["compact", "uitars"])
def test_shared_prompt_head_changes_no_reply(policy, system):
    """generate.py, decision "Shared prompt head": the batch's shared head computed once gives the same tokens
    as the unshared prefill, and log-probs within float rounding, greedy and sampled, over prompts of
    different lengths (so padding sits between the head and each row's rest)."""
    shared = HFGenerator(policy, spec=PromptSpec(system, None))
    plain = HFGenerator(policy, spec=PromptSpec(system, None))
    plain.share_prefix = False
    heads = []
    orig = policy.model.model.language_model.forward

    def spy(*a, **kw):
        if kw.get("input_ids") is not None:  # only the head's call passes token ids to the text model
            heads.append(tuple(kw["input_ids"].shape))
        return orig(*a, **kw)

    policy.model.model.language_model.forward = spy
    try:
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.8, 0.9)):
            kw = {"temperature": temperature, "top_p": top_p, "max_new_tokens": 24, "seeds": [3, 4, 5]}
            a = plain.generate(prompts(), **kw)
            assert not heads
            b = shared.generate(prompts(), **kw)
            assert len(heads) == 1 and heads.pop()[0] == 1  # one head forward, for one row
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                torch.testing.assert_close(
                    torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=1e-5
                )
        shared.generate(prompts()[:1], temperature=0.0, top_p=1.0, max_new_tokens=4)
        assert not heads  # one prompt: nothing to share
    finally:
        del policy.model.model.language_model.forward


WRITTEN = (
    "Thought: I click the box.\nAction: click(start_box='(12,345)')",
    "Thought: b.\nAction: click(start_box='(7,8)')\nThought: more.",
    "Thought: nothing to click.\nAction: wait()",
)


def _written(self, batch, **_):
    """Stand-in for the decode loop: the WRITTEN replies, closed by <|im_end|>, with dummy log-probs."""
    out = []
    for text in WRITTEN[: len(batch)]:
        ids = (*self.policy.tokenizer.encode(text, add_special_tokens=False), self.policy.im_end_id)
        out.append(Generation(text, ids, (-9.0,) * len(ids), "stop"))
    return out


def test_read_clicks_rewrite_the_first_click_with_the_rewritten_tokens_log_probs(policy, monkeypatch):
    """generate.py, decision "Read clicks": the reply's first click is written with the point read off the
    heads (here a stand-in readout that records what it is given: each prompt with its written reply, the
    reply in the assistant mask), the tokens before x's first character and the rest of the reply are kept,
    the stop token closes it, and its log-probs are the ones training recomputes from the trajectory; a
    reply without a click is returned as written. Then with the real readout: a cell's centre."""
    from arpo_core.policy import generate
    from arpo_core.policy.heads import click_positions

    seen = []

    class Read:  # a fixed read point, at the position the real readout reads it
        def __init__(self, enc, point):
            self.at, self.point = click_positions(policy, enc, first=True)[0], point

        def click(self, readout, written):
            assert readout == mode and written == first_click(self.text)
            return written if self.point is None else self.point

    def readout(pol, encoded):
        seen.extend(encoded)
        reads = [Read(e, p) for e, p in zip(encoded, points, strict=False)]
        for r, text in zip(reads, WRITTEN, strict=False):
            r.text = text
        return reads

    def first_click(text):
        return tuple(float(v) for v in generate._CLICK.search(text).group(1).split(","))

    mode, points = "cell", [(98.4, 69.6), (14.0, 14.0)]

    monkeypatch.setattr(HFGenerator, "_generate", _written)
    monkeypatch.setattr(generate, "pointed", readout)
    spec = PromptSpec("compact", None)
    gen = HFGenerator(policy, spec=spec, click_readout="cell")
    out = gen.generate(prompts(), temperature=0.0, top_p=1.0, max_new_tokens=40)
    assert [g.text for g in out] == [
        "Thought: I click the box.\nAction: click(start_box='(98,70)')",
        "Thought: b.\nAction: click(start_box='(14,14)')\nThought: more.",
        WRITTEN[2],
    ]
    assert out[2].logprobs == (-9.0,) * len(out[2].token_ids)  # untouched
    for p, enc, text in zip(prompts(), seen, WRITTEN, strict=False):
        prompt = encode_prompt(policy, p, spec=spec).input_ids
        assert enc.input_ids[: len(prompt)] == prompt and not any(enc.assistant_mask[: len(prompt)])
        assert policy.tokenizer.decode(enc.input_ids[len(prompt) :], skip_special_tokens=True) == text
    for g, text in zip(out[:2], WRITTEN, strict=False):
        assert g.token_ids[-1] == policy.im_end_id and g.finish_reason == "stop"
        assert policy.tokenizer.decode(g.token_ids, skip_special_tokens=True) == g.text
        ids = policy.tokenizer.encode(text, add_special_tokens=False)
        kept = next(i for i, (a, b) in enumerate(zip(ids, g.token_ids, strict=False)) if a != b)
        assert len(policy.tokenizer.decode(ids[:kept])) >= text.index("start_box='(") + len("start_box='(")
    trajs = []
    for p, g in zip(prompts(), out[:2], strict=False):  # earlier turns as context, the read reply trained
        earlier = [
            Step(i, png_bytes(s), 160, 210, r.text, train_reply=False)
            for i, (s, r) in enumerate(zip(p.screenshots, p.replies, strict=False))
        ]
        last = Step(
            len(earlier), png_bytes(p.screenshots[-1]), 160, 210, g.text, response_token_ids=list(g.token_ids)
        )
        trajs.append(Trajectory("run", "test", 0, "miniwob", "t", p.instruction, [*earlier, last]))
    seqs = [encode_trajectory(policy, t, spec=spec) for t in trajs]
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
    for b, g in enumerate(out[:2]):
        assert logps[b][mask[b]].tolist() == pytest.approx(list(g.logprobs), abs=1e-4)

    mode, points = "guarded", [None, (14.0, 14.0)]  # `guarded` keeps the first reply's written click
    kept = HFGenerator(policy, spec=spec, click_readout="guarded").generate(
        prompts(), temperature=0.0, top_p=1.0, max_new_tokens=40
    )
    assert kept[0] == _written(gen, prompts())[0] and kept[1:] == out[1:]

    monkeypatch.undo()
    monkeypatch.setattr(HFGenerator, "_generate", _written)
    real = HFGenerator(policy, spec=spec, click_readout="cell").generate(
        prompts(), temperature=0.0, top_p=1.0, max_new_tokens=40
    )
    for g in real[:2]:
        x, y = (int(v) for v in generate._CLICK.search(g.text).group(1).split(","))
        assert (x - 14) % 28 == 0 and (y - 14) % 28 == 0 and 0 < x < 224 and 0 < y < 224, g.text
    assert real[2] == out[2]
    with pytest.raises(ValueError, match="unknown click_readout 'argmax'"):
        HFGenerator(policy, spec=spec, click_readout="argmax")


def test_the_params_policy_section_sets_the_readout(policy):
    """make_generator (and the trainer, through `HFGenerator.of`) take `policy.click_readout` from params."""
    from arpo_core.config import PolicyConfig
    from arpo_core.policy.generate import make_generator

    for readout in ("tokens", "cell", "block"):
        gen = make_generator(policy, "unused", PolicyConfig(click_readout=readout), max_images=1)
        assert isinstance(gen, HFGenerator) and gen.click_readout == readout
