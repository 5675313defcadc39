"""rl.rewards.judge against a local OpenAI-compatible stand-in server, and reward `args` checked at config load."""

import http.server
import json
import threading
import time

import numpy as np
import pytest

from rl.config import ConfigError, load_config
from rl.config.schema import RewardSpec
from rl.data import PromptRecord
from rl.rewards import registry
from rl.rewards.judge import prompt_text, reply_score


class _Judge(http.server.BaseHTTPRequestHandler):
    """Answers a chat completion: 'Score: 9' where the graded response contains the reference answer, else
    'Score: 1'; replies chosen by the test through the server's `override`; records each request's body."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        status = self.server.statuses.pop(0) if self.server.statuses else self.server.status
        if status != 200:
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b'{"error": "model not found"}' if status == 404 else b'{"error": "busy"}')
            return
        if self.server.drip:  # a server that sends its reply a byte at a time
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(50):
                    if self.server.stopping.is_set():
                        return
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up, as the test wants: not an error
                pass
            return
        user = body["messages"][0]["content"]
        response = user.split("Response:\n")[1]
        answer = user.split("Reference answer:\n")[1].split("\n")[0]
        text = self.server.override or f"Looks {'right' if answer in response else 'wrong'}.\nScore: " \
                                       f"{9 if answer in response else 1}"
        if self.server.parts:  # content as a list of parts, as some OpenAI-compatible servers answer
            text = [{"type": "text", "text": text[:5]}, {"type": "image_url"}, {"type": "text", "text": text[5:]}]
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """The stand-in, serving in threads of its own until the test ends: its close waits for every request's thread.
    A dripping reply's thread used to outlive its test by seconds and print its broken pipe's traceback during a later
    test; Python 3.11's traceback parses the source line for its carets, and CPython 3.11 keeps ast.parse's recursion
    depth in state shared by all threads, so test_layers' ast.parse in the main thread failed with "SystemError: AST
    constructor recursion depth mismatch (before=141, after=31)" (the suite, 2026-12-06)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    srv.daemon_threads = False  # server_close joins the request threads
    srv.requests, srv.override, srv.status, srv.statuses, srv.drip, srv.parts = [], None, 200, [], False, False
    srv.stopping = threading.Event()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)  # fast shutdown
    thread.start()
    yield srv
    srv.stopping.set()
    srv.shutdown()
    srv.server_close()
    assert not [t for t in threading.enumerate() if "process_request" in t.name], "a request's thread outlived the test"


def _spec(srv, **args):
    return RewardSpec("judge", 1.0, 10.0, workers=2,
                      args={"url": f"http://127.0.0.1:{srv.server_port}/v1", "model": "judge-7b", **args})


def test_the_judge_scores_each_sample_from_its_own_prompt_and_answer(server):
    records = [PromptRecord([{"role": "user", "content": f"What is {i} + {i}?"}], str(2 * i), {}) for i in range(4)]
    completions = ["It is 0.", "It is 3.", "It is 4.", "No idea."]
    total, failures, parts = registry.score_specs((_spec(server, max_score=9),), completions,
                                                  [r.answer for r in records], [False] * 4, records)
    assert failures == 0
    np.testing.assert_allclose(parts["judge"], [1.0, 1 / 9, 1.0, 1 / 9], rtol=1e-6)
    paths = {p for p, _, _ in server.requests}
    assert paths == {"/v1/chat/completions"} and len(server.requests) == 4
    bodies = sorted(json.dumps(b) for _, _, b in server.requests)
    assert all('"model": "judge-7b"' in b and '"temperature": 0.0' in b for b in bodies)
    assert any("user: What is 2 + 2?" in b and "It is 4." in b for b in bodies)  # the messages, as text


def test_a_reply_without_a_score_an_http_error_and_a_missing_prompt_are_failures_not_zeros(server):
    server.override = "I think it is fine."
    records = [PromptRecord("q", "a", {})]
    _, failures, _ = registry.score_specs((_spec(server),), ["a"], ["a"], [False], records)
    assert failures == 1
    s = registry.score_components([("judge", 1.0)], ["a"], ["a"], sample_kwargs=[_spec(server).args],
                                  sample_context=[{"prompt": "q"}])
    assert s.num_failures == 1 and "no 'Score: N'" in s.errors["judge"][0]
    server.override, server.status = None, 404
    s = registry.score_components([("judge", 1.0)], ["a"], ["a"], sample_kwargs=[_spec(server).args],
                                  sample_context=[{"prompt": "q"}])
    assert s.num_failures == 1 and "HTTP 404" in s.errors["judge"][0] and "model not found" in s.errors["judge"][0]
    server.status = 200
    s = registry.score_components([("judge", 1.0)], ["a"], ["a"], sample_kwargs=[_spec(server).args])
    assert s.num_failures == 1 and "prompt" in s.errors["judge"][0]  # a caller without records


def test_the_api_key_comes_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("M3JAX_TEST_JUDGE_KEY", "sk-test")
    registry.score_specs((_spec(server, api_key_env="M3JAX_TEST_JUDGE_KEY"),), ["a"], ["a"], [False],
                         [PromptRecord("q", "a", {})])
    headers = server.requests[-1][1]
    assert headers["Authorization"] == "Bearer sk-test"


@pytest.mark.parametrize("reply, want", [("Score: 7", 0.7), ("**Score:** 10", 1.0), ("score = 2.5\n", 0.25),
                                         ("Score: 3 ... on reflection, Score: 8", 0.8)])
def test_reply_score(reply, want):
    assert reply_score(reply, 10) == pytest.approx(want)


@pytest.mark.parametrize("reply", ["Score: 11", "Score: -3", "**Score:** -2", "Score: 1e9"])
def test_reply_score_out_of_range_is_an_error(reply):
    # a negative or exponent-form score was read as its digits alone: 'Score: -3' graded 0.3, 'Score: 1e9' 0.1
    with pytest.raises(ValueError, match="outside"):
        reply_score(reply, 10)


def test_prompt_text_of_chat_messages():
    assert prompt_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) == \
        "system: Be brief.\n\nuser: Hi"


@pytest.mark.parametrize("args, says", [
    ({"url": "http://h:8000/v1"}, "missing a required argument: 'model'"),
    ({"url": "http://h:8000/v1", "model": "m", "modle": "m"}, "unexpected keyword argument 'modle'"),
    ({"url": "h:8000/v1", "model": "m"}, "not an http(s) URL"),
    ({"url": "http://h/v1", "model": "m", "template": "Grade {completion}"}, "does not name ['prompt']"),
    ({"url": "http://h/v1", "model": "m", "template": "{prompt} {completion} {question}"}, "names ['question']"),
    ({"url": "http://h/v1", "model": "m", "template": "{prompt} {completion} {"}, "cannot be filled"),
    ({"url": "http://h/v1", "model": "m", "max_score": 0}, "max_score 0"),
    # these passed the load, then failed every sample (or, max_score inf, graded every reply a silent 0)
    ({"url": "http://h/v1", "model": "m", "template": "{prompt:d} {completion}"}, "Unknown format code 'd'"),
    ({"url": "http://h/v1", "model": "m", "max_tokens": "lots"}, "max_tokens 'lots' is not an integer >= 1"),
    ({"url": "http://h/v1", "model": "m", "temperature": -1}, "temperature -1 is not a finite number >= 0"),
    ({"url": "http://h/v1", "model": "m", "api_key_env": "M3JAX_NO_SUCH_VARIABLE"}, "names no variable"),
    ({"url": "http://h/v1", "model": "m", "timeout_s": 5}, "timeout_s is passed by the run itself"),
])
def test_bad_judge_args_are_refused_at_load_naming_the_problem(args, says):
    reward = json.dumps([{"name": "judge", "weight": 1.0, "args": args}])
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", [f"reward={reward}"])
    assert "reward[0].args" in str(e.value) and says in str(e.value)
    # the keywords' own values refused: no "allowed: its keyword parameters", which sent the user to the wrong fix
    signature = any(s in says for s in ("missing a required", "unexpected keyword", "passed by the run itself"))
    assert ("cannot be called with them" in str(e.value)) == signature, str(e.value)
    assert ("allowed: its keyword parameters" in str(e.value)) == signature, str(e.value)


def test_an_infinite_max_score_is_refused_at_load():
    # N / inf graded every reply 0, a silent 0 rather than a counted failure
    with pytest.raises(ConfigError, match=r"max_score inf is not a finite number > 0"):
        load_config("configs/tiny.yaml",
                    ['reward=[{name: judge, args: {url: "http://h/v1", model: m, max_score: .inf}}]'])


def test_args_of_a_custom_reward_are_passed_and_checked():
    def graded(completion, answer, *, scale, truncated=False):
        return scale * (completion == answer)

    try:
        registry.register_reward("_test_scaled", mode="inline")(graded)
        cfg = load_config("configs/tiny.yaml", ['reward=[{name: _test_scaled, weight: 1.0, args: {scale: 0.5}}]'])
        total, failures, _ = registry.score_specs(cfg.reward, ["1", "2"], ["1", "1"], [False, False])
        assert failures == 0 and total.tolist() == [0.5, 0.0]
        with pytest.raises(ConfigError, match=r"reward\[0\].args = \{\}: reward ._test_scaled. cannot be called "
                                              r"with them \(missing a required argument: 'scale'; its parameters "
                                              r"for args: scale\)"):
            load_config("configs/tiny.yaml", ['reward=[{name: _test_scaled, weight: 1.0}]'])
        with pytest.raises(ConfigError, match=r"eval.reward\[0\].args"):
            load_config("configs/tiny.yaml", ['eval.reward=[{name: _test_scaled, args: {scal: 1}}]'])
    finally:
        registry._REGISTRY.pop("_test_scaled", None)


@pytest.mark.parametrize("name", ["math_verify", "code_tests", "code_tests_frac", "format", "copy_digits",
                                  "exact_digits"])
def test_a_misspelled_arg_of_a_built_in_reward_is_refused_at_load(name):
    # every built-in took **kw, so {timout_s: 1} (or any typo) passed the load and was dropped at each call
    with pytest.raises(ConfigError, match=rf"reward\[0\].args = \{{\"timout_s\": 1\}}: reward \"{name}\" cannot be "
                                          r"called with them \(got an unexpected keyword argument 'timout_s'"):
        load_config("configs/tiny.yaml", [f"reward=[{{name: {name}, args: {{timout_s: 1}}}}]"])


@pytest.mark.parametrize("args, says", [
    ("{since: 2024-01-01}", "reward[0].args.since = datetime.date(2024, 1, 1): a date"),
    ("{tests: [1, {blob: !!binary aGk=}]}", "reward[0].args.tests[1].blob = b'hi': a bytes"),
    ("{tags: !!set {a}}", "reward[0].args.tags = {'a'}: a set"),
    ("{table: {1: one}}", "its key 1 is not a string"),
])
def test_args_that_json_cannot_record_are_refused_at_load(args, says):
    # a reward taking **kw accepts any args, so only this check stands between such args and the trainer, which
    # records the config as JSON in every checkpoint and stopped there with a TypeError traceback after building the
    # model
    def takes_any(completion, answer, **kw):
        return 0.0

    try:
        registry.register_reward("_test_takes_any", mode="inline")(takes_any)
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny.yaml", [f"reward=[{{name: _test_takes_any, weight: 1.0, args: {args}}}]"])
        assert says in str(e.value) and "JSON record" in str(e.value)
        load_config("configs/tiny.yaml",
                    ['reward=[{name: _test_takes_any, weight: 1.0, args: {since: "2024-01-01", n: [1, .5]}}]'])
    finally:
        registry._REGISTRY.pop("_test_takes_any", None)


def _one(server, **args):
    """The judge's score of one right answer, called directly (no registry supervision)."""
    from rl.rewards.judge import judge
    return judge("It is 4.", "4", "What is 2 + 2?", url=f"http://127.0.0.1:{server.server_port}/v1", model="m",
                 max_score=9, **args)


def test_a_rate_limited_or_busy_judge_is_asked_again_and_a_refusal_is_not(server):
    server.statuses = [429, 503]
    assert _one(server, timeout_s=10) == 1.0 and len(server.requests) == 3
    server.statuses = [429, 429, 429]
    with pytest.raises(RuntimeError, match="HTTP 429"):
        _one(server, timeout_s=10, retries=1)  # 1 retry: the second 429 is the answer
    server.requests.clear()
    server.statuses = [404]
    with pytest.raises(RuntimeError, match="HTTP 404"):
        _one(server, timeout_s=10)
    assert len(server.requests) == 1


def test_a_reply_that_drips_in_ends_at_the_limit_not_when_the_server_stops(server):
    """urlopen's timeout bounds each socket read: a byte every 0.1 s kept the request alive for all 5 s."""
    server.drip = True
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="more than 0.5 s"):
        _one(server, timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0


def test_content_as_a_list_of_parts_is_read_and_no_text_is_a_named_failure(server):
    server.parts = True
    assert _one(server, timeout_s=10) == 1.0
    from rl.rewards.judge import reply_text
    with pytest.raises(ValueError, match="holds no text"):
        reply_text({"choices": [{"message": {"content": None, "tool_calls": []}}]})


def test_a_reply_cut_at_max_tokens_is_a_failure_not_its_provisional_score():
    """A thinking judge out of tokens mid-reasoning ("a first guess would be Score: 9, but") was graded 0.9."""
    from rl.rewards.judge import reply_text
    cut = {"choices": [{"finish_reason": "length", "message": {"content": "<think>A first guess: Score: 9, but"}}]}
    with pytest.raises(ValueError, match="cut at max_tokens"):
        reply_text(cut)
    cut["choices"][0]["finish_reason"] = "stop"
    assert reply_score(reply_text(cut), 10) == pytest.approx(0.9)


def test_a_subscore_is_not_the_score():
    assert reply_score("Subscore: 2. Final_score: 8", 10) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no 'Score: N'"):
        reply_score("Subscore: 2", 10)
