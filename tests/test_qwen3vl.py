"""Qwen3-VL policies (docs/models.md): a tiny Qwen3-VL built offline from a stock Qwen3VLConfig and saved in
the Hub's sharded layout loads, generates with exact log-probs (M-RoPE positions from its own
`get_rope_index`, the lean decoder or the stock path), trains every parameter, and saves and reloads
with identical logits. One tiny model for the whole module."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import Qwen3VLForConditionalGeneration

from arpo_core.infra.errors import InputError
from arpo_core.policy.generate import HFGenerator, named_weights
from arpo_core.policy.model import (
    SIZES,
    TINY_SHARD_SIZE,
    Policy,
    Qwen3LinearPatchEmbed,
    Qwen3PolicyProcessor,
    build_tiny_policy,
    checkpoint_family,
    count_parameters,
    grow_depth,
    grow_vision_depth,
    grown_prefixes,
    image_inputs,
    load_policy,
    mrope_section_qwen3,
    tiny_config,
    tiny_image_processor,
    train_tokenizer,
    widen_vision,
)
from arpo_core.policy.prompt import PromptInput, PromptSpec, Reply
from arpo_core.policy.sequences import (
    collate,
    encode_prompt,
    encode_trajectory,
    forward_logits,
    sequence_logprobs,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes

SYSTEM = "qwen3vl_compact"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Policy, object]:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    policy = build_tiny_policy(
        path, size="xs", seed=0, rope_theta=5.0, family="qwen3_vl", max_shard_size=TINY_SHARD_SIZE
    )
    return policy, path


@pytest.fixture(scope="module")
def policy(built) -> Policy:
    return load_policy(built[1])


def screen(i: int) -> Image.Image:
    im = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(im).rectangle([10 + 25 * i, 30 + 15 * i, 40 + 25 * i, 50 + 15 * i], fill=(200, 40 * i, 60))
    return im


def prompts() -> list[PromptInput]:
    """Three prompts with 1, 2 and 3 screenshots (different lengths: real left padding)."""
    return [
        PromptInput("Click the red box.", (screen(0),)),
        PromptInput(
            "Type hello.", (screen(1), screen(2)), (Reply("Action: wait.\n<tool_call>\n{}\n</tool_call>"),)
        ),
        PromptInput(
            "Scroll down.", (screen(3), screen(4), screen(5)), (Reply("Action: a"), Reply("Action: b"))
        ),
    ]


# --------------------------------------------------------------------------------------------------
# Loading


def test_tiny_qwen3_is_a_sharded_hub_checkpoint_that_reloads(built, policy):
    built_policy, path = built
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and set(index["weight_map"].values()) == set(shards)
    assert not (path / "model.safetensors").exists()
    assert any(k.startswith("model.language_model.") for k in index["weight_map"])  # Qwen3-VL's names
    assert (
        json.loads((path / "config.json").read_text())["model_type"] == "qwen3_vl" == checkpoint_family(path)
    )
    assert (
        type(policy.model) is Qwen3VLForConditionalGeneration
        and type(policy.processor) is Qwen3PolicyProcessor
    )
    assert policy.family == "qwen3_vl" and policy.patch_factor == 32
    ip = policy.image_processor
    assert (ip.patch_size, ip.merge_size, tuple(ip.image_mean)) == (16, 2, (0.5, 0.5, 0.5))
    want, got = built_policy.model.state_dict(), policy.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    text = policy.model.config.text_config
    assert text.rope_parameters["mrope_section"] == mrope_section_qwen3(32) == [6, 5, 5]
    assert (text.head_dim, policy.model.config.vision_config.deepstack_visual_indexes) == (32, [0])
    # the reply grammar's markup survives decoding without special tokens; Qwen's chat markup does not
    ids = policy.tokenizer.encode(
        "Action: a\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False
    )
    assert (
        policy.tokenizer.decode(ids, skip_special_tokens=True) == "Action: a\n<tool_call>\n{}\n</tool_call>"
    )
    assert count_parameters(policy.model) == 891_776


def test_loads_the_stock_qwen3vl_layout(built, tmp_path):
    """A checkpoint laid out like Qwen3-VL / GUI-Owl-1.5 on the Hub (shards, preprocessor_config.json with
    the stock Qwen3-VL image settings and the Qwen3VLProcessor class, no processor_config.json) loads with
    our processor; min/max_pixels override its budget; a 1920x1080 screen becomes 32-pixel tokens."""
    _, path = built
    stock = tmp_path / "stock"
    shutil.copytree(path, stock)
    (stock / "processor_config.json").unlink()
    (stock / "preprocessor_config.json").write_text(
        json.dumps(
            {  # Qwen3-VL's published preprocessor_config.json
                "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast",
            }
        )
    )
    loaded = load_policy(stock, max_pixels=2116800)
    assert (loaded.min_pixels, loaded.max_pixels, loaded.patch_factor) == (65536, 2116800, 32)
    grid = image_inputs(loaded.image_processor, [Image.new("RGB", (1920, 1080), "gray")])[1]
    assert grid.tolist() == [[1, 1088 // 16, 1920 // 16]]  # smart_resize(1080, 1920, factor=32)


def test_unsupported_model_type_is_one_line(built, tmp_path):
    bad = tmp_path / "llava"
    shutil.copytree(built[1], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(InputError) as err:
        load_policy(bad)
    msg = str(err.value)
    assert "\n" not in msg and "'llava' is not supported" in msg
    assert "qwen2_5_vl" in msg and "qwen3_vl" in msg and str(bad) in msg


def test_a_missing_shard_is_one_line(built, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(built[1], partial)
    gone = sorted(partial.glob("model-*-of-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(InputError, match=f"shard.*missing: {gone.name}") as err:
        load_policy(partial)
    assert "\n" not in str(err.value)


def test_linear_patch_embed_with_bias_is_the_conv3d(policy):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    pe = policy.model.model.visual.patch_embed
    assert type(pe) is Qwen3LinearPatchEmbed and pe.proj.bias is not None
    stock = Qwen3VLVisionPatchEmbed(policy.model.config.vision_config)
    stock.load_state_dict(pe.state_dict())
    x = torch.randn(11, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pe(x), stock(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sizes", [[(160, 210), (50, 30), (333, 777)], [(1920, 1080)]])
def test_image_inputs_equal_the_stock_processor_at_patch_16(sizes):
    """model.py, decision "Array image inputs" holds for Qwen3-VL's settings (patch 16, mean/std 0.5), bit for bit."""
    rng = np.random.default_rng(0)
    proc = tiny_image_processor("qwen3_vl", 3136, 2116800)
    for w, h in sizes:
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))]
        stock = proc(images=images, return_tensors="pt")
        pixels, grid = image_inputs(proc, images)
        assert torch.equal(grid, stock["image_grid_thw"]) and torch.equal(pixels, stock["pixel_values"])


def test_the_interleaved_mrope_split_is_checked():
    tok = train_tokenizer(["Click OK. Action: wait()"] * 20, 300)
    assert mrope_section_qwen3(128) == [24, 20, 20]
    cfg = tiny_config(SIZES["xs"], tok, mrope=[6, 5, 5], family="qwen3_vl")
    assert cfg.text_config.rope_parameters["mrope_section"] == [6, 5, 5]
    with pytest.raises(ValueError, match="interleaves the axes, so h <= 5 and w <= 5"):
        tiny_config(SIZES["xs"], tok, mrope=[2, 7, 7], family="qwen3_vl")  # the Qwen2.5-VL recipe's split
    with pytest.raises(ValueError, match="unknown model family"):
        tiny_config(SIZES["xs"], tok, family="llava")


def test_grow_depth_keeps_the_function(policy):
    grown = grow_depth(policy, [1])
    batch = collate(
        [encode_prompt(policy, prompts()[1], spec=PromptSpec(SYSTEM, None))],
        policy.pad_id,
        policy.image_token_id,
    )
    assert type(grown.model) is Qwen3VLForConditionalGeneration
    assert grown_prefixes(grown, [1]) == ["model.language_model.layers.2."]  # (a, b) -> (a, b, new)
    assert not grown.model.model.language_model.layers[2].mlp.down_proj.weight.any()
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(grown.model, batch), forward_logits(policy.model, batch))


def test_widen_vision_refuses_a_layernorm_tower(policy):
    with pytest.raises(ValueError, match=r"only Qwen2\.5-VL towers .* this is .qwen3_vl."):
        widen_vision(policy, 128)


def test_grow_vision_depth_keeps_the_function_and_the_deepstack_taps(policy):
    """A new vision block before the tower's DeepStack tap moves the tap to the old block's new place, so the
    language model gets the same features (Qwen3-VL adds them after its first layers)."""
    from arpo_core.policy.model import Policy

    two = grow_vision_depth(policy, [0])  # two blocks, the tap still after block 0
    assert two.model.config.vision_config.depth == policy.model.config.vision_config.depth + 1 == 2
    assert two.model.config.vision_config.deepstack_visual_indexes == [0]
    assert not two.model.model.visual.blocks[1].mlp.linear_fc2.weight.any()
    config = two.model.config.__class__.from_dict(two.model.config.to_dict())
    config.vision_config.deepstack_visual_indexes = [1]  # a tower tapped after its second block
    model = type(two.model)(config)
    model.load_state_dict(two.model.state_dict())
    late = Policy(model=model.eval(), processor=policy.processor, tokenizer=policy.tokenizer)
    grown = grow_vision_depth(late, [0])  # a block before the tap: it moves to the old block's new place
    assert grown.model.config.vision_config.deepstack_visual_indexes == [2]
    assert grown_prefixes(grown, vision_after=[0]) == ["model.visual.blocks.1."]
    assert not grown.model.model.visual.blocks[1].mlp.linear_fc2.weight.any()
    batch = collate(
        [encode_prompt(policy, prompts()[1], spec=PromptSpec(SYSTEM, None))],
        policy.pad_id,
        policy.image_token_id,
    )
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(two.model, batch), forward_logits(policy.model, batch))
        torch.testing.assert_close(forward_logits(grown.model, batch), forward_logits(late.model, batch))


# --------------------------------------------------------------------------------------------------
# Positions and exact log-probs


def _rollout(
    gen: HFGenerator, n_steps: list[int], temperature=1.0
) -> tuple[list[Trajectory], list[list[float]]]:
    """Multi-turn episodes, one generate call per step for all episodes (a batch with left padding)."""
    instructions = ["Click the red box.", "Enter the text.", "Select alpha."][: len(n_steps)]
    shots = [[] for _ in n_steps]
    replies = [[] for _ in n_steps]
    logps = [[] for _ in n_steps]
    for k in range(max(n_steps)):
        live = [e for e, n in enumerate(n_steps) if k < n]
        for e in live:
            shots[e].append(screen(k + e))
        batch = [PromptInput(instructions[e], tuple(shots[e]), tuple(replies[e])) for e in live]
        gens = gen.generate(
            batch, temperature=temperature, top_p=1.0, max_new_tokens=24, seeds=[100 * e + k for e in live]
        )
        for e, g in zip(live, gens, strict=True):
            replies[e].append(Reply(g.text, g.token_ids))
            logps[e] += list(g.logprobs)
    trajs = [
        Trajectory(
            "r", "t", 0, "miniwob", "t", instructions[e],
            [Step(i, png_bytes(s), 160, 210, r.text, response_token_ids=list(r.token_ids)) for i, (s, r) in enumerate(zip(shots[e], replies[e], strict=True))],
        )
        for e in range(len(n_steps))
    ]  # fmt: skip
    return trajs, logps


def _max_gap(policy: Policy, trajs, gen_logps) -> float:
    seqs = [encode_trajectory(policy, t, spec=PromptSpec(SYSTEM, None)) for t in trajs]
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
    gap = 0.0
    for b in range(len(trajs)):
        rec = logps[b][mask[b]]
        assert rec.shape[0] == len(gen_logps[b])
        gap = max(gap, float((rec - torch.tensor(gen_logps[b])).abs().max()))
    return gap


@pytest.mark.parametrize("lean", [True, False])
def test_generation_logprobs_match_the_training_forward(policy, lean):
    """The behaviour log-probs of sampled multi-turn episodes (2-3 screenshots, batched, left-padded, the
    shared prompt head on the lean path) equal the right-padded training forward's, token for token."""
    gen = HFGenerator(policy, spec=PromptSpec(SYSTEM, None))
    gen.lean_decode = lean
    assert gen.use_lean_decoder(policy.model) is lean
    trajs, gen_logps = _rollout(gen, [2, 3, 3])
    gap = _max_gap(policy, trajs, gen_logps)
    print(f"max |gen logp - train logp| (Qwen3-VL, lean={lean}): {gap:.2e}")
    assert gap < 1e-4


def test_positions_are_the_models_own_and_a_wrong_build_is_caught(policy, monkeypatch):
    """Qwen3-VL's 3-D (interleaved) M-RoPE positions come from its own get_rope_index, given
    mm_token_type_ids: (a) without them a multimodal forward is refused (Qwen2.5-VL silently used 1-D
    positions, docs/method.md §7); (b) 1-D positions change the logits after the image; (c) a generator
    that builds its prompt positions wrongly fails the log-prob check above by orders of magnitude."""
    seq = encode_prompt(policy, prompts()[0], spec=PromptSpec(SYSTEM, None))
    batch = collate([seq], policy.pad_id, policy.image_token_id)
    n_img = int(batch.mm_token_type_ids.sum())
    assert n_img == (224 // 32) * (160 // 32)  # 160x210 -> 160x224 at factor 32: 7 x 5 tokens
    kw = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
    )
    with torch.no_grad():
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            policy.model(**kw)
        right = forward_logits(policy.model, batch)
        flat = torch.arange(batch.input_ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        wrong = policy.model(**kw, mm_token_type_ids=batch.mm_token_type_ids, position_ids=flat).logits
    after = seq.input_ids.index(policy.image_token_id) + n_img
    assert (right[0, after:] - wrong[0, after:]).abs().max() > 1e-3

    def one_d(input_ids, attention_mask=None, **_):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        return pos, None

    monkeypatch.setattr(policy.model.model, "get_rope_index", one_d)  # the generator's prefill only
    trajs, gen_logps = _rollout(HFGenerator(policy, spec=PromptSpec(SYSTEM, None)), [2])
    monkeypatch.undo()
    assert _max_gap(policy, trajs, gen_logps) > 1e-3


def test_lean_decoder_equals_the_stock_forward_and_applies_only_where_it_should(policy):
    from arpo_core.policy.decode import LeanDecoder

    lean = HFGenerator(policy, spec=PromptSpec(SYSTEM, None))
    stock = HFGenerator(policy, spec=PromptSpec(SYSTEM, None))
    stock.lean_decode = False
    calls = []
    orig = LeanDecoder.step

    def counted(self, ids):
        calls.append(ids.shape[0])
        return orig(self, ids)

    LeanDecoder.step = counted
    try:
        for temperature in (0.0, 1.0):
            kw = {"temperature": temperature, "top_p": 1.0, "max_new_tokens": 30, "seeds": [3, 4, 5]}
            a = stock.generate(prompts(), **kw)
            n = len(calls)
            b = lean.generate(prompts(), **kw)
            assert len(calls) > n  # the lean path ran
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids and x.text == y.text
                torch.testing.assert_close(
                    torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=1e-5
                )
    finally:
        LeanDecoder.step = orig
    model = policy.model
    assert LeanDecoder.supports(model)
    cfg = model.model.language_model.config
    impl = cfg._attn_implementation
    try:
        cfg._attn_implementation = "flash_attention_2"
        assert not LeanDecoder.supports(model) and not lean.use_lean_decoder(model)
    finally:
        cfg._attn_implementation = impl
    layer = model.model.language_model.layers[0].self_attn
    cls = type(layer.q_norm)
    try:
        layer.q_norm.__class__ = type("PatchedNorm", (cls,), {})  # a patched layer: the stock forward
        assert not LeanDecoder.supports(model)
    finally:
        layer.q_norm.__class__ = cls


def test_vllm_gets_qwen3_checkpoint_names(policy):
    """generate.py, decision "Checkpoint names for vLLM": Qwen3-VL checkpoints keep the parameter names."""
    names = [n for n, _ in named_weights(policy.model)]
    assert names == [n for n, _ in policy.model.named_parameters()]
    assert any(n.startswith("model.visual.") for n in names)


# --------------------------------------------------------------------------------------------------
# Training, saving, reloading


def test_updates_train_every_parameter_then_save_and_reload_give_identical_logits(built, tmp_path):
    from arpo_core.algorithm.engines import TorchEngine
    from arpo_core.algorithm.update import compute_logps, encode_trajectories, ppo_update
    from arpo_core.config import TrainConfig

    policy = load_policy(built[1])
    good = 'Action: Click the box.\n<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [280, 260]}}\n</tool_call>'
    bad = 'Action: Click elsewhere.\n<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [900, 950]}}\n</tool_call>'

    def traj(reply: str, i: int) -> Trajectory:
        return Trajectory(
            "r",
            "train",
            0,
            "miniwob",
            "t",
            "Click the box.",
            [Step(0, png_bytes(screen(1)), 160, 210, reply)],
            sample_idx=i,
        )

    seqs = encode_trajectories(policy, [traj(good, 0), traj(bad, 1)], spec=PromptSpec(SYSTEM, None))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    def reply_logp():
        lps = compute_logps(policy, seqs, micro_batch_size=2, bf16=False)
        return [float(lp[torch.tensor(s.assistant_mask)].sum()) for lp, s in zip(lps, seqs, strict=True)]

    start = reply_logp()
    engine = TorchEngine(policy.model, lr=3e-3, weight_decay=0.0, max_grad_norm=1.0)
    cfg = TrainConfig(micro_batch_size=2, mini_batch_size=2)
    for _ in range(3):
        ppo_update(policy, engine, seqs, torch.tensor([1.0, -1.0]), cfg, seed=0)
    end = reply_logp()
    unchanged = [n for n, p in policy.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []
    assert end[0] > start[0] and end[1] < start[1], (start, end)

    policy.model.eval()
    policy.save(tmp_path / "trained")
    again = load_policy(tmp_path / "trained")
    batch = collate(seqs, policy.pad_id, policy.image_token_id)
    with torch.no_grad():
        assert torch.equal(forward_logits(policy.model, batch), forward_logits(again.model, batch))
