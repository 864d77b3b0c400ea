"""Tiny offline policy: tokenizer, processor and model round trip; sizes; loading a stock-layout checkpoint."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import Qwen2_5_VLForConditionalGeneration

from arpo_core.policy.model import (
    QWEN_SPECIAL_TOKENS,
    SIZES,
    TINY_MAX_PIXELS,
    TINY_MIN_PIXELS,
    Policy,
    PolicyProcessor,
    build_tiny_policy,
    count_parameters,
    default_corpus,
    grow_depth,
    grow_vision_depth,
    load_policy,
    mrope_section,
    resplit_mrope,
    tiny_config,
    train_tokenizer,
    widen_vision,
)
from arpo_core.policy.prompt import PromptInput, PromptSpec
from arpo_core.policy.sequences import collate, encode_prompt, forward_logits

REPLY = "Thought: The OK button is at the bottom.\nAction: click(start_box='(120,195)')"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Policy, str]:
    out = tmp_path_factory.mktemp("tiny_xs")
    return build_tiny_policy(out, size="xs", seed=0), str(out)


def _screen() -> Image.Image:
    im = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(im).rectangle([100, 180, 140, 205], fill=(30, 90, 200))
    return im


@pytest.mark.parametrize(("head_dim", "expected"), [(128, [16, 24, 24]), (32, [4, 6, 6]), (64, [8, 12, 12])])
def test_mrope_section(head_dim, expected):
    assert mrope_section(head_dim) == expected
    assert sum(mrope_section(head_dim)) == head_dim // 2


# Pinned parameter counts (default corpus -> 1,028 tokens, tied embeddings); model.py, decision "Model sizes".
@pytest.mark.parametrize(("size", "params"), [("xs", 741_632), ("s", 5_074_816), ("m", 36_508_928)])
def test_parameter_counts(size, params):
    tok = train_tokenizer(default_corpus(), SIZES[size].vocab)
    assert len(tok) == 1028
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(tiny_config(SIZES[size], tok))
    assert count_parameters(model) == params


def test_tokenizer_specials_and_digits(built):
    policy, _ = built
    tok = policy.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS]
    assert ids == list(range(len(tok) - len(QWEN_SPECIAL_TOKENS), len(tok)))  # appended, in Qwen's order
    for t, i in zip(QWEN_SPECIAL_TOKENS, ids, strict=True):
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    pieces = tok.tokenize("click(start_box='(1234,567)')")
    assert [p for p in pieces if p.isdigit()] == list("1234567")  # digits are single tokens
    text = REPLY + "\nünïcödé ✓ 中文"  # byte-level: anything round-trips, even unseen characters
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_round_trip_build_save_load(built):
    policy, path = built
    loaded = load_policy(path)
    assert isinstance(loaded.processor, PolicyProcessor)
    assert (loaded.min_pixels, loaded.max_pixels) == (policy.min_pixels, policy.max_pixels)
    prompt = PromptInput("Click OK.", (_screen(),))
    a = encode_prompt(policy, prompt, spec=PromptSpec("uitars", None))
    b = encode_prompt(loaded, prompt, spec=PromptSpec("uitars", None))
    assert a.input_ids == b.input_ids
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
    assert a.image_grid_thw.tolist() == [[1, 16, 12]]  # 160x210 -> 168x224 -> 48 visual tokens
    assert a.input_ids.count(policy.image_token_id) == 48
    batch = collate([a], policy.pad_id, policy.image_token_id)
    with torch.no_grad():
        la, lb = forward_logits(policy.model, batch), forward_logits(loaded.model, batch)
    assert torch.equal(la, lb)
    assert la.shape == (1, len(a.input_ids), len(policy.tokenizer))


def test_build_is_deterministic_in_seed(tmp_path):
    torch.manual_seed(123)
    p1 = build_tiny_policy(tmp_path / "a", size="xs", seed=3)
    after_build = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after_build)  # the caller's global RNG is left alone
    p2 = build_tiny_policy(tmp_path / "b", size="xs", seed=3)
    p3 = build_tiny_policy(tmp_path / "c", size="xs", seed=4)
    w = [p.model.lm_head.weight for p in (p1, p2, p3)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    assert p1.tokenizer.get_vocab() == p2.tokenizer.get_vocab()


def test_loads_stock_uitars_layout(built, tmp_path):
    """A checkpoint laid out like UI-TARS-1.5-7B on the Hub (weights in several safetensors shards with
    their index, preprocessor_config.json with min/max_pixels and the stock Qwen2_5_VLProcessor class, no
    processor_config.json) loads with our processor, every weight intact."""
    policy, path = built
    stock = tmp_path / "stock"
    shutil.copytree(path, stock)
    (stock / "processor_config.json").unlink()
    (stock / "model.safetensors").unlink()
    policy.model.save_pretrained(stock, max_shard_size="1MB")  # the 7B's 4 shards, at this model's scale
    shards = sorted(p.name for p in stock.glob("model-*-of-*.safetensors"))
    index = json.loads((stock / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and set(index["weight_map"].values()) == set(shards)
    assert not (stock / "model.safetensors").exists()
    (stock / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 2116800,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
            }
        )
    )
    loaded = load_policy(stock)
    assert (loaded.min_pixels, loaded.max_pixels) == (3136, 2116800)
    big = Image.new("RGB", (1920, 1080), "gray")
    grid = loaded.image_processor(images=[big], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 1092 // 14, 1932 // 14]]  # docs/method.md §2: 1932x1092, 2,691 tokens
    assert int(grid.prod()) // 4 == 2691
    want, got = policy.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    smaller = load_policy(stock, max_pixels=28 * 28 * 100)  # override wins over the stored max_pixels
    assert (smaller.min_pixels, smaller.max_pixels) == (3136, 78400)
    assert int(smaller.image_processor(images=[big], return_tensors="pt")["image_grid_thw"].prod()) <= 400
    tiny_override = load_policy(path, min_pixels=28 * 28 * 100)  # and over the tiny layout's `size`
    assert (tiny_override.min_pixels, tiny_override.max_pixels) == (78400, policy.max_pixels)


def test_load_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_policy(tmp_path)


def test_unknown_size(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny size"):
        build_tiny_policy(tmp_path, size="xl")


def _same_function_saved_and_trainable(policy, grown, saved_to, exact=True):
    """`grown` gives `policy`'s logits on a screenshot prompt (with `exact` false: to float rounding), and so
    does its saved and loaded copy (returned); then one backward through `grown`, for the caller to find its
    new parts' gradients."""
    batch = collate(
        [encode_prompt(policy, PromptInput("Click OK.", (_screen(),)), spec=PromptSpec("uitars", None))],
        policy.pad_id,
        policy.image_token_id,
    )
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert same(forward_logits(policy.model, batch), forward_logits(grown.model, batch))
    grown.save(saved_to)
    again = load_policy(saved_to)
    with torch.no_grad():
        assert same(forward_logits(again.model, batch), forward_logits(policy.model, batch))
    forward_logits(grown.model, batch).logsumexp(-1).sum().backward()
    return again


def test_grow_depth_same_function_then_trainable(built, tmp_path):
    policy, _ = built
    grown = grow_depth(policy, [0, 1])
    assert grown.model.config.text_config.num_hidden_layers == 4
    assert grown.model.generation_config.to_dict() == policy.model.generation_config.to_dict()
    old, new = policy.model.model.language_model.layers, grown.model.model.language_model.layers
    # (a, b) -> (a, new, b, new): old layers copied in place, new ones write nothing to the residual
    assert torch.equal(new[0].mlp.up_proj.weight, old[0].mlp.up_proj.weight)
    assert torch.equal(new[2].self_attn.q_proj.weight, old[1].self_attn.q_proj.weight)
    for i in (1, 3):
        assert not new[i].self_attn.o_proj.weight.any() and not new[i].mlp.down_proj.weight.any()
        assert new[i].self_attn.q_proj.weight.any()  # freshly initialised, not zero
    _same_function_saved_and_trainable(policy, grown, tmp_path / "g")
    assert grown.model.model.language_model.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="must name layers"):
        grow_depth(policy, [2])


def test_grow_vision_depth_same_function_then_trainable(built, tmp_path):
    """A new vision block after block 0: the same logits on a screenshot (its output projections zero),
    the old block copied, the new one attending as the block before it (full here), saved and loaded as a
    stock checkpoint, and trainable."""
    policy, _ = built
    grown = grow_vision_depth(policy, [0])
    vision = grown.model.config.vision_config
    assert vision.depth == 2 and vision.fullatt_block_indexes == [0, 1]
    assert policy.model.config.vision_config.depth == 1  # the original kept
    old, new = policy.model.model.visual.blocks, grown.model.model.visual.blocks
    assert torch.equal(new[0].attn.qkv.weight, old[0].attn.qkv.weight)
    assert not new[1].attn.proj.weight.any() and not new[1].attn.proj.bias.any()
    assert not new[1].mlp.down_proj.weight.any() and not new[1].mlp.down_proj.bias.any()
    assert new[1].attn.qkv.weight.any()  # freshly initialised, not zero
    again = _same_function_saved_and_trainable(policy, grown, tmp_path / "g")
    assert again.model.config.vision_config.depth == 2
    assert grown.model.model.visual.blocks[1].attn.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="must name vision blocks"):
        grow_vision_depth(policy, [1])


def test_widen_vision_same_tokens_then_trainable(built, tmp_path):
    """widen_vision: the tower at twice its width (two more heads of the same size, a wider MLP and merger)
    gives the same logits to rounding (the norms' epsilon), its old channels in place, the new filters and
    every writer into a new channel zero, the new heads' readers fresh; saved and loaded as a stock
    checkpoint; trainable: the new heads' writers get gradients."""
    policy, _ = built
    wide = widen_vision(policy, 128, seed=1)
    vision = wide.model.config.vision_config
    assert (vision.hidden_size, vision.num_heads, vision.intermediate_size) == (128, 4, 256)
    assert policy.model.config.vision_config.hidden_size == 64  # the original kept
    old, new = policy.model.model.visual, wide.model.model.visual
    embed = new.patch_embed.proj.weight
    assert torch.equal(embed[:64], old.patch_embed.proj.weight) and not embed[64:].any()
    was, block = old.blocks[0], new.blocks[0]
    assert torch.equal(block.attn.qkv.weight[128:192, :64], was.attn.qkv.weight[64:128])  # old heads' keys
    assert block.attn.qkv.weight[192:256].any()  # the new heads' keys: fresh
    assert not block.attn.proj.weight[64:].any() and not block.attn.proj.weight[:, 64:].any()
    assert not block.mlp.down_proj.weight[:, 128:].any() and not new.merger.mlp[2].weight[:, 256:].any()
    again = _same_function_saved_and_trainable(policy, wide, tmp_path / "w", exact=False)
    assert again.model.config.vision_config.hidden_size == 128
    assert block.attn.proj.weight.grad[:, 64:].abs().sum() > 0  # the new heads' writers learn
    assert embed.grad[64:].abs().sum() > 0  # and the new filters
    with pytest.raises(ValueError, match="in whole heads of 32"):
        widen_vision(policy, 80)


def test_resplit_mrope_moves_frequencies_between_axes_and_keeps_the_weights(built, tmp_path):
    """resplit_mrope: the same weights under another (t, h, w) split; text alone (t = h = w) computes the
    same function, a screenshot does not; the split is saved and loaded like any config value."""
    policy, _ = built
    before = list(policy.model.config.text_config.rope_parameters["mrope_section"])
    wide = resplit_mrope(policy, [8, 4, 4])
    assert before != [8, 4, 4] and wide.model.config.text_config.rope_parameters["mrope_section"] == [8, 4, 4]
    assert policy.model.config.text_config.rope_parameters["mrope_section"] == before  # the original kept
    old, new = policy.model.state_dict(), wide.model.state_dict()
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    spec = PromptSpec("uitars", None)
    shot = collate(
        [encode_prompt(policy, PromptInput("Click OK.", (_screen(),)), spec=spec)],
        policy.pad_id,
        policy.image_token_id,
    )
    with torch.no_grad():
        a, b = forward_logits(policy.model, shot), forward_logits(wide.model, shot)
    n_text = shot.input_ids[0].tolist().index(policy.image_token_id)  # before the image: text only
    assert torch.equal(a[:, :n_text], b[:, :n_text])
    assert (a[:, n_text:] - b[:, n_text:]).abs().max() > 1e-5  # from it on, rows and columns turn otherwise
    wide.save(tmp_path / "w")
    again = load_policy(tmp_path / "w")
    assert again.model.model.language_model.rotary_emb.mrope_section == [8, 4, 4]
    with torch.no_grad():
        assert torch.equal(forward_logits(again.model, shot), b)
    with pytest.raises(ValueError, match="summing to head_dim / 2 = 16"):
        resplit_mrope(policy, [8, 4, 5])


def test_linear_patch_embed_is_the_conv3d_it_replaces(built):
    """model.py, decision "Linear patch embedding": the patch embedding as a matrix product gives the stock
    Conv3d's output and gradient, keeps the state dict, and survives deepcopy (grow_depth)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    from arpo_core.policy.model import LinearPatchEmbed

    policy, _ = built
    pe = policy.model.model.visual.patch_embed
    assert type(pe) is LinearPatchEmbed
    stock = Qwen2_5_VisionPatchEmbed(pe.patch_size, pe.temporal_patch_size, pe.in_channels, pe.embed_dim)
    stock.load_state_dict(pe.state_dict())
    x = torch.randn(
        37,
        pe.in_channels * pe.temporal_patch_size * pe.patch_size**2,
        generator=torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(pe(x), stock(x), rtol=1e-4, atol=1e-5)
    pe(x).square().sum().backward()
    stock(x).square().sum().backward()
    g = stock.proj.weight.grad  # sums over 37 patches: float32 rounding of another summation order
    torch.testing.assert_close(pe.proj.weight.grad, g, rtol=1e-3, atol=1e-5 * float(g.abs().max()))
    pe.proj.weight.grad = None
    assert set(pe.state_dict()) == {"proj.weight"}
    grown = grow_depth(policy, [0])
    assert type(grown.model.model.visual.patch_embed) is LinearPatchEmbed


@pytest.mark.parametrize(
    ("budget", "sizes"),
    [
        # the tiny budget: MiniWoB's screen (resized 160x210 -> 168x224), an exact fit, odd shapes
        ((TINY_MIN_PIXELS, TINY_MAX_PIXELS), [(160, 210), (168, 224), (50, 30), (333, 777), (28, 28)]),
        # UI-TARS's budget in the reference: a desktop screenshot is scaled to 1932x1092
        ((3136, 2116800), [(1920, 1080), (1280, 720)]),
    ],
)
def test_image_inputs_equal_the_stock_processor(budget, sizes):
    """model.py, decision "Array image inputs": the direct computation is the stock processor's, bit for bit
    (RGB and RGBA inputs, several images in one call), and a processor configured otherwise takes the stock
    call."""
    from transformers import Qwen2VLImageProcessorPil

    from arpo_core.policy.model import image_inputs

    rng = np.random.default_rng(0)
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": budget[0], "longest_edge": budget[1]})
    for w, h in sizes:
        images = [
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA"),
        ]
        stock = proc(images=[im.convert("RGB") for im in images], return_tensors="pt")
        pixels, grid = image_inputs(proc, images)
        assert torch.equal(grid, stock["image_grid_thw"]), (w, h)
        assert pixels.dtype == stock["pixel_values"].dtype and torch.equal(pixels, stock["pixel_values"]), (
            w,
            h,
        )
    other = Qwen2VLImageProcessorPil(
        size={"shortest_edge": budget[0], "longest_edge": budget[1]}, do_normalize=False
    )
    im = Image.fromarray(rng.integers(0, 256, (210, 160, 3), dtype=np.uint8))
    assert torch.equal(image_inputs(other, [im])[0], other(images=[im], return_tensors="pt")["pixel_values"])
