"""benchmarks/gpu_bench.py without a GPU: the 7B-shape config (parameter count on the meta device), the
model dir it writes for vLLM, the synthetic training batch, argument parsing, the vLLM import guard and,
at a tiny shape on CPU, the DeepSpeed ZeRO-2/3 step end to end into the results file."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench as gb  # noqa: E402


def test_7b_shape_has_qwen25vl_7b_parameter_count():
    n = gb.count_params(gb.qwen25vl_config(gb.QWEN25VL_7B))
    # Qwen2.5-VL-7B-Instruct: 8,292,166,656 parameters (675.6M vision incl. merger, untied LM head).
    assert n["total"] == 8_292_166_656
    assert n["vision"] == 676_550_144
    assert n["language"] == n["total"] - n["vision"]


def test_config_checks_rope_split_and_token_keys():
    bad = gb.Shape(**{**gb.TINY.__dict__, "mrope_section": (2, 3, 4)})  # head_dim 16 needs sum 8
    with pytest.raises(ValueError, match="mrope_section"):
        gb.qwen25vl_config(bad)
    with pytest.raises(ValueError, match="keys"):
        gb.qwen25vl_config(gb.TINY, {"image_token_id": 5})
    c = gb.qwen25vl_config(gb.QWEN25VL_7B)
    assert c["rope_scaling"] == {"type": "mrope", "mrope_section": [16, 24, 24]}
    assert c["image_token_id"] == 151655 and c["vision_config"]["out_hidden_size"] == 3584


@pytest.mark.parametrize(
    ("size", "tokens"),
    [
        ((160, 210), 48),  # 168x224 after smart_resize: 6 x 8 merged patches
        ((1920, 1080), 2691),  # 1932x1092: 69 x 39
        # 8.3 MP > max_pixels: scaled by sqrt(8294400/2116800) = 1.98 and floored to 28: 1932x1064, 69 x 38
        ((3840, 2160), 2622),
    ],
)
def test_image_tokens(size, tokens):
    assert gb.image_tokens(*size) == tokens


def test_train_batch_layout():
    cfg = gb.qwen25vl_config(gb.TINY, {k: 2000 + i for i, k in enumerate(gb.TOKEN_KEYS)})
    b = gb.make_train_batch(cfg, 56, 56, text_tokens=5)
    # 56x56 -> 4x4 patches of 14 px -> 16 patch rows, 4 LM image tokens after the 2x2 merge.
    assert b["pixel_values"].shape == (16, 1176)
    assert b["image_grid_thw"].tolist() == [[1, 4, 4]]
    ids = b["input_ids"][0].tolist()
    assert len(ids) == 1 + 4 + 1 + 5
    assert ids[0] == cfg["vision_start_token_id"] and ids[5] == cfg["vision_end_token_id"]
    assert ids[1:5] == [cfg["image_token_id"]] * 4
    assert all(0 <= t < 2000 for t in ids[6:])  # text ids below every special id
    assert b["labels"][0, :6].tolist() == [-100] * 6 and b["labels"][0, 6:].tolist() == ids[6:]


def test_parse_args():
    a = gb.parse_args(["--tiny"])
    assert a.parts == ["config", "zero2", "zero3"]  # no vLLM at the tiny shape
    assert gb.parse_args([]).parts == ["config", "vllm", "zero2", "zero3"]
    with pytest.raises(SystemExit):
        gb.parse_args(["--parts", "config,zero4"])
    assert sum(gb.PART_TIMEOUT_S.values()) < 8 * 60


def test_prepare_model_dir_is_consistent(tmp_path):
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    cfg = gb.prepare_model_dir(tmp_path, gb.QWEN25VL_7B)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert cfg["vocab_size"] == 152064 and cfg["hidden_size"] == 3584
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for key, token in gb.TOKEN_KEYS.items():
        assert tok.convert_tokens_to_ids(token) == cfg[key], key
    prompt_ids = tok(gb.user_prompt(3))["input_ids"]
    assert prompt_ids.count(cfg["image_token_id"]) == 1  # one placeholder; vLLM expands it
    ip = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    out = ip(images=[Image.new("RGB", (1920, 1080))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 78, 138]]  # 1092/14, 1932/14
    assert int(out["image_grid_thw"].prod()) // 4 == gb.image_tokens(1920, 1080)


def test_vllm_part_without_vllm_reports_an_error(tmp_path):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.fail("vLLM is installed in the CPU env; it belongs in .venv-gpu (scripts/setup_gpu.sh)")
    gb.prepare_model_dir(tmp_path / "m", gb.TINY)
    args = gb.parse_args(["--model-dir", str(tmp_path / "m"), "--parts", "vllm"])
    res = gb.spawn_part("vllm", args, ["--model-dir", str(tmp_path / "m")], timeout_s=120)
    assert res["error"] == "exit 1" and "vllm" in res["stderr_tail"]


@pytest.mark.slow
def test_tiny_cpu_run_writes_results(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--tiny", "--parts", "config,zero2,zero3", "--model-dir", str(tmp_path / "m"), "--out", str(out)]
    gb.main([*argv, "--train-steps", "2"])
    rec = json.loads(out.read_text())
    assert rec["shape"] == "tiny" and rec["command"].endswith("--train-steps 2")
    n = rec["results"]["config"]["params"]["total"]
    assert n == gb.count_params(json.loads((tmp_path / "m" / "config.json").read_text()))["total"]
    for stage in (2, 3):
        r = rec["results"][f"zero{stage}"]
        assert "error" not in r, r
        assert r["zero_stage"] == stage and r["trainable_params"] == n
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
        # ln(vocab) at init; a step at lr 1e-6 barely moves it.
        assert abs(r["losses"][0] - math.log(gb.TINY.vocab)) < 0.5
        assert r["seq_len"] == 1 + 4 + 1 + 16 and r["step_s_median"] > 0
