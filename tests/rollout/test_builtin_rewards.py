"""Relax's other built-in rewards (dapo, deepscaler, multiple_choice, gpqa, f1, random, remote_rm): hand-worked
examples per rule, the dict path of dapo through reward_key, and remote_rm against a real local HTTP server."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.rewards import builtin as br
from relax_hpc.rollout.rewards import BUILTIN_REWARDS, RewardError, RewardRunner, builtin_reward
from relax_hpc.rollout.sample import Sample, SampleStatus


def _samples(responses, label="3", metadata=None):
    return [Sample(index=i, group_index=0, prompt=f"what is 1+2? ({i})", response=r, label=label,
                   metadata=dict(metadata or {})) for i, r in enumerate(responses)]


def test_relax_names_are_in_the_table():
    for name in ("dapo", "deepscaler", "multiple_choice", "gpqa", "f1", "random", "remote_rm"):
        assert name in BUILTIN_REWARDS


# --- dapo ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, label, score, pred", [
    ("Let me think... so x = 34.\nAnswer: 34", "34", 1.0, "34"),
    ("answer : $1,000$ dollars", "1000", 1.0, "1000"),           # case-insensitive, $ / units / comma dropped
    ("Answer: 12\nwait, no.\nAnswer: 13", "13", 1.0, "13"),      # the last Answer: line
    ("Answer: x = 7", "7.0", 1.0, "7"),                          # after the last '=', label 7.0 -> 7
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: 35", "34", -1.0, "35"),                            # wrong
    ("The answer is \\boxed{34}", "34", -1.0, "[INVALID]"),      # no 'Answer:' line: DAPO does not read boxes
    ("Answer: 34" + "x" * 300, "34", -1.0, "[INVALID]"),         # only the last 300 characters are read
    ("Answer: 3.5", "3.5", -1.0, "3.5"),                         # label 3.5 -> int 3
])
def test_dapo(response, label, score, pred):
    assert br.dapo_reward(response, label) == {"score": score, "acc": 1.0 if score > 0 else 0.0, "pred": pred}


def test_dapo_label_must_be_an_integer():
    with pytest.raises(ValueError, match=r"dapo: the label 'x\+1' is not an integer"):
        br.dapo_reward("Answer: x+1", "x+1")


def test_dapo_through_the_runner_reads_score():
    runner = RewardRunner(Recipe(rollout=RolloutConfig(rm_type="dapo", reward_key="score")))
    group = _samples(["Answer: 3", "Answer: 4"])
    assert asyncio.run(runner.score_group(group)) == []
    assert group[0].reward == {"score": 1.0, "acc": 1.0, "pred": "3"}
    assert group[1].reward == {"score": -1.0, "acc": 0.0, "pred": "4"}


def test_dapo_without_reward_key_is_a_named_failure():
    runner = RewardRunner(Recipe(rollout=RolloutConfig(rm_type="dapo")))
    with pytest.raises(RewardError, match="rollout.reward_key"):
        asyncio.run(runner.score_group(_samples(["Answer: 3"])))


def test_a_scalar_builtin_is_still_wrapped_under_reward_key():
    runner = RewardRunner(Recipe(rollout=RolloutConfig(rm_type="math", reward_key="score")))
    group = _samples(["\\boxed{3}"])
    asyncio.run(runner.score_group(group))
    assert group[0].reward == {"score": 1.0}


# --- deepscaler ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, label, want", [
    ("<think>maybe \\boxed{5}</think> so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>a</think> x</think> \\boxed{42}", "42", 1.0),            # after the LAST </think>
    ("question ###Response the answer is \\boxed{7}", "7", 1.0),
    ("<think>\\boxed{42}</think> I am not sure", "42", 0.0),          # the box is inside the reasoning
    ("the answer is \\boxed{42}", "42", 0.0),                         # no </think>, no ###Response
    ("<think>...</think> \\boxed{41}", "42", 0.0),                    # wrong
    ("<think>...</think> \\boxed{42}", "", 0.0),                      # empty label
    ("<think>...</think> \\boxed{42}", "so \\boxed{42}", 1.0),        # a boxed label is reduced to its box
    ("<think>...</think> \\boxed{42}", 42, 1.0),
])
def test_deepscaler(response, label, want):
    assert builtin_reward("deepscaler", response, label) == want


# --- multiple_choice -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, label, want", [
    ("I pick <answer> B </answer>", "<answer>B</answer>", 1.0),
    ("<answer>B</answer>", "B", 1.0),                                # a bare label counts whole
    ("<answer>A</answer> or <answer>B</answer>", "B", 0.0),         # the first tag
    ("<answer>b</answer>", "B", 0.0),                                # case-sensitive
    ("B", "B", 1.0),
    ("The answer is B", "B", 0.0),
    ("<answer>C</answer>", None, 0.0),
])
def test_multiple_choice(response, label, want):
    assert builtin_reward("multiple_choice", response, label) == want


# --- gpqa ----------------------------------------------------------------------------------------------------

CHOICES = {"choices": ["Helium", "Neon", "Argon", "Krypton"]}


@pytest.mark.parametrize("response, label, meta, want", [
    ("The answer is C", "C", None, 1.0),
    ("<think>The answer is A?</think> Final answer: C", "C", None, 1.0),   # after </think>
    ("Answer: B", "C", None, 0.0),
    ("I think D is correct", 3, CHOICES, 1.0),                              # int label: the option index
    ("answer: D", "Krypton", CHOICES, 1.0),                                 # label = an option's text
    ("answer: E", "C", CHOICES, 0.0),                                       # E is not valid: no letter; no text
    ("it must be argon", "C", CHOICES, 1.0),                                # no letter: the option's text
    ("the answer is B", "B", {"correct_letter": "c"}, 0.0),                 # metadata wins over the label
    ("", "C", None, 0.0),
])
def test_gpqa(response, label, meta, want):
    assert builtin_reward("gpqa", response, label, meta) == want


# --- f1, random ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, label, want", [
    ("The Eiffel Tower!", "eiffel tower", 1.0),
    ("paris france", "paris", pytest.approx(2 / 3)),   # P 1/2, R 1
    ("yes", "no", 0.0),
    ("yes it is", "yes", 0.0),                         # a yes/no label must be matched exactly
    ("no", "No.", 1.0),
    ("", "paris", 0.0),
    ("london", "paris", 0.0),
])
def test_f1(response, label, want):
    assert builtin_reward("f1", response, label) == want


def test_random_is_0_or_1_and_both_happen():
    seen = {builtin_reward("random", "x", "y") for _ in range(200)}
    assert seen == {0.0, 1.0}


# --- remote_rm -----------------------------------------------------------------------------------------------

class _Server:
    """A local HTTP reward server: fails the first ``fail`` requests with 503, then answers ``answer``; with
    ``hang`` it never answers. Records every JSON body it got."""

    def __init__(self, answer=1.0, fail=0, hang=False, status=503):
        self.bodies, self.answer, self.fail, self.hang, self.status = [], answer, fail, hang, status
        self.release = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if outer.hang:
                    outer.release.wait(30)
                    return
                if len(outer.bodies) <= outer.fail:
                    self.send_response(outer.status)
                    self.end_headers()
                    return
                data = json.dumps(outer.answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    made = []

    def make(**kw):
        made.append(_Server(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(br, "REMOTE_RM_BACKOFF_S", 0.01)
    monkeypatch.setattr(br, "REMOTE_RM_BACKOFF_CAP_S", 0.02)


def _runner(url, **kw):
    return RewardRunner(Recipe(rollout=RolloutConfig(rm_type="remote_rm", rm_url=url, **kw)))


def test_remote_rm_posts_prompt_response_label(server):
    srv = server(answer=0.75)
    group = _samples(["It is 3."], label="3")
    assert asyncio.run(_runner(srv.url).score_group(group)) == []
    assert group[0].reward == 0.75
    assert srv.bodies == [{"prompt": "what is 1+2? (0)", "response": "It is 3.", "label": "3"}]


def test_remote_rm_dict_answer_through_reward_key(server):
    srv = server(answer={"score": 1.0, "acc": 1.0})
    group = _samples(["3"])
    asyncio.run(_runner(srv.url, reward_key="score").score_group(group))
    assert group[0].reward == {"score": 1.0, "acc": 1.0}


def test_remote_rm_retries_a_server_that_fails_twice(server):
    srv = server(answer=1.0, fail=2)
    group = _samples(["3"])
    assert asyncio.run(_runner(srv.url).score_group(group)) == []
    assert group[0].reward == 1.0 and len(srv.bodies) == 3


def test_remote_rm_gives_up_after_10_attempts_naming_the_url(server):
    srv = server(fail=100, status=500)
    group = _samples(["3"])
    with pytest.raises(RewardError) as e:
        asyncio.run(_runner(srv.url).score_group(group))
    assert len(srv.bodies) == 10
    assert f"POST {srv.url} failed 10 times; last error: HTTP 500" in str(e.value)


def test_remote_rm_that_never_answers_is_bounded_by_reward_timeout_s(server):
    srv = server(hang=True)
    group = _samples(["3"])
    t0 = time.monotonic()
    failures = asyncio.run(_runner(srv.url, reward_timeout_s=0.5, reward_error_policy="skip").score_group(group))
    assert time.monotonic() - t0 < 5
    assert len(failures) == 1 and group[0].reward == 0.0 and group[0].status == SampleStatus.FAILED
    text = group[0].metadata["reward_error"]
    assert f"POST {srv.url} gave no reward within 0.5 s (rollout.reward_timeout_s)" in text


def test_remote_rm_unreachable_names_the_url():
    url = "http://127.0.0.1:9/score"  # discard port: nothing listens
    with pytest.raises(br.RemoteRewardError, match=r"POST http://127\.0\.0\.1:9/score failed 2 times"):
        asyncio.run(br.remote_rm(url, "p", "r", "l", timeout_s=10, attempts=2))


def test_remote_rm_without_url_in_metadata_rm_type_fails_clearly():
    runner = RewardRunner(Recipe(rollout=RolloutConfig(rm_type="math")))
    with pytest.raises(RewardError, match="rollout.rm_url"):
        asyncio.run(runner.score_group(_samples(["3"], metadata={"rm_type": "remote_rm"})))


def test_boxed_remote_rm_is_refused_as_a_plain_scorer():
    with pytest.raises(TypeError, match="remote_rm"):
        builtin_reward("boxed_remote_rm", "\\boxed{3}", "3")
