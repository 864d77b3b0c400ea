"""ARPO replay buffer: storing, trigger, filling, FIFO eviction, determinism, persistence, stats."""

from __future__ import annotations

import json
import math
import random

import pytest
from PIL import Image

from arpo_core.algorithm import replay as replay_mod
from arpo_core.algorithm.replay import (
    FillResult,
    ReplayBuffer,
    ReplayConfig,
    ReplayStats,
    group_failed,
    population_std,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes

PNG = png_bytes(Image.new("RGB", (4, 3), (10, 20, 30)))


def traj(
    reward: float = 0.0,
    success: float | None = None,
    *,
    domain: str = "miniwob",
    task: str = "click-test",
    sample: int = 0,
    group: int = 0,
    epoch: int = 0,
    run: str = "run-a",
    version: int = 0,
    n_steps: int = 2,
) -> Trajectory:
    """A small trajectory; success defaults to the reward (no format term)."""
    steps = [
        Step(
            step_idx=i,
            screenshot_png=PNG,
            screen_w=4,
            screen_h=3,
            response_text=f"Thought: t{i}\nAction: click(start_box='(1,{i})')",
            actions_json=json.dumps([{"type": "click", "x": 1, "y": i}]),
            done=i == n_steps - 1,
            gen_logprob_sum=-1.5 * (i + 1),
            response_token_ids=[sample, i, 7],
        )
        for i in range(n_steps)
    ]
    return Trajectory(
        run_id=run,
        stage="train",
        epoch=epoch,
        task_domain=domain,
        task_id=task,
        instruction=f"do {task}",
        steps=steps,
        group_id=group,
        sample_idx=sample,
        success=reward if success is None else success,
        reward=reward,
        policy_version=version,
    )


def group_of(rewards: list[float], **kw) -> list[Trajectory]:
    return [traj(r, sample=i, **kw) for i, r in enumerate(rewards)]


def failed_group(g: int = 8, **kw) -> list[Trajectory]:
    return group_of([0.0] * g, **kw)


def successes(n: int, *, start: int = 0, **kw) -> list[Trajectory]:
    """n distinct successful rollouts, told apart by policy_version (which a replayed copy keeps)."""
    return [traj(1.0, sample=i % 8, epoch=100 + i // 8, version=i, **kw) for i in range(start, start + n)]


def tag(t: Trajectory) -> tuple:
    return (t.task_domain, t.task_id, t.policy_version)


# ------------------------------------------------------------------ pure helpers


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.0, 0.0, 0.0, 1.0], math.sqrt(0.1875)),  # mean 0.25; ((3 * 0.0625) + 0.5625) / 4
        ([1.0, 1.0], 0.0),
        ([0.0, 1.0], 0.5),  # ddof=0: 0.5, unbiased would be 0.7071
        ([], 0.0),
    ],
)
def test_population_std_hand_values(values, expected):
    assert population_std(values) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "failed"),
    [
        ([0.0] * 8, True),
        ([0.0] * 7 + [1.0], False),  # one success: std 0.331
        ([1.0] * 8, False),  # all success: std 0 but mean 1
        ([0.15] * 8, True),  # std 0, mean 0.15 < 0.2: "failed" although each is > 0.1
        # One partial success 0.145: population std 0.0480 < 0.05 -> failed (reference, np.std);
        # the unbiased std 0.0513 would not trigger. Pins ddof=0.
        ([0.0] * 7 + [0.145], True),
        ([0.0] * 7 + [0.16], False),  # population std 0.0529
        ([], False),
    ],
)
def test_group_failed_reference_trigger(values, failed):
    assert group_failed(values, trigger_std=0.05, trigger_mean=0.2) is failed


def test_config_validation():
    with pytest.raises(ValueError, match="capacity_per_task"):
        ReplayConfig(capacity_per_task=0)
    with pytest.raises(ValueError, match="signal"):
        ReplayConfig(signal="advantage")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trigger_std"):
        ReplayConfig(trigger_std=float("nan"))


# ---------------------------------------------------------------------- storing


@pytest.mark.parametrize(
    ("reward", "stored"),
    [(0.0, False), (0.1, False), (0.1000001, True), (0.5, True), (1.0, True), (-0.5, False)],
)
def test_threshold_is_strict(reward, stored):
    buf = ReplayBuffer(success_threshold=0.1)
    assert buf.add([traj(reward)]) == int(stored)
    assert len(buf) == int(stored)


@pytest.mark.parametrize(
    ("signal", "success", "reward", "stored"),
    [
        ("success", 1.0, 0.5, True),  # success with a -0.5 format term: stored by checker score
        ("success", 0.0, 0.5, False),
        ("reward", 0.0, 0.5, True),
        ("reward", 1.0, 0.05, False),
    ],
)
def test_signal_selects_success_or_reward(signal, success, reward, stored):
    buf = ReplayBuffer(ReplayConfig(signal=signal), success_threshold=0.1)
    buf.add([traj(reward, success=success)])
    assert len(buf) == int(stored)


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_fifo_eviction_keeps_newest_in_order(capacity):
    buf = ReplayBuffer(ReplayConfig(capacity_per_task=capacity), success_threshold=0.1)
    items = successes(capacity + 2)
    for t in items:  # one at a time, as successive iterations would
        buf.add([t])
    kept = buf.items(("miniwob", "click-test"))
    assert [tag(t) for t in kept] == [tag(t) for t in items[-capacity:]]
    assert buf.stats().n_evicted == 2
    assert buf.stats().n_added == capacity + 2


def test_key_separation_same_id_two_domains():
    buf = ReplayBuffer(success_threshold=0.1)
    buf.add([traj(1.0, domain="chrome", task="t1"), traj(1.0, domain="gimp", task="t1", sample=1)])
    assert buf.sizes() == {("chrome", "t1"): 1, ("gimp", "t1"): 1}
    res = buf.fill_group(failed_group(domain="chrome", task="t1"))
    assert res.reason == "filled"
    assert res.group[0].task_domain == "chrome"
    assert res.group[0].sample_idx == 0 and buf.items(("chrome", "t1"))[0].sample_idx == 0

    only_gimp = ReplayBuffer(success_threshold=0.1)
    only_gimp.add([traj(1.0, domain="gimp", task="t1")])
    res = only_gimp.fill_group(failed_group(domain="chrome", task="t1"))
    assert res.reason == "no_stored_success" and res.replaced_slot is None


def test_add_skips_replayed_and_duplicates():
    buf = ReplayBuffer(success_threshold=0.1)
    t = traj(1.0)
    assert buf.add([t]) == 1
    assert buf.add([t]) == 0  # the same rollout again
    assert buf.add([t.with_(replayed=True, epoch=5)]) == 0
    res = buf.fill_group(failed_group(epoch=3))
    # Adding the filled group by mistake does not store the replayed copy of the stored item.
    assert buf.add(res.group) == 0
    assert len(buf) == 1


def test_stored_item_is_decoupled_from_caller_object():
    buf = ReplayBuffer(success_threshold=0.1)
    t = traj(1.0)
    buf.add([t])
    t.reward = -7.0
    t.steps.append(t.steps[0])
    stored = buf.items(("miniwob", "click-test"))[0]
    assert stored.reward == 1.0 and len(stored.steps) == 2


# ----------------------------------------------------------------------- filling


@pytest.mark.parametrize(
    ("rewards", "stored", "enabled", "reason", "slot"),
    [
        ([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], True, True, "not_failed", None),  # mixed
        ([1.0] * 8, True, True, "not_failed", None),  # all success
        ([0.0] * 8, True, True, "filled", 0),
        ([0.0] * 8, False, True, "no_stored_success", None),
        ([0.0] * 8, True, False, "disabled", None),
        ([0.0] * 8, False, False, "no_stored_success", None),
    ],
)
def test_fill_trigger(rewards, stored, enabled, reason, slot):
    buf = ReplayBuffer(ReplayConfig(enabled=enabled), success_threshold=0.1)
    if stored:
        buf.add([traj(1.0, epoch=99)])
    group = group_of(rewards)
    before = list(group)
    res = buf.fill_group(group)
    assert isinstance(res, FillResult)
    assert (res.reason, res.replaced_slot) == (reason, slot)
    assert group == before  # input untouched
    assert res.group is not group
    if slot is None:
        assert all(a is b for a, b in zip(res.group, group, strict=True))
        assert not any(t.replayed for t in res.group)


def test_filled_group_contents():
    buf = ReplayBuffer(success_threshold=0.1)
    stored = traj(0.7, success=0.8, epoch=2, group=5, sample=6, version=3, run="old-run")
    buf.add([stored])
    group = group_of([0.0] * 8, epoch=9, group=4, version=11, run="new-run")
    res = buf.fill_group(group)
    assert res.replaced_slot == 0
    r = res.group[0]
    assert r.replayed is True
    assert (r.reward, r.success) == (0.7, 0.8)  # keeps its stored reward
    assert r.policy_version == 3  # behaviour policy of the stored rollout
    assert (r.run_id, r.epoch, r.group_id, r.sample_idx) == ("new-run", 9, 4, 0)  # the slot's place
    assert [s.response_token_ids for s in r.steps] == [s.response_token_ids for s in stored.steps]
    assert r.steps[0].screenshot_png == PNG
    assert all(a is b for a, b in zip(res.group[1:], group[1:], strict=True))
    assert not any(t.replayed for t in res.group[1:])
    # The advantage now has variance: rewards [0.7, 0, ..., 0].
    assert population_std([t.reward for t in res.group]) > 0.2
    # Filling marks a copy; the stored item stays unmarked.
    assert buf.items(("miniwob", "click-test"))[0].replayed is False


def test_group_of_size_one_and_errors():
    buf = ReplayBuffer(success_threshold=0.1)
    buf.add([traj(1.0, epoch=1)])
    res = buf.fill_group([traj(0.0)])
    assert res.replaced_slot == 0 and res.group[0].replayed
    with pytest.raises(ValueError, match="one task"):
        buf.fill_group([traj(0.0), traj(0.0, task="other", sample=1)])
    with pytest.raises(ValueError, match="one task"):
        buf.fill_group([traj(0.0, domain="a"), traj(0.0, domain="b", sample=1)])
    with pytest.raises(ValueError, match="empty"):
        buf.fill_group([])


def test_disabled_draws_nothing():
    on, off = (
        ReplayBuffer(ReplayConfig(enabled=True), success_threshold=0.1),
        ReplayBuffer(ReplayConfig(enabled=False), success_threshold=0.1),
    )
    for b in (on, off):
        b.add(successes(4))
    state = off._rng.getstate()
    for _ in range(5):
        assert off.fill_group(failed_group()).reason == "disabled"
    assert off._rng.getstate() == state
    s = off.stats()
    assert (s.groups_failed, s.groups_fillable, s.groups_filled) == (5, 5, 0)


def test_two_failed_groups_of_one_task_are_filled_independently():
    """train.groups_per_task > 1 (trainer.py, decision "ARPO order of operations"): every all-failed group of
    a task is filled on its own, each with its own uniform draw (with replacement): the same stored success or
    two different ones, as the buffer's RNG falls."""
    picks = []
    for seed in range(12):
        buf = ReplayBuffer(ReplayConfig(seed=seed), success_threshold=0.1)
        buf.add(successes(2))
        results = buf.apply([failed_group(4, group=g) for g in (3, 4)])
        assert [(r.reason, r.replaced_slot) for r in results] == [("filled", 0), ("filled", 0)]
        assert [r.group[0].group_id for r in results] == [3, 4]  # each copy sits in its own group
        assert all(r.group[0].replayed for r in results)
        expected = random.Random(seed)  # the draws: randrange(2) of the seeded RNG, once per group
        assert [r.group[0].policy_version for r in results] == [expected.randrange(2), expected.randrange(2)]
        picks.append(tag(results[0].group[0]) == tag(results[1].group[0]))
        assert buf.stats().groups_filled == 2
    assert any(picks) and not all(picks)  # seen both: the same success twice, and two different ones


def draw_sequence(buf: ReplayBuffer, n: int, task: str = "click-test") -> list[tuple]:
    """Tags of the items drawn by n fills of all-failed groups of `task` (each fill must draw)."""
    out = []
    for _ in range(n):
        res = buf.fill_group(failed_group(task=task))
        assert res.reason == "filled"
        out.append(tag(res.group[0]))
    return out


def test_seeded_determinism():
    a, b, c = (ReplayBuffer(ReplayConfig(seed=s), success_threshold=0.1) for s in (7, 7, 8))
    for buf in (a, b, c):
        buf.add(successes(8))
    seq_a = draw_sequence(a, 30)
    assert seq_a == draw_sequence(b, 30)
    assert seq_a != draw_sequence(c, 30)  # chance of equality 8**-30


def test_draw_is_uniform_over_stored_items():
    buf = ReplayBuffer(ReplayConfig(seed=1), success_threshold=0.1)
    buf.add(successes(4))
    seq = draw_sequence(buf, 2000)
    counts = {t: seq.count(t) for t in set(seq)}
    assert len(counts) == 4
    # Binomial(2000, 1/4): mean 500, sd 19.4; +-100 is > 5 sd.
    assert all(400 < c < 600 for c in counts.values()), counts


def test_apply_and_stats_counts():
    buf = ReplayBuffer(success_threshold=0.1)
    buf.add([traj(1.0, task="a", epoch=50)])
    groups = [
        group_of([1.0, 0.0, 0.0, 0.0], task="mixed"),
        group_of([0.0] * 4, task="a"),  # failed, stored -> filled
        group_of([0.0] * 4, task="b"),  # failed, nothing stored
        group_of([1.0] * 4, task="c"),  # all success
    ]
    results = buf.apply(groups)
    assert [r.reason for r in results] == ["not_failed", "filled", "no_stored_success", "not_failed"]
    buf.add(t for g in groups for t in g)  # fresh rollouts only
    s = buf.stats()
    assert isinstance(s, ReplayStats)
    assert s == ReplayStats(
        n_tasks=3,  # a (1), mixed (1), c (4)
        n_items=6,
        groups_seen=4,
        groups_failed=2,
        groups_fillable=1,
        groups_filled=1,
        fill_rate=0.5,
        failed_rate=0.5,
        n_added=6,
        n_evicted=0,
    )
    assert buf.sizes() == {("miniwob", "a"): 1, ("miniwob", "mixed"): 1, ("miniwob", "c"): 4}
    m = s.as_metrics()
    assert m["replay/groups_filled"] == 1.0 and m["replay/fill_rate"] == 0.5


def test_empty_stats_have_no_division_by_zero():
    s = ReplayBuffer(success_threshold=0.1).stats()
    assert (s.fill_rate, s.failed_rate, s.n_items, s.n_tasks) == (0.0, 0.0, 0, 0)


# ------------------------------------------------------------------- persistence


def build_buffer(seed: int = 3) -> ReplayBuffer:
    buf = ReplayBuffer(ReplayConfig(seed=seed, capacity_per_task=3), success_threshold=0.1)
    buf.add(successes(5, task="x"))  # 2 evicted
    buf.add([traj(0.3, task="y", epoch=1), traj(0.7, success=0.9, task="y", epoch=2, sample=1)])
    buf.add([traj(1.0, domain="other", task="x", epoch=4)])
    draw_sequence(buf, 3, task="x")  # advance the RNG and counters
    return buf


def test_save_load_round_trip(tmp_path):
    buf = build_buffer()
    buf.save(tmp_path / "replay")
    loaded = ReplayBuffer.load(tmp_path / "replay")
    assert loaded.config == buf.config
    assert loaded.stats() == buf.stats()
    assert loaded.sizes() == buf.sizes()
    assert list(loaded.sizes()) == list(buf.sizes())
    for key in buf.sizes():
        # Dataclass equality: every field, every step (PNG bytes, token ids) and exact float rewards
        # (0.3 and 0.7 are not float32-exact: the schema stores float64).
        assert loaded.items(key) == buf.items(key)
    assert loaded.items(("miniwob", "y"))[0].reward == 0.3


def test_resume_draws_the_same_items_as_uninterrupted_run(tmp_path):
    original = build_buffer()
    original.save(tmp_path / "ckpt")
    resumed = ReplayBuffer.load(tmp_path / "ckpt")
    for buf in (original, resumed):  # the same future: fills, new successes, evictions, fills
        buf.add(successes(2, start=40, task="x"))
    expected = draw_sequence(original, 25, task="x")
    assert len(set(expected)) > 1  # the draws really vary, so equality below is informative
    assert draw_sequence(resumed, 25, task="x") == expected
    assert resumed.stats() == original.stats()
    assert resumed.items(("miniwob", "x")) == original.items(("miniwob", "x"))


def test_save_is_atomic_and_cleans_up(tmp_path, monkeypatch):
    d = tmp_path / "replay"
    buf = build_buffer()
    buf.save(d)
    first = sorted(p.name for p in d.iterdir())
    assert "manifest.json" in first and len([n for n in first if n.endswith(".parquet")]) == 1

    buf.add([traj(1.0, task="z", epoch=7)])
    buf.save(d)  # the superseded Parquet file is removed
    assert len(list(d.glob("*.parquet"))) == 1
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp files left
    saved_sizes = buf.sizes()

    # A crash while writing the manifest leaves the previous save loadable and unchanged.
    buf.add([traj(1.0, task="w", epoch=8)])

    def boom(path, text):
        raise OSError("disk full")

    monkeypatch.setattr(replay_mod, "atomic_write_text", boom)
    with pytest.raises(OSError, match="disk full"):
        buf.save(d)
    assert ReplayBuffer.load(d).sizes() == saved_sizes


def test_empty_buffer_round_trip(tmp_path):
    buf = ReplayBuffer(ReplayConfig(seed=5), success_threshold=0.1)
    buf.save(tmp_path / "e")
    loaded = ReplayBuffer.load(tmp_path / "e")
    assert len(loaded) == 0 and loaded.config.seed == 5
    assert not list((tmp_path / "e").glob("*.parquet"))


def test_the_threshold_is_saved_and_an_older_buffer_keeps_its_configs_one(tmp_path):
    """project.success_threshold is the one key; a buffer saved while the threshold was a field of the
    replay config (checkpoints before it moved) loads with that value."""
    import json

    buf = ReplayBuffer(ReplayConfig(seed=5), success_threshold=0.4)
    buf.save(tmp_path / "new")
    assert ReplayBuffer.load(tmp_path / "new").success_threshold == 0.4
    assert ReplayBuffer.load(tmp_path / "new", success_threshold=0.2).success_threshold == 0.2
    manifest = json.loads((tmp_path / "new" / "manifest.json").read_text())
    manifest["config"]["success_threshold"] = manifest.pop("success_threshold")  # the older layout
    (tmp_path / "new" / "manifest.json").write_text(json.dumps(manifest))
    old = ReplayBuffer.load(tmp_path / "new")
    assert old.success_threshold == 0.4 and old.config.seed == 5


def test_load_with_config_override(tmp_path):
    buf = build_buffer()
    buf.save(tmp_path / "r")
    smaller = ReplayBuffer.load(tmp_path / "r", ReplayConfig(capacity_per_task=1, enabled=False))
    assert smaller.sizes() == {k: 1 for k in buf.sizes()}
    assert smaller.items(("miniwob", "x")) == buf.items(("miniwob", "x"))[-1:]  # newest kept
    assert smaller.stats().n_evicted == buf.stats().n_evicted + 3  # x: 3->1, y: 2->1
    assert smaller.fill_group(failed_group(task="x")).reason == "disabled"


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        ReplayBuffer.load(tmp_path / "nothing")
    buf = build_buffer()
    buf.save(tmp_path / "r")
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    m["order"][0]["n"] += 1
    (tmp_path / "r" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="manifest lists"):
        ReplayBuffer.load(tmp_path / "r")
