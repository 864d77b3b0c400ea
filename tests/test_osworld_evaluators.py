"""OSWorld getters, metrics and the evaluator combinator: hand-computed values, no desktop needed."""

import json
import os
from pathlib import Path

import pytest

from arpo_core.envs.osworld import osworld_evaluators as ev


class FakeDesk:
    """A DesktopAPI with canned answers; records the commands it was asked to run."""

    def __init__(self, files=None, outputs=None, terminal=None, tree=None):
        self.files = files or {}
        self.outputs = outputs or {}
        self.terminal = terminal
        self.tree = tree
        self.commands = []

    def execute(self, command, shell=False):
        self.commands.append((command, shell))
        key = command if isinstance(command, str) else " ".join(command)
        return {
            "status": "success",
            "output": self.outputs.get(key, ""),
            "error": "err:" + key,
            "returncode": 0,
        }

    def get_file(self, path):
        return self.files.get(path)

    def terminal_output(self):
        return self.terminal

    def list_directory(self, path):
        return self.tree

    def screen_size(self):
        return {"width": 640, "height": 480}


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------ metrics
@pytest.mark.parametrize(
    ("result", "rules", "want"),
    [
        ("yes\n", {"expected": "yes\n"}, 1.0),
        ("yes", {"expected": "yes\n"}, 0.0),
        (None, {"expected": None}, 1.0),
    ],
)
def test_exact_match(result, rules, want):
    assert ev.exact_match(result, rules) == want


@pytest.mark.parametrize(
    ("result", "rules", "want"),
    [
        ("a b c", {"include": ["a", "c"], "exclude": ["d"]}, 1.0),
        ("a b c", {"include": ["a", "d"]}, 0.0),
        ("a b c", {"include": [], "exclude": ["b"]}, 0.0),
        ("", {}, 1.0),
        (None, {"include": []}, 0.0),
    ],
)
def test_check_include_exclude(result, rules, want):
    assert ev.check_include_exclude(result, rules) == want


def test_in_list_metrics_have_opposite_directions():
    assert ev.match_in_list("b", {"expected": ["a", "b"]}) == 1.0
    assert ev.match_in_list("c", {"expected": ["a", "b"]}) == 0.0
    assert ev.is_in_list(["a", "b"], {"expected": "b"}) == 1.0  # expected is IN the result
    assert ev.is_in_list("abc", {"expected": "bc"}) == 1.0
    assert ev.is_in_list("abc", {"expected": "x"}) == 0.0


def test_literal_match():
    assert ev.literal_match("Abc", "abc") == 0.0
    assert ev.literal_match("Abc", "abc", ignore_case=True) == 1.0
    assert ev.literal_match(3, "3") == 1.0
    assert ev.literal_match(["A", 1], ["a", "1"], type="list", ignore_case=True) == 1.0
    assert ev.literal_match(["a"], ["a", "b"], type="list") == 0.0
    assert ev.literal_match("a", ["a"], type="list") == 0.0
    with pytest.raises(ValueError, match="type"):
        ev.literal_match("a", "a", type="set")


def test_check_list(tmp_path):
    f = write(tmp_path, "l.txt", "eggs\nbread\nmilk\n")
    assert ev.check_list(f, {"expect": ["^eggs$", "^milk$"], "unexpect": ["^$"]}) == 1.0
    assert ev.check_list(f, {"expect": ["^cheese$"]}) == 0.0
    assert ev.check_list(f, {"expect": ["eggs"], "unexpect": ["rea"]}) == 0.0
    assert (
        ev.check_list(write(tmp_path, "e.txt", "eggs\n\n"), {"expect": ["eggs"], "unexpect": ["^$"]}) == 0.0
    )
    assert ev.check_list(None, {"expect": []}) == 0.0


def test_compare_text_file_options(tmp_path):
    a = write(tmp_path, "a.txt", "Hello\tworld\n")
    b = write(tmp_path, "b.txt", "hello world")
    assert ev.compare_text_file(a, b) == 0.0
    assert ev.compare_text_file(a, b, ignore_blanks=True) == 0.0  # case still differs
    assert ev.compare_text_file(a, b, ignore_blanks=True, ignore_case=True) == 1.0
    assert ev.compare_text_file(a, a) == 1.0
    assert ev.compare_text_file(None, b) == 0.0


def test_diff_text_file_is_line_similarity(tmp_path):
    a = write(tmp_path, "a.txt", "1\n2\n3\n4\n")
    b = write(tmp_path, "b.txt", "1\n2\n3\n5\n")
    # 3 matching lines of 4 + 4: ratio = 2 * 3 / 8
    assert ev.diff_text_file(a, b) == pytest.approx(0.75)
    assert ev.diff_text_file(None, b) == 0.0


def test_file_contains(tmp_path):
    f = write(tmp_path, "f.txt", "alpha beta")
    assert ev.file_contains(f, {"expected": ["alpha", "beta"]}) == 1.0
    assert ev.file_contains(f, {"expected": ["gamma"]}) == 0.0
    assert ev.file_contains(str(tmp_path / "missing"), {"expected": []}) == 0.0
    assert ev.file_contains(None, {"expected": []}) == 0.0


def test_check_direct_json_object():
    rules = {"expected": {"theme": "dark", "size": 12}}
    assert ev.check_direct_json_object('{"theme": "dark", "size": 12, "x": 1}\n', rules) == 1.0
    assert ev.check_direct_json_object("{'theme': 'dark', 'size': 12}", rules) == 1.0  # single quotes
    assert ev.check_direct_json_object({"theme": "light", "size": 12}, rules) == 0.0
    assert ev.check_direct_json_object({"theme": "dark"}, rules) == 0.0
    with pytest.raises(json.JSONDecodeError):
        ev.check_direct_json_object("", rules)  # the env scores this 0 (any exception)
    in_result = {"expect_in_result": True, "expected": {"tags": ["x", "y"], "name": "bob"}}
    assert ev.check_direct_json_object({"tags": ["a", "y"], "name": "bobby"}, in_result) == 1.0
    assert ev.check_direct_json_object({"tags": "x", "name": "bob"}, in_result) == 1.0
    assert ev.check_direct_json_object({"tags": ["a"], "name": "bob"}, in_result) == 0.0
    assert ev.check_direct_json_object({"tags": ["x"], "name": "al"}, in_result) == 0.0
    failed = {"expected": {"k": "__EVALUATION_FAILED__"}}
    assert ev.check_direct_json_object({"k": "__EVALUATION_FAILED__"}, failed) == 0.0


def test_directory_and_os_metrics():
    tree = {"type": "directory", "name": "d", "children": [{"name": "b"}, {"name": "a"}]}
    assert ev.check_moved_jpgs(tree, {"expected": ["a", "b"]}) == 1.0
    assert ev.check_moved_jpgs(tree, {"expected": ["a"]}) == 0.0
    assert (
        ev.check_gnome_favorite_apps("['x.desktop', 'y.desktop']\n", {"expected": ["y.desktop", "x.desktop"]})
        == 1.0
    )
    with pytest.raises(ValueError):
        ev.check_gnome_favorite_apps("__import__('os').system('true')", {"expected": []})  # no eval
    tz = "Local time: x\nUniversal time: y\nRTC time: z\nTime zone: Etc/UTC (UTC, +0000)\n"
    assert ev.is_utc_0(tz) == 1.0
    assert ev.is_utc_0(tz.replace("+0000", "+0100")) == 0.0
    assert ev.check_text_enlarged("1.25\n") == 1.0
    assert ev.check_text_enlarged("1.0") == 0.0


@pytest.mark.parametrize(
    ("scores", "conj", "want"),
    [([1.0, 0.5], "and", 0.75), ([1.0, 0.0], "and", 0.0), ([0.2, 0.6], "or", 0.6), ([0.0], "or", 0.0)],
)
def test_combine_scores(scores, conj, want):
    assert ev.combine_scores(scores, conj) == pytest.approx(want)


def test_combine_scores_rejects_unknown_conj():
    with pytest.raises(ValueError, match="conj"):
        ev.combine_scores([1.0], "xor")


# ------------------------------------------------------------------ getters
def test_vm_file_single_and_multi(tmp_path):
    desk = FakeDesk(files={"/a": b"A", "/b": b"B"})
    assert ev.get_vm_file(desk, str(tmp_path), {"path": "/a", "dest": "a.txt"}) == str(tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_bytes() == b"A"
    assert ev.get_vm_file(desk, str(tmp_path), {"path": "/missing", "dest": "m.txt"}) is None
    multi = {"multi": True, "path": ["/a", "/missing", "/b"], "dest": ["1", "2", "3"], "gives": [1, 2]}
    assert ev.get_vm_file(desk, str(tmp_path), multi) == [None, str(tmp_path / "3")]


def test_command_terminal_rule_and_cache_getters(tmp_path):
    desk = FakeDesk(outputs={"ls": "x\n"}, terminal="$ ls\nx\n", tree={"children": []})
    assert ev.get_vm_command_line(desk, "", {"command": "ls", "shell": True}) == "x\n"
    assert desk.commands == [("ls", True)]
    assert ev.get_vm_command_error(desk, "", {"command": ["ls"]}) == "err:ls"
    assert ev.get_vm_terminal_output(desk, "", {}) == "$ ls\nx\n"
    assert ev.get_list_directory(desk, "", {"path": "/x"}) == {"children": []}
    assert ev.get_rule(desk, "", {"rules": {"expected": 1}}) == {"expected": 1}
    assert ev.get_vm_screen_size(desk, "", {}) == {"width": 640, "height": 480}
    (tmp_path / "gold.txt").write_text("g")
    assert ev.get_cache_file(desk, str(tmp_path), {"path": "gold.txt"}) == str(tmp_path / "gold.txt")
    with pytest.raises(FileNotFoundError):
        ev.get_cache_file(desk, str(tmp_path), {"path": "nope.txt"})


def test_download_cache_name_matches_osworld_scheme():
    # uuid5(NAMESPACE_URL, "http://x/y") (RFC 4122 name-based SHA-1), then "_" + basename of the VM path
    want = "3516fb35-3ebf-5983-9034-76416ce34ca6_b.txt"
    assert ev.download_cache_name("http://x/y", "/home/user/a/b.txt") == want


# ------------------------------------------------------------------ evaluate_task
def test_evaluate_single_metric_with_rule():
    desk = FakeDesk(outputs={"echo": "yes\n"})
    evaluator = {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": "echo", "shell": True},
        "expected": {"type": "rule", "rules": {"expected": "yes\n"}},
    }
    assert ev.evaluate_task(evaluator, desk, "") == 1.0
    desk.outputs["echo"] = "no\n"
    assert ev.evaluate_task(evaluator, desk, "") == 0.0


def test_evaluate_metric_without_expected_gets_options(tmp_path):
    desk = FakeDesk(outputs={"s": "1.5"})
    evaluator = {"func": "check_text_enlarged", "result": {"type": "vm_command_line", "command": "s"}}
    assert ev.evaluate_task(evaluator, desk, "") == 1.0


def test_evaluate_list_and_or(tmp_path):
    desk = FakeDesk(outputs={"a": "A", "b": "B"})
    res = [{"type": "vm_command_line", "command": "a"}, {"type": "vm_command_line", "command": "b"}]
    exp = [{"type": "rule", "rules": {"expected": "A"}}, {"type": "rule", "rules": {"expected": "X"}}]
    both = {"func": ["exact_match", "exact_match"], "result": res, "expected": exp}
    assert ev.evaluate_task({**both, "conj": "and"}, desk, "") == 0.0
    assert ev.evaluate_task({**both, "conj": "or"}, desk, "") == 1.0
    assert ev.evaluate_task(both, desk, "") == 0.0  # conj defaults to "and"
    # "and" of a partial score and a full one is their mean
    f1 = write(tmp_path, "1.txt", "1\n2\n3\n4\n")
    f2 = write(tmp_path, "2.txt", "1\n2\n3\n5\n")
    desk.files = {"/r": Path(f1).read_bytes(), "/g": Path(f2).read_bytes()}
    mixed = {
        "func": ["diff_text_file", "exact_match"],
        "result": [
            {"type": "vm_file", "path": "/r", "dest": "r"},
            {"type": "vm_command_line", "command": "a"},
        ],
        "expected": [
            {"type": "vm_file", "path": "/g", "dest": "g"},
            {"type": "rule", "rules": {"expected": "A"}},
        ],
        "options": [{}, {}],
    }
    assert ev.evaluate_task(mixed, desk, str(tmp_path)) == pytest.approx((0.75 + 1.0) / 2)


def test_evaluate_missing_cache_file_fails_an_and_evaluator(tmp_path):
    evaluator = {
        "func": "compare_text_file",
        "result": {"type": "cache_file", "path": "absent.txt"},
        "expected": {"type": "rule", "rules": {}},
    }
    assert ev.evaluate_task(evaluator, FakeDesk(), str(tmp_path)) == 0.0


# ------------------------------------------------------------------ support check
def test_unsupported_features_names_everything_missing():
    task = {
        "config": [{"type": "launch"}, {"type": "chrome_open_tabs"}],
        "evaluator": {
            "postconfig": [{"type": "sleep"}, {"type": "login"}],
            "func": ["exact_match", "compare_table"],
            "result": [{"type": "vm_file"}, {"type": "open_tabs_info"}],
            "expected": [{"type": "rule"}, {}],
        },
    }
    assert ev.unsupported_features(task) == [
        "getter:open_tabs_info",
        "metric:compare_table",
        "postconfig:login",
        "setup:chrome_open_tabs",
    ]
    assert ev.unsupported_features({"config": [], "evaluator": {"func": "infeasible"}}) == []


def test_needs_internet():
    dl = {"config": [{"type": "download", "parameters": {"files": []}}], "evaluator": {"func": "x"}}
    cloud = {"config": [], "evaluator": {"func": "x", "expected": {"type": "cloud_file"}}}
    post = {"config": [], "evaluator": {"func": "x", "postconfig": [{"type": "download"}]}}
    assert ev.needs_internet(dl) and ev.needs_internet(cloud) and ev.needs_internet(post)
    assert not ev.needs_internet({"config": [{"type": "execute"}], "evaluator": {"func": "x"}})


def test_fetch_url_uses_the_cache_without_network(tmp_path):
    dest = tmp_path / "c" / "f.bin"
    os.makedirs(dest.parent)
    dest.write_bytes(b"cached")
    # an unreachable URL: only the cache can answer
    assert ev.fetch_url("http://127.0.0.1:9/none", str(dest)) == str(dest)
    assert dest.read_bytes() == b"cached"


# ------------------------------------------------------------------ as desktop-env 1.0.2 (issue 32 item 1)
# Each expected value below was checked against desktop-env 1.0.2's source (the wheel's
# desktop_env/evaluators/metrics/general.py `check_direct_json_object`, `file_contains`, and
# desktop_env/desktop_env.py `evaluate`): those metrics catch their own errors and score 0, and a list
# evaluator's `"expected": []` takes the "no expected" branch. Before, the metrics raised here.


@pytest.mark.parametrize(
    ("result", "rules"),
    [
        ("[1, 2]", {"expected": {"a": 1}}),  # a JSON list, not an object: .get fails
        ([1], {"expected": {"a": 1}}),
        ({"a": 1}, {}),  # rules without "expected"
        ({"a": 1}, {"expected": [1]}),  # a list "expected": .items() fails
        ({"a": 1}, {"expected": []}),
        ({"a": 5}, {"expect_in_result": True, "expected": {"a": "x"}}),  # str in int: a type clash
        ({"a": None}, {"expect_in_result": True, "expected": {"a": "x"}}),
        ("[1, 2]", {"expect_in_result": True, "expected": {"a": ["x"]}}),
        ({"a": [2, 1], "b": 1}, {"expected": {"a": [1, 2], "ignore_list_order": True}}),  # as desktop-env: 0
    ],
)
def test_check_direct_json_object_scores_0_where_it_cannot_compare(result, rules):
    assert ev.check_direct_json_object(result, rules) == 0.0


def test_check_direct_json_object_edge_cases_as_desktop_env():
    assert ev.check_direct_json_object("[1, 2]", {"expected": {}}) == 1.0  # no key to compare: 1 there too
    in_result = {"expect_in_result": True, "expected": {"a": "x"}}
    assert ev.check_direct_json_object({"a": ["x", "y"]}, in_result) == 1.0  # `in` a list value
    with pytest.raises(json.JSONDecodeError):  # desktop-env's json.loads sits outside its try as well
        ev.check_direct_json_object("not json", {"expected": {}})


def test_file_contains_scores_0_where_it_cannot_read_or_compare(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 \xff\xfe")  # not UTF-8
    text = write(tmp_path, "t.txt", "alpha beta")
    assert ev.file_contains(str(latin), {"expected": ["caf"]}) == 0.0
    assert ev.file_contains(text, {"expected": [1]}) == 0.0  # a non-string expected
    assert ev.file_contains(text, {"expected": 5}) == 0.0  # not iterable
    assert ev.file_contains(text, {}) == 0.0  # no expected
    assert ev.file_contains(text, {"expected": []}) == 1.0  # nothing to find: 1, as there
    assert ev.file_contains(text, {"expected": "alb"}) == 1.0  # a string iterates its characters there too


def _rule(value):
    return {"type": "rule", "rules": value}


def test_or_evaluator_moves_on_past_a_metric_that_cannot_score():
    """Issue 32's case: func [check_direct_json_object, exact_match], results [[1], "yes"], conj "or":
    OSWorld scores 1 (the JSON metric scores 0, exact_match 1); before, the evaluation raised."""
    evaluator = {
        "func": ["check_direct_json_object", "exact_match"],
        "result": [_rule([1]), _rule("yes")],
        "expected": [_rule({"expected": {"a": 1}}), _rule({"expected": "yes"})],
        "conj": "or",
    }
    assert ev.evaluate_task(evaluator, FakeDesk(), "") == 1.0
    assert ev.evaluate_task({**evaluator, "conj": "and"}, FakeDesk(), "") == 0.0
    # a metric that raises (exact_match on rules without "expected": desktop-env raises too) scores 0 and
    # the next metric decides, under "or"; alone it scores 0, as the env scores desktop-env's exception
    raising = {
        **evaluator,
        "func": ["exact_match", "exact_match"],
        "expected": [_rule({}), _rule({"expected": "yes"})],
    }
    assert ev.evaluate_task(raising, FakeDesk(), "") == 1.0
    assert (
        ev.evaluate_task(
            {"func": "exact_match", "result": _rule("yes"), "expected": _rule({})}, FakeDesk(), ""
        )
        == 0.0
    )


def test_list_evaluator_with_empty_expected_means_no_expected():
    """desktop-env: `if "expected" in evaluator and ... and evaluator["expected"]` is false for [], so
    each metric gets only its result; before, zip(strict=True) raised."""
    desk = FakeDesk(outputs={"a": "1.5", "b": "2.0"})
    evaluator = {
        "func": ["check_text_enlarged", "check_text_enlarged"],
        "result": [{"type": "vm_command_line", "command": "a"}, {"type": "vm_command_line", "command": "b"}],
        "expected": [],
        "options": [],
    }
    assert ev.evaluate_task(evaluator, desk, "") == 1.0
    desk.outputs["b"] = "1.0"
    assert ev.evaluate_task(evaluator, desk, "") == 0.0


def test_the_reason_a_metric_cannot_score_is_logged_once(caplog, tmp_path):
    import logging

    ev._reported.clear()
    evaluator = {
        "func": "check_direct_json_object",
        "result": _rule([1]),
        "expected": _rule({"expected": {"a": 1}}),
    }
    with caplog.at_level(logging.DEBUG, logger="arpo.osworld"):
        for _ in range(3):
            assert ev.evaluate_task(evaluator, FakeDesk(), "") == 0.0
    warnings = [r for r in caplog.records if r.name == "arpo.osworld" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "check_direct_json_object" in warnings[0].getMessage()
    assert "AttributeError" in warnings[0].getMessage()
    assert sum(r.name == "arpo.osworld" for r in caplog.records) == 3  # the repeats at DEBUG, not lost
