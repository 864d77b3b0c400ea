"""policy.backend vllm without vLLM: the weight hand-over to a colocated engine, the backend dispatch, and
the trainer's sync after every update, against a stand-in engine that records what it is given (vLLM
has no CPU build; the GPU run is scripts/gpu_check.sh)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from arpo_core.policy.prompt import PromptSpec

sys.path.insert(0, str(Path(__file__).parent))
import trainer_harness as harness

from arpo_core.config import PolicyConfig, VLLMConfig
from arpo_core.policy import generate as gen_mod
from arpo_core.policy.generate import (
    Generation,
    HFGenerator,
    VLLMGenerator,
    checkpoint_name,
    load_into_engine,
    make_generator,
    named_weights,
)
from arpo_core.policy.model import build_tiny_policy, load_policy
from arpo_core.policy.prompt import PromptInput


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(out, size="xs", seed=0)
    return out


class RecordingModel:
    """Stands in for the engine's model: records every load_weights call (names, copies of tensors)."""

    def __init__(self):
        self.calls: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights):
        self.calls.append([(n, t.detach().clone()) for n, t in weights])
        return {n for n, _ in weights}

    def state(self) -> dict[str, torch.Tensor]:
        """The last tensor loaded under each name (what the engine holds now)."""
        return {n: t for call in self.calls for n, t in call}


def in_process_llm(model: RecordingModel):
    """An LLM whose model lives in this process at TRL's path (llm_engine...driver_worker.model_runner)."""
    runner = types.SimpleNamespace(model=model)
    executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=executor))
    llm.prefix_resets = 0

    def reset_prefix_cache():
        llm.prefix_resets += 1

    llm.reset_prefix_cache = reset_prefix_cache
    return llm


class RpcLLM:
    """An LLM whose worker is elsewhere: only collective_rpc reaches it (runs fn(worker, *args) here)."""

    def __init__(self, model: RecordingModel):
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model))

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]


def test_checkpoint_names_are_the_saved_file_keys(policy_dir):
    """Synced names = the safetensors keys save_pretrained writes (the names vLLM loaded at its start)."""
    policy = load_policy(policy_dir)
    with safe_open(str(policy_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    names = [n for n, _ in named_weights(policy.model)]
    assert len(names) == len(set(names))
    assert set(names) == keys
    assert (
        checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert checkpoint_name("model.visual.blocks.0.norm1.weight") == "visual.blocks.0.norm1.weight"
    assert checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("kind", ["in_process", "collective_rpc"])
def test_sync_hands_the_trained_weights_to_the_engine(policy_dir, kind):
    policy = load_policy(policy_dir)
    model = RecordingModel()
    llm = in_process_llm(model) if kind == "in_process" else RpcLLM(model)
    gen = VLLMGenerator(policy, str(policy_dir), spec=PromptSpec("compact", None), max_images=15, llm=llm)
    before = {n: p.detach().clone() for n, p in named_weights(policy.model)}
    gen.sync_weights(policy.model)
    assert gen.last_sync_path == kind and gen.weights_version == 1
    # one optimizer step changes the weights; the next sync carries them
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3, 4]])
    policy.model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    gen.sync_weights(policy.model)
    held = model.state()
    now = dict(named_weights(policy.model))
    assert set(held) == set(now)
    assert all(torch.equal(held[n], now[n].detach()) for n in now)
    assert any(not torch.equal(held[n], before[n]) for n in now)  # the update really moved something
    if kind == "in_process":
        assert llm.prefix_resets == 2  # stale KV entries dropped after each sync


def test_load_into_engine_names_what_it_cannot_reach():
    with pytest.raises(RuntimeError, match="collective_rpc"):
        load_into_engine(types.SimpleNamespace(), [("x", torch.zeros(1))])


def install_fake_vllm(monkeypatch) -> list[dict]:
    """A `vllm` module whose LLM records its arguments and answers generate() with a fixed reply."""
    built: list[dict] = []

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            if "logprobs_mode" in kw:
                raise TypeError("LLM.__init__() got an unexpected keyword argument 'logprobs_mode'")
            built.append(kw)
            self.model = RecordingModel()
            runner = types.SimpleNamespace(model=self.model)
            executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
            self.llm_engine = types.SimpleNamespace(model_executor=executor)
            self.requests = []

        def reset_prefix_cache(self):
            pass

        def generate(self, prompts, params, use_tqdm=False):
            self.requests.append((prompts, params))
            out = []
            for p in params:
                ids = list(self.reply_ids[: p.kw["max_tokens"]])
                lps = [{t: types.SimpleNamespace(logprob=-0.5 - 0.1 * k)} for k, t in enumerate(ids)]
                out.append(
                    types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=lps)])
                )
            return out

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    monkeypatch.setattr(gen_mod, "_ENGINE", {})
    return built


def test_backend_dispatch_from_params(policy_dir, monkeypatch):
    policy = load_policy(policy_dir)
    assert isinstance(make_generator(policy, policy_dir, PolicyConfig(), max_images=3), HFGenerator)
    monkeypatch.setitem(sys.modules, "vllm", None)  # this machine: no vLLM
    monkeypatch.setattr(gen_mod, "_ENGINE", {})
    with pytest.raises(ImportError, match=r"policy\.backend=vllm needs vLLM.*setup_gpu\.sh"):
        make_generator(policy, policy_dir, PolicyConfig(backend="vllm"), max_images=3)

    built = install_fake_vllm(monkeypatch)
    cfg = PolicyConfig(
        backend="vllm", history_images=None, vllm=VLLMConfig(gpu_memory_utilization=0.25, max_model_len=4096)
    )
    gen = make_generator(policy, policy_dir, cfg, max_images=7)
    assert isinstance(gen, VLLMGenerator) and len(built) == 1
    kw = built[0]
    assert kw["model"] == str(policy_dir)
    assert kw["limit_mm_per_prompt"] == {"image": 7}
    assert kw["mm_processor_kwargs"] == {"min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels}
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert (kw["gpu_memory_utilization"], kw["max_model_len"], kw["dtype"]) == (0.25, 4096, "bfloat16")
    assert gen.weights_version == 1  # the engine got the policy's weights before any reply

    # a second policy of the same architecture reuses the engine and only loads its weights
    other = load_policy(policy_dir)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(1.0)
    gen2 = make_generator(other, policy_dir, cfg, max_images=7)
    assert len(built) == 1 and gen2.llm is gen.llm
    held = gen.llm.model.state()
    assert all(torch.equal(held[n], p.detach()) for n, p in named_weights(other.model))


def test_vllm_generate_returns_the_engine_tokens_and_logprobs(policy_dir, monkeypatch):
    install_fake_vllm(monkeypatch)
    policy = load_policy(policy_dir)
    gen = make_generator(policy, policy_dir, PolicyConfig(backend="vllm"), max_images=3)
    text = "Thought: ok.\nAction: click(start_box='(10,20)')"
    gen.llm.reply_ids = [*policy.tokenizer.encode(text, add_special_tokens=False), policy.im_end_id]
    from PIL import Image

    batch = [PromptInput("Click.", (Image.new("RGB", (160, 210), "white"),))] * 2
    out = gen.generate(batch, temperature=1.0, top_p=0.9, max_new_tokens=64, seeds=[5, 6])
    n = len(gen.llm.reply_ids)
    assert out[0] == Generation(
        text, tuple(gen.llm.reply_ids), tuple(-0.5 - 0.1 * k for k in range(n)), "stop"
    )
    params = gen.llm.requests[-1][1]
    assert [p.kw["seed"] for p in params] == [5, 6] and params[0].kw["logprobs"] == 0
    assert set(params[0].kw["logit_bias"]) == set(policy.vision_token_ids)
    cut = gen.generate(batch[:1], temperature=0.0, top_p=1.0, max_new_tokens=3)
    assert cut[0].finish_reason == "length" and len(cut[0].token_ids) == 3


class SyncedReplies(harness.RandomReplies):
    """The harness's seeded replies from a generator that holds its own weight copy, as vLLM's does: the
    real VLLMGenerator.sync_weights hands the weights to a recording engine."""

    _asleep = False
    weights_version = 0
    last_sync_path = ""

    def __init__(self, policy):
        super().__init__(policy)
        self.engine = RecordingModel()
        self.llm = in_process_llm(self.engine)
        self.syncs: list[dict[str, torch.Tensor]] = []
        self.before_updates = 0

    def before_update(self):
        self.before_updates += 1

    def sync_weights(self, model):
        VLLMGenerator.sync_weights(self, model)
        self.syncs.append({n: t.detach().clone() for n, t in named_weights(model)})


def test_trainer_syncs_after_every_update_and_compares_logprobs(policy_dir, tmp_path):
    cfg, pcfg = harness.configs(2)
    made: list[SyncedReplies] = []

    def factory(policy):
        made.append(SyncedReplies(policy))
        return made[-1]

    state = harness.run(policy_dir, tmp_path / "out", cfg, pcfg, generator_factory=factory)
    gen = made[0]
    updates = state.policy_version
    assert updates >= 2
    assert len(gen.syncs) == updates == gen.before_updates  # after every update, not once
    # the engine now holds exactly the trained weights under their checkpoint names
    final = load_policy(tmp_path / "out" / "checkpoints" / f"epoch-{state.epoch:04d}" / "policy")
    held = gen.engine.state()
    expected = dict(named_weights(final.model))
    assert set(held) == set(expected)
    assert all(torch.equal(held[n], expected[n].detach()) for n in expected)
    assert any(not torch.equal(gen.syncs[0][n], gen.syncs[-1][n]) for n in expected)
    last = state.history[-1]
    assert last["logprob/replies_compared"] > 0 and last["logprob/gen_vs_train_max_abs"] > 0
    assert "time/weight_sync_s" in last


def test_logprob_gap_compares_each_reply_with_the_trainers_recomputation(policy_dir, tmp_path):
    """The diagnostic on real trajectories: generator sums = the trainer's recomputed sums + a known
    offset per reply; replayed trajectories are left out."""
    import dataclasses

    from arpo_core.algorithm.trainer import logprob_gap
    from arpo_core.algorithm.update import compute_logps, encode_trajectories
    from arpo_core.trajectory import read_trajectories

    cfg, pcfg = harness.configs(1)
    harness.run(policy_dir, tmp_path / "out", cfg, pcfg)
    trajs = read_trajectories(sorted((tmp_path / "out" / "trajectories").glob("*.parquet"))[0])
    policy = load_policy(policy_dir)  # the weights that played the first iteration
    seqs = encode_trajectories(policy, trajs, spec=PromptSpec(pcfg.system_prompt, None))
    logps = compute_logps(policy, seqs, micro_batch_size=4, bf16=False)
    shifted = []
    for k, (t, seq, lp) in enumerate(zip(trajs, seqs, logps, strict=True)):
        offset = 0.5 if k == 0 else 0.125
        mask = torch.tensor(seq.assistant_mask)
        total = float(lp[mask].sum())
        steps = [dataclasses.replace(t.steps[0], gen_logprob_sum=total + offset)]
        shifted.append(dataclasses.replace(t, steps=steps, replayed=False))
    gap = logprob_gap(shifted, seqs, logps)
    n_tokens = sum(seqs[0].assistant_mask)
    assert gap["logprob/gen_vs_train_max_abs"] == pytest.approx(0.5, abs=1e-4)
    assert gap["logprob/gen_vs_train_max_abs_per_token"] == pytest.approx(
        max(0.5 / n_tokens, max(0.125 / sum(s.assistant_mask) for s in seqs[1:])), abs=1e-5
    )
    assert gap["logprob/replies_compared"] == len(trajs)
    shifted[0] = dataclasses.replace(shifted[0], replayed=True)  # an older policy's: not compared
    assert logprob_gap(shifted, seqs, logps)["logprob/gen_vs_train_max_abs"] == pytest.approx(0.125, abs=1e-4)


def test_hf_backend_trains_without_sync_or_diagnostic(policy_dir, tmp_path):
    cfg, pcfg = harness.configs(1)
    state = harness.run(policy_dir, tmp_path / "out", cfg, pcfg)
    assert not any(k.startswith("logprob/") for k in state.history[-1])
