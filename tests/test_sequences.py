"""Trajectory -> one token sequence with assistant mask and images; padded per-token log-probs."""

import math

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_core.policy.model import Policy, build_tiny_policy
from arpo_core.policy.prompt import PromptInput, PromptSpec, Reply
from arpo_core.policy.sequences import (
    EncodedSequence,
    collate,
    encode_prompt,
    encode_trajectory,
    encode_trajectory_windows,
    forward_logits,
    gather_logprobs,
    reply_ids,
    sequence_logprobs,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Policy:
    return build_tiny_policy(tmp_path_factory.mktemp("tiny"), size="xs", seed=0)


def screen(x: int, y: int, color=(220, 40, 40)) -> Image.Image:
    im = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(im).rectangle([x - 10, y - 8, x + 10, y + 8], fill=color)
    return im


def trajectory(
    replies: list[str], token_ids: list[list[int]] | None = None, instruction="Click the box."
) -> Trajectory:
    steps = [
        Step(
            i,
            png_bytes(screen(20 + 30 * i, 40 + 20 * i)),
            160,
            210,
            r,
            response_token_ids=(token_ids or [[]] * len(replies))[i],
        )
        for i, r in enumerate(replies)
    ]
    return Trajectory("run", "test", 0, "miniwob", "click-test", instruction, steps)


def test_gather_logprobs_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]])  # softmax rows: [1/4, 3/4], [1/2, 1/2]
    got = gather_logprobs(logits, torch.tensor([1, 0]))
    assert torch.allclose(got, torch.tensor([math.log(0.75), math.log(0.5)]))
    # temperature 2 on row 0: logits [0, ln3/2] -> p1 = sqrt(3) / (1 + sqrt(3))
    got_t = gather_logprobs(logits[:1], torch.tensor([1]), temperature=2.0)
    assert torch.allclose(got_t, torch.tensor([math.log(math.sqrt(3) / (1 + math.sqrt(3)))]))


def test_collate_pads_left_and_right():
    a = EncodedSequence([5, 6, 7], [False, True, True], None, None)
    b = EncodedSequence([9], [True], None, None)
    r = collate([a, b], pad_id=0, image_token_id=7)
    assert r.input_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert r.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert r.assistant_mask.tolist() == [[False, True, True], [True, False, False]]
    assert r.mm_token_type_ids.tolist() == [[0, 0, 1], [0, 0, 0]]
    assert r.pixel_values is None and r.image_grid_thw is None
    left = collate([a, b], pad_id=0, image_token_id=7, padding_side="left")
    assert left.input_ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert left.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        collate([a], 0, 7, padding_side="middle")


def test_collate_keeps_a_shared_head_left_of_the_padding():
    a = EncodedSequence([5, 6, 8, 7], [False, False, True, True], None, None)
    b = EncodedSequence([5, 6, 9], [False, False, True], None, None)
    r = collate([a, b], pad_id=0, image_token_id=7, padding_side="left", shared_head=2)
    assert r.input_ids.tolist() == [[5, 6, 8, 7], [5, 6, 0, 9]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]
    assert r.assistant_mask.tolist() == [[False, False, True, True], [False, False, False, True]]
    assert r.mm_token_type_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="do not share"):
        collate([a, b], 0, 7, padding_side="left", shared_head=3)
    with pytest.raises(ValueError, match="left padding"):
        collate([a, b], 0, 7, shared_head=2)


def test_trajectory_sequence_mask_covers_replies_and_im_end(policy):
    replies = [
        "Thought: box.\nAction: click(start_box='(21,43)')",
        "Thought: done.\nAction: finished(content='ok')",
    ]
    seq = encode_trajectory(policy, trajectory(replies), spec=PromptSpec("compact", None))
    ids = torch.tensor(seq.input_ids)
    mask = torch.tensor(seq.assistant_mask)
    assert policy.tokenizer.decode(ids[mask]) == "".join(r + "<|im_end|>" for r in replies)
    assert int((ids == policy.image_token_id).sum()) == 2 * 48
    assert seq.image_grid_thw.tolist() == [[1, 16, 12]] * 2
    assert seq.pixel_values.shape == (2 * 16 * 12, 3 * 2 * 14 * 14)
    # Every im_end that closes a reply is masked; the ones closing user/system turns are not.
    im_end = ids == policy.im_end_id
    assert int((im_end & mask).sum()) == 2 and int((im_end & ~mask).sum()) == 3


def test_token_ids_used_verbatim_and_truncated_reply_closed_unmasked(policy):
    tok = policy.tokenizer
    # Sampled ids win over re-tokenising the text ("Th" as the two tokens T, h).
    odd = [tok.convert_tokens_to_ids("T"), tok.convert_tokens_to_ids("h")]
    stopped = [*odd, policy.im_end_id]
    seq = encode_trajectory(
        policy, trajectory(["Th", "Th"], [stopped, odd]), spec=PromptSpec("compact", None)
    )
    ids = torch.tensor(seq.input_ids)
    mask = torch.tensor(seq.assistant_mask)
    assert ids[mask].tolist() == stopped + odd  # the cut reply's appended im_end is not trained
    tail = seq.input_ids[-4:]
    assert tail == [*odd, policy.im_end_id, tok.encode("\n", add_special_tokens=False)[0]]
    assert seq.assistant_mask[-4:] == [True, True, False, False]


def test_history_window_in_training_sequence(policy):
    replies = ["a", "b", "c"]
    full = encode_trajectory(policy, trajectory(replies), spec=PromptSpec("compact", None))
    last1 = encode_trajectory(policy, trajectory(replies), spec=PromptSpec("compact", 1))
    assert full.input_ids.count(policy.image_token_id) == 3 * 48
    assert last1.input_ids.count(policy.image_token_id) == 48
    assert sum(full.assistant_mask) == sum(last1.assistant_mask)


@pytest.mark.parametrize("k", [1, 2, 3, None])
def test_history_windows_train_each_reply_once_in_its_generation_context(policy, k):
    """sequences.py, decision "History windows": each window is the generation prompt of its last step plus
    that reply (token for token); every trained reply is a target in exactly one window; untrained steps (a
    recovery demo's misses) are context only and a window with nothing to train is left out."""
    replies = ["Thought: a.\nAction: click(start_box='(1,2)')", "b", "c", "Thought: d.\nAction: wait()"]
    traj = trajectory(replies)
    traj.steps[0].train_reply = traj.steps[1].train_reply = False
    windows = encode_trajectory_windows(policy, traj, spec=PromptSpec("compact", k))
    trained = [tok for w in windows for tok, m in zip(w.input_ids, w.assistant_mask, strict=True) if m]
    rid = [reply_ids(policy, Reply(r))[0] for r in replies]
    assert trained == rid[2] + rid[3]
    if k is None:
        assert len(windows) == 1
        return
    assert len(windows) == 2  # the windows ending at steps 0 and 1 would train nothing
    shots = tuple(st.image() for st in traj.steps)
    for w, end in zip(windows, (2, 3), strict=True):
        prompt = encode_prompt(
            policy,
            PromptInput(traj.instruction, shots[: end + 1], tuple(Reply(r) for r in replies[:end])),
            spec=PromptSpec("compact", k),
        )
        assert w.input_ids[: len(prompt.input_ids)] == prompt.input_ids
        assert w.input_ids[len(prompt.input_ids) :][: len(rid[end])] == rid[end]
        assert w.input_ids.count(policy.image_token_id) == 48 * min(k, end + 1)


def test_prompt_is_prefix_of_trajectory_tokens(policy):
    replies = ["Thought: x.\nAction: click(start_box='(1,2)')", "Thought: y.\nAction: wait()"]
    traj = trajectory(replies)
    full = encode_trajectory(policy, traj, spec=PromptSpec("uitars", None))
    shots = tuple(s.image() for s in traj.steps)
    prompt = encode_prompt(
        policy,
        PromptInput(traj.instruction, shots, (Reply(replies[0]),)),
        spec=PromptSpec("uitars", None),
    )
    assert full.input_ids[: len(prompt.input_ids)] == prompt.input_ids
    assert full.assistant_mask[: len(prompt.input_ids)] == prompt.assistant_mask  # earlier reply masked


def test_padded_batch_equals_single_rows(policy):
    """Right padding changes nothing: each row's log-probs equal its unpadded forward."""
    t1 = trajectory(["Thought: a.\nAction: click(start_box='(5,6)')"])
    t2 = trajectory(
        ["Thought: longer reply here.\nAction: type(content='hello')", "Thought: b.\nAction: wait()"]
    )
    seqs = [encode_trajectory(policy, t, spec=PromptSpec("compact", None)) for t in (t1, t2)]
    with torch.no_grad():
        lp, m = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
        for b, s in enumerate(seqs):
            lps, ms = sequence_logprobs(policy.model, collate([s], policy.pad_id, policy.image_token_id))
            n = len(s.input_ids)
            assert torch.equal(m[b, :n], ms[0]) and not m[b, n:].any()
            assert torch.allclose(lp[b, :n][ms[0]], lps[0][ms[0]], atol=1e-5)


def test_mm_token_type_ids_pitfall(policy):
    """docs/method.md §7: dropping mm_token_type_ids silently changes the positions (and the logits)."""
    seq = encode_trajectory(
        policy, trajectory(["Thought: a.\nAction: wait()"]), spec=PromptSpec("compact", None)
    )
    batch = collate([seq], policy.pad_id, policy.image_token_id)
    assert int(batch.mm_token_type_ids.sum()) == 48
    with torch.no_grad():
        with_ids = forward_logits(policy.model, batch)
        batch.mm_token_type_ids = None
        without = policy.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
        ).logits
    after_image = seq.input_ids.index(policy.image_token_id) + 48
    assert (with_ids[0, after_image:] - without[0, after_image:]).abs().max() > 1e-3


def test_sequence_logprobs_equal_naive_full_log_softmax(policy):
    """The masked-position projection gives the same numbers as log_softmax over the full logits."""
    t = trajectory(["Thought: a.\nAction: click(start_box='(5,6)')", "Thought: b.\nAction: wait()"])
    batch = collate(
        [encode_trajectory(policy, t, spec=PromptSpec("compact", None))],
        policy.pad_id,
        policy.image_token_id,
    )
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, batch)
        full = torch.log_softmax(forward_logits(policy.model, batch)[0, :-1].float(), -1)  # (T-1, V)
    naive = full.gather(-1, batch.input_ids[0, 1:, None]).squeeze(-1)  # (T-1,)
    assert int(mask.sum()) > 20
    assert torch.allclose(logps[0, 1:][mask[0, 1:]], naive[mask[0, 1:]], atol=1e-5)
    assert torch.all(logps[~mask] == 0)


def test_context_replies_stay_in_the_sequence_but_out_of_the_mask(policy):
    """A step with train_reply False (a recovery demo's miss) is context: its reply tokens are in the
    sequence, between the screenshots, and the mask covers exactly the other replies."""
    replies = [
        "Thought: I click the box.\nAction: click(start_box='(5,200)')",
        "Thought: I click the box.\nAction: click(start_box='(52,64)')",
        "Thought: done.\nAction: wait()",
    ]
    traj = trajectory(replies)
    traj.steps[0].train_reply = False
    seq = encode_trajectory(policy, traj, spec=PromptSpec("compact", None))
    ids = torch.tensor(seq.input_ids)
    mask = torch.tensor(seq.assistant_mask)
    assert policy.tokenizer.decode(ids[mask]) == "".join(r + "<|im_end|>" for r in replies[1:])
    assert replies[0] + "<|im_end|>" in policy.tokenizer.decode(ids[~mask])
    assert int((ids == policy.image_token_id).sum()) == 3 * 48
    # the same tokens as with every reply trained; only the mask differs, and only at the first reply
    all_trained = encode_trajectory(policy, trajectory(replies), spec=PromptSpec("compact", None))
    assert all_trained.input_ids == seq.input_ids
    n_first = len(policy.tokenizer.encode(replies[0], add_special_tokens=False)) + 1
    assert sum(all_trained.assistant_mask) - sum(seq.assistant_mask) == n_first
    # sampled token ids are masked out the same way
    odd = policy.tokenizer.encode("Th", add_special_tokens=False)
    traj2 = trajectory(["Th", "Th"], [[*odd, policy.im_end_id], odd])
    traj2.steps[0].train_reply = False
    seq2 = encode_trajectory(policy, traj2, spec=PromptSpec("compact", None))
    assert torch.tensor(seq2.input_ids)[torch.tensor(seq2.assistant_mask)].tolist() == odd
