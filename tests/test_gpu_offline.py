"""benchmarks/gpu_offline.py and its scripts without a GPU: the dry run (the same generator, update and
engines at a tiny shape on CPU) into its JSON, on a simulated node whose Python holds only the node's
packages and the carried wheels; the carry folder's pins and commands; the time budget; the subprocess
parts' failures and time limits; the gradient-checkpointing switch (model.py) and the torch-AdamW option
of the DeepSpeed engine (engines.py) that the check relies on. What stays untested: docs/scale-out.md,
"Offline GPU check"."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distribution, requires, version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_offline as go  # noqa: E402

ALLOWED_NODE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}


def dry_settings() -> go.Settings:
    return go.settings_of(go.parse_args(["--dry-run"]))


# ---------------------------------------------------------------------------------------- settings, budget
def test_parse_args_parts_and_budget():
    a = go.parse_args([])
    assert a.parts == ["gen", "zero3", "zero3-fv", "zero2", "fused_adam", "torch"]
    assert a.out == ROOT / "benchmarks" / "results" / "gpu.json"
    assert a.batches == [8, 32, 128] and a.shots == [1, 15] and a.gen_tokens == 32
    assert go.parse_args(["--dry-run"]).out.name == "gpu_dry_run.json"  # never the real results file
    with pytest.raises(SystemExit):
        go.parse_args(["--parts", "gen,zero4"])
    # the shell script gives 460 s less the install to a run that must end within 8 minutes
    assert a.budget_s <= 460 < 8 * 60
    text = (ROOT / "scripts" / "gpu_check_offline.sh").read_text()
    assert "BUDGET_S:-460" in text
    for p in go.PARTS.values():
        assert 0 < p.min_s <= p.limit_s
    s = go.settings_of(a)
    assert s.cuda and s.max_pixels == 2_116_800 and s.ds_optimizer == "torch" and s.checkpointing and s.bf16
    # the numbers docs/scale-out.md gives: 2691 image tokens per 1080p screenshot, 1125 in the fallback
    assert go.gb.image_tokens(*go.SCREEN, max_pixels=s.max_pixels) == 2691
    assert go.gb.image_tokens(*go.SCREEN, max_pixels=s.fallback_max_pixels) == 1125


def test_budget_skips_parts_that_do_not_fit(tmp_path):
    """Without the time a part needs, nothing is started: every part is recorded as skipped."""
    out = tmp_path / "gpu.json"
    rec = go.main(["--budget-s", "20", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))
    assert list(rec["parts"]) == list(go.PARTS)
    for name, res in rec["parts"].items():
        assert res["skipped"].startswith("time budget:"), name
    assert rec["machine"]["transformers"] == version("transformers")


def test_spawn_records_a_crash_and_a_time_limit():
    crash = go.spawn("torch", ["--dry-run", "--batches", "x"], limit_s=120)
    assert crash["ended"] == "exit 2" and "invalid int value" in crash["log_tail"]
    slow = go.spawn("gen", ["--dry-run"], limit_s=1)
    assert slow["ended"] == "timed out after 1 s" and slow["wall_s"] < 30
    assert "batch_2" not in slow


# ---------------------------------------------------------------------------------------- carry folder
def test_prepare_dry_run_names_every_carried_wheel_at_this_venvs_version():
    res = subprocess.run(
        ["bash", "scripts/gpu_check_prepare.sh", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    runs = [line for line in res.stdout.splitlines() if "would run:" in line]
    assert [r.split()[-1] for r in runs] == [f"{d}=={version(d)}" for d in go.CARRIED]
    for r in runs:
        if "deepspeed==" in r:
            assert "DS_BUILD_OPS=0" in r and "pip wheel" in r and "--no-deps" in r
        else:
            assert "pip download" in r and "--no-deps --only-binary=:all: --python-version 3.12" in r
    assert "transformers==5.24.0" in res.stdout  # the node's 5.17 lacks generate.py's cache= API


def test_carried_packages_need_only_the_node_and_each_other():
    """Each carried wheel's requirements (for the node's Python 3.12 on Linux) are on the node or carried,
    so `pip install --no-deps` there leaves nothing out."""
    have = {go.normalise(n) for n in go.NODE_PACKAGES} | {go.normalise(n) for n in go.CARRIED}
    for dist in go.CARRIED:
        for line in requires(dist) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**ALLOWED_NODE_ENV, "extra": ""}):
                continue
            assert go.normalise(req.name) in have, f"{dist} needs {req.name}, neither on the node nor carried"


# ---------------------------------------------------------------------------------------- project switches
def _update_once(checkpointing: bool):
    from arpo_core.algorithm.engines import TorchEngine
    from arpo_core.algorithm.update import encode_trajectories, ppo_update
    from arpo_core.config import OptimizerConfig, TrainConfig
    from arpo_core.policy.prompt import PromptSpec

    policy = go.build_policy(dry_settings(), torch.float32)
    policy.set_gradient_checkpointing(checkpointing)
    calls = []
    # a module inside the checkpointed block: the recompute enters it again (a pre-hook: torch's
    # non-reentrant recompute stops as soon as it has the last tensor the backward needs)
    policy.model.model.language_model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    seqs = encode_trajectories(policy, [go.trajectory(2)], spec=PromptSpec(go.SYSTEM, None))
    cfg = TrainConfig(optimizer=OptimizerConfig(lr=1e-2), micro_batch_size=1, mini_batch_size=1, ppo_epochs=1)
    stats = ppo_update(
        policy,
        TorchEngine(policy.model, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
        seqs,
        torch.tensor([1.0]),
        cfg,
        seed=0,
    )
    return policy, stats, len(calls)


def test_gradient_checkpointing_recomputes_and_gives_the_same_step():
    torch.set_num_threads(1)
    plain, s0, calls0 = _update_once(False)
    ckpt, s1, calls1 = _update_once(True)
    assert ckpt.gradient_checkpointing and not plain.gradient_checkpointing
    assert (calls0, calls1) == (1, 2)  # the backward ran the layer's forward again
    assert s1.loss == s0.loss and s1.grad_norm == pytest.approx(s0.grad_norm, rel=1e-5)
    for (n, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    ckpt.set_gradient_checkpointing(False)
    assert not ckpt.gradient_checkpointing


@pytest.mark.slow
def test_deepspeed_torch_adamw_option_on_cuda_takes_the_fused_torch_optimizer(monkeypatch):
    """engines.py, decision "Torch AdamW option": where CUDA is, the switch hands DeepSpeed torch's fused AdamW
    instead of asking for DeepSpeed's FusedAdam; the steps equal the torch engine's. (CUDA is pretended:
    DeepSpeed's own accelerator stays the CPU one, and torch's fused AdamW runs on CPU too.)"""
    from arpo_core.algorithm.engines import DeepSpeedEngine, TorchEngine

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def train(engine):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 8, generator=gen)
            engine.backward(((engine.module(x) - x.sum(-1, keepdim=True).sin()) ** 2).mean())
            engine.step()
        return [p.detach().clone() for p in engine.model.parameters()]

    DeepSpeedEngine(
        model(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, zero_stage=2
    )  # the process group, on gloo, before CUDA is pretended
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = DeepSpeedEngine(
        model(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, zero_stage=2, torch_adamw=True
    )
    inner = eng.optimizer.optimizer
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
    got = train(eng)
    monkeypatch.undo()
    want = train(TorchEngine(model(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0))
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- the dry run
def check_gen(res: dict, s: go.Settings) -> None:
    assert res["ended"] == "ok", res
    assert res["model"]["lean_decoder"] is True and res["model"]["params"] > 0
    for b in s.batches:
        r = res[f"batch_{b}"]
        assert r["new_tokens"] == b * s.gen_tokens and r["all_rows_full_length"]
        # 1920x1080 under 12,544 pixels: 140x84, 5 x 3 merged patches
        assert r["image_tokens_per_screenshot"] == 15 and r["max_pixels"] == go.DRY_MAX_PIXELS
        assert r["gen_tokens_per_s"] > 0
        assert set(r["time_s"]) == {"encode", "vision", "lm_forward", "rest"}
        assert sum(r["time_s"].values()) == pytest.approx(r["wall_s"], abs=0.01)


def check_update(res: dict, s: go.Settings, engine: str, stage: int | None) -> None:
    assert res["ended"] == "ok", res
    e = res["engine"]
    assert (e["engine"], e["zero_stage"], e["optimizer"]) == (engine, stage, "AdamW")
    assert e["gradient_checkpointing"] is True and e["trainable_params"] == e["params"]
    tokens = []
    for n in s.shots:
        r = res[f"shots_{n}"]
        assert r["screenshots"] == n and r["sequences"] == 1 and r["image_tokens"] == 15 * n
        assert len(r["runs_s"]) == 2 and "oom" not in r
        # on-policy (ratio 1), advantage 1, token-mean: the loss is exactly -1
        assert r["loss"] == -1.0 and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        tokens.append(r["tokens"])
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_dry_run_generation_and_torch_update_in_process(tmp_path):
    out = tmp_path / "dry.json"
    rec = go.main(["--dry-run", "--in-process", "--parts", "gen,torch", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec)) and rec["dry_run"] is True
    s = dry_settings()
    check_gen(rec["parts"]["gen"], s)
    check_update(rec["parts"]["torch"], s, "torch", None)


def node_site() -> tuple[Path, set[str]]:
    """A site folder of links to what the GPU node would have: the node's packages installed here, with
    what they need (the node's image holds its packages' requirements), and the carried ones (gpu_offline.py,
    decision "Carried packages"). Always at the same path: DeepSpeed's CPU backend compiles a
    shared-memory op (minutes here) keyed on torch's include paths, and a fixed path keeps that build
    reusable."""
    todo = [go.normalise(n) for n in go.NODE_PACKAGES] + list(go.CARRIED)
    allowed: set[str] = set()
    while todo:
        name = go.normalise(todo.pop())
        if name in allowed:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        allowed.add(name)
        if name in {go.normalise(c) for c in go.CARRIED}:
            continue  # carried: its requirements must be on the node or carried (checked above)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    site = Path(tempfile.gettempdir()) / "arpo-node-site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir()
    for name in allowed:
        dist = distribution(name)
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            if top.endswith(".pth") or top in ("bin", "__pycache__") or (site / top).exists():
                continue
            if (base / top).exists():
                (site / top).symlink_to(base / top)
    return site, allowed


@pytest.mark.slow
def test_dry_run_on_a_simulated_node_runs_every_part(tmp_path):
    """The whole dry run in one process (DeepSpeed on gloo) under `python -S` with only the node's packages
    and the carried ones on its path: the check imports nothing else."""
    site, allowed = node_site()
    assert {"torch", "numpy", "pillow", "pyarrow", "deepspeed", "transformers"} <= allowed
    assert not {"mlflow", "prefect", "dvc", "ray", "selenium", "miniwob"} & allowed  # not on the node
    out = tmp_path / "dry.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # ninja, for that build
        # its own build folder beside the venv's (jit_builds.py): the two builds would replace each other
        "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch-extensions-node-site"),
    }
    cmd = [sys.executable, "-S", "benchmarks/gpu_offline.py", "--dry-run", "--in-process", "--report-imports"]
    res = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads(out.read_text())
    s = dry_settings()
    parts = rec["parts"]
    check_gen(parts["gen"], s)
    check_update(parts["zero3"], s, "deepspeed", 3)
    check_update(parts["zero2"], s, "deepspeed", 2)
    check_update(parts["torch"], s, "torch", None)
    assert parts["zero3-fv"] == {"skipped": "zero3's largest trajectory fitted"}
    assert parts["fused_adam"]["skipped"].startswith("no CUDA")
    # the same steps on every engine: the loss and, up to bf16 rounding (DeepSpeed trains bf16 weights,
    # the torch engine fp32 ones under bf16 autocast), the gradient norm
    for n in s.shots:
        norms = [parts[p][f"shots_{n}"]["grad_norm"] for p in ("zero3", "zero2", "torch")]
        assert norms == pytest.approx([norms[-1]] * 3, rel=5e-3)
    assert parts["zero3"]["engine"]["model_dtype"] == "bfloat16" and parts["zero3"]["engine"]["bf16_autocast"]
    # what it did import (setuptools' vendored packages show under their own names)
    assert {"deepspeed", "pydantic", "annotated-types", "transformers", "torch"} <= set(rec["imports"])
    assert "arpo" not in rec["imports"] and rec["imports"]["transformers"] == version("transformers")


@pytest.mark.slow
def test_offline_script_dry_run_runs_parts_in_subprocesses(tmp_path):
    out = tmp_path / "dry.json"
    res = subprocess.run(
        ["bash", "scripts/gpu_check_offline.sh", "--dry-run", "--parts", "gen,zero2"],
        cwd=ROOT,
        env={**os.environ, "RESULT_DRY": str(out)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"[gpu_offline] wrote {out}" in res.stdout
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python benchmarks/gpu_offline.py --dry-run")
    s = dry_settings()
    check_gen(rec["parts"]["gen"], s)
    check_update(rec["parts"]["zero2"], s, "deepspeed", 2)
    assert all(p["wall_s"] > 0 for p in rec["parts"].values())


# ---------------------------------------------------------------------------------------- out of memory
def test_out_of_memory_is_a_result_and_batch_128_falls_back(tmp_path, monkeypatch):
    """An OOM at the largest batch is recorded and that batch runs again at the fallback pixel budget
    (gpu_offline.py, decision "Batch 128 fallback"); an OOM in an update step ends the part with what it had
    measured."""
    import arpo_core.algorithm.update as update
    import arpo_core.policy.generate as generate

    real_generate, real_update = generate.HFGenerator._generate, update.ppo_update

    def generate_oom(self, batch, **kw):
        if len(batch) == 3 and self.policy.max_pixels == go.DRY_MAX_PIXELS:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real_generate(self, batch, **kw)

    def update_oom(policy, engine, seqs, *a, **kw):
        if seqs[0].input_ids.count(policy.image_token_id) > 15:  # the 3-step trajectory
            raise RuntimeError("CUDA error: out of memory")
        return real_update(policy, engine, seqs, *a, **kw)

    monkeypatch.setattr(generate.HFGenerator, "_generate", generate_oom)
    monkeypatch.setattr(update, "ppo_update", update_oom)
    rec = go.main(["--dry-run", "--in-process", "--parts", "gen,torch", "--out", str(tmp_path / "r.json")])
    gen, upd = rec["parts"]["gen"], rec["parts"]["torch"]
    assert gen["batch_2"]["new_tokens"] == 8 and "oom" not in gen["batch_2"]
    assert gen["batch_3"]["oom"] is True and "Tried to allocate" in gen["batch_3"]["error"]
    fb = gen["batch_3_fallback"]
    assert fb["max_pixels"] == go.DRY_MAX_PIXELS // 4 and fb["new_tokens"] == 12
    assert fb["image_tokens_per_screenshot"] < gen["batch_2"]["image_tokens_per_screenshot"]
    assert fb["reason"] == f"batch 3 at max_pixels {go.DRY_MAX_PIXELS} ran out of memory"
    assert upd["ended"] == "ok" and len(upd["shots_1"]["runs_s"]) == 2
    assert upd["shots_3"]["oom"] is True and upd["shots_3"]["runs_s"] == []
    assert "out of memory" in go.summary("torch", upd)


def test_frozen_vision_zero3_runs_only_when_zero3_did_not_fit(tmp_path, monkeypatch):
    ran = []

    def fake(name, s):
        ran.append(name)
        fitted = {"runs_s": [1.0]} if fit else {"runs_s": [], "oom": True}
        return {"ended": "ok", "shots_1": {"runs_s": [0.1]}, "shots_3": fitted}

    monkeypatch.setattr(go, "in_process", fake)
    for fit in (True, False):
        ran.clear()
        rec = go.main(
            ["--dry-run", "--in-process", "--parts", "zero3,zero3-fv", "--out", str(tmp_path / "r")]
        )
        if fit:
            assert ran == ["zero3"]
            assert rec["parts"]["zero3-fv"] == {"skipped": "zero3's largest trajectory fitted"}
        else:
            assert ran == ["zero3", "zero3-fv"]


# ---------------------------------------------------------------------------------------- the real mode's plumbing
def fake_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (`fakecarry`), for the install step."""
    import zipfile

    path = folder / "fakecarry-0.1-py3-none-any.whl"
    info = "fakecarry-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakecarry/__init__.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fakecarry\nVersion: 0.1\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.slow
def test_offline_script_installs_the_carry_and_records_each_part(tmp_path):
    """scripts/gpu_check_offline.sh outside --dry-run, on this CPU machine with a stand-in nvidia-smi: the
    carry folder is checked against its manifest and installed into its own site folder, the run gets the
    budget, the environment and the results file; a part that cannot run (no CUDA here) is recorded with
    how it ended and its log, and the next one still runs."""
    carry, bin_dir, site, out = tmp_path / "carry", tmp_path / "bin", tmp_path / "site", tmp_path / "gpu.json"
    (carry / "wheels").mkdir(parents=True)
    wheel = fake_wheel(carry / "wheels")
    digest = subprocess.run(["sha256sum", wheel.name], cwd=wheel.parent, capture_output=True, text=True)
    (carry / "manifest.txt").write_text(digest.stdout)
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Stand-in GPU, 1024 MiB, 0.0'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "CARRY_DIR": str(carry),
        "SITE": str(site),
        "RESULT": str(out),
        "BUDGET_S": "300",
    }
    cmd = ["bash", "scripts/gpu_check_offline.sh", "--parts", "gen,fused_adam"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (site / "fakecarry" / "__init__.py").exists()
    rec = json.loads(out.read_text())
    assert rec["dry_run"] is False and rec["machine"]["gpu"] == "Stand-in GPU, 1024 MiB, 0.0"
    assert 0 < rec["budget_s"] <= 300
    assert rec["env"]["DS_ACCELERATOR"] == "cuda"
    assert rec["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert rec["env"]["PYTHONPATH"].split(":")[0] == str(site)
    gen, fused = rec["parts"]["gen"], rec["parts"]["fused_adam"]
    assert gen["ended"] == "exit 1" and "CUDA" in gen["log_tail"] and "batch_8" not in gen
    assert fused["ended"] == "exit 1" and fused["wall_s"] > 0
    # a carry folder that differs from its manifest stops the run before anything is installed
    (carry / "manifest.txt").write_text(digest.stdout.replace(digest.stdout[:8], "0" * 8))
    bad = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "differs from its manifest" in bad.stderr


def test_arch_list_for_deepspeeds_jit_build_drops_arch_specific_suffixes(monkeypatch):
    """engines.py, decision "Arch list for the JIT build": the H200 node sets TORCH_CUDA_ARCH_LIST=9.0a, on
    which DeepSpeed's op builder fails (the first fused_adam part there, benchmarks/results/gpu.json);
    the normalised list parses, keeps +PTX and the other entries."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    from arpo_core.algorithm.engines import ds_arch_list

    assert ds_arch_list("9.0a") == "9.0"
    assert ds_arch_list("8.0;9.0a") == "8.0;9.0"
    assert ds_arch_list("9.0a+PTX 8.6") == "9.0+PTX;8.6"
    assert ds_arch_list("8.0 8.0;9.0") == "8.0;9.0"

    class Builder(CUDAOpBuilder):
        def __init__(self):
            super().__init__(name="arch_probe")

        def absolute_name(self):
            return "arch_probe"

        def sources(self):
            return []

    builder = Builder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", ds_arch_list("8.0;9.0a"))
    builder.compute_capability_args()  # parses
    from arpo_core.algorithm.engines import use_ds_arch_list

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")  # what the engine does before DeepSpeed builds
    assert use_ds_arch_list() == ("9.0a", "9.0") and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert use_ds_arch_list() is None
