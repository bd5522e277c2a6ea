"""Multi-turn rollouts over a scripted turn generator: the token sequence is exactly the chat template's
rendering of the conversation, observation tokens are masked with log-prob 0, every turn has its own
seed, and budgets, turn limits, malformed calls and failing tools end or continue episodes as documented."""
import json

import pytest
import torch

from megarlhf.data.prompts import PromptExample
from megarlhf.envs.api import ENVIRONMENTS, StepResult, ToolSpec
from megarlhf.config.rollout import EnvConfig
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.rollout.multi_turn import MultiTurnRollout
from megarlhf.core.seeds import TURN_STRIDE as TURN_SEED_STRIDE
from megarlhf.learner.routing_replay import UNROUTED
from model_providers.tiny_models import make_tiny_model

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class AddEpisode:
    """add(a, b) -> "a+b", reward 0.25 per call; "boom" raises; the metadata may end the episode."""

    tools = [ToolSpec("add", "adds", {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"]})]

    def __init__(self, metadata, **kwargs):
        self.metadata = metadata

    def step(self, messages, call):
        if call.arguments["a"] == "boom":
            raise RuntimeError("the tool broke")
        return StepResult(str(call.arguments["a"] + call.arguments["b"]), reward=0.25)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Registers the test environments for this module only: a name left in the registry would show in the
    "known:" lists other tests match in the same worker process."""
    if "test_add" not in ENVIRONMENTS:
        ENVIRONMENTS.register("test_add")(AddEpisode)
    if "test_echo" not in ENVIRONMENTS:
        ENVIRONMENTS.register("test_echo")(EchoEpisode)
    yield
    ENVIRONMENTS._entries.pop("test_add", None)
    ENVIRONMENTS._entries.pop("test_echo", None)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path_factory.mktemp("mt") / "m", seed=0))


class Script:
    """A turn generator answering from ``turns[(prompt seed offset, turn number)]`` (text + the end-of-turn
    token, as a chat model stops), with log-prob -0.5 per token; records the seeds it was given."""

    def __init__(self, tokenizer, base: int, turns: dict[tuple[int, int], str], end: str = "<|im_end|>",
                 routing: bool = False):
        self.tokenizer, self.base, self.turns, self.seen = tokenizer, base, turns, []
        self.end = tokenizer.convert_tokens_to_ids(end)
        self.routing = routing  # records routing like an MoE engine: every token it ran "routed" to [turn, turn]

    def __call__(self, prompts, sampling: SamplingConfig) -> RolloutBatch:
        batch = RolloutBatch()
        for i, prompt in enumerate(prompts):
            for j in range(sampling.n):
                seed = sampling.prompt_seed(i) + j
                self.seen.append(seed)
                turn, sample = divmod(seed - self.base, TURN_SEED_STRIDE)
                text = self.turns.get((sample, turn), "The answer is 5.")
                ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end]
                stops = [k for k, t in enumerate(ids) if t in sampling.stop_token_ids]
                ids = ids[:stops[0] + 1] if stops else ids  # an engine stops on a stop token, keeping it
                finish = "stop"
                if len(ids) > sampling.max_new_tokens:
                    ids, finish = ids[:sampling.max_new_tokens], "length"
                batch.prompt_index.append(i)
                batch.prompt_ids.append(list(prompt))
                batch.response_ids.append(ids)
                batch.logprobs.append([-0.5] * len(ids))
                batch.finish_reasons.append(finish)
                if self.routing:  # the last token was sampled, never run
                    record = torch.full((len(prompt) + len(ids), 1, 2), turn, dtype=torch.int16)
                    record[-1] = UNROUTED
                    batch.routed_experts.append(record)
        return batch


def _prompts(tokenizer, count: int) -> list[PromptExample]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"What is 2 + 3? ({i})"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(PromptExample(i, text, tokenizer.encode(text, add_special_tokens=False), "5", {}, messages))
    return out


def _rollout(tokenizer, max_turns=3, budget=600, max_new_tokens=128, parser="hermes"):
    config = EnvConfig(name="test_add", max_turns=max_turns, parser=parser, timeout_s=2.0)
    return MultiTurnRollout(config, tokenizer, chat=True, max_new_tokens=max_new_tokens, budget=budget)


def test_conversation_tokens_masks_and_seeds(tokenizer):
    base = 1000
    script = Script(tokenizer, base, {(0, 0): CALL, (1, 0): CALL, (1, 1): CALL})
    rollout = _rollout(tokenizer)
    batch, metrics = rollout.run(script, _prompts(tokenizer, 1), SamplingConfig(n=2, temperature=1.0,
                                                                                 max_new_tokens=64, seed=base))
    assert batch.prompt_index == [0, 0] and batch.env_rewards == [0.25, 0.5] and batch.tool_calls == [1, 2]
    # sample 0: call, observation, answer; sample 1: two calls then the answer
    assert sorted(script.seen) == sorted([base, base + 1, base + TURN_SEED_STRIDE, base + 1 + TURN_SEED_STRIDE,
                                          base + 1 + 2 * TURN_SEED_STRIDE])
    for k, calls in enumerate((1, 2)):
        messages = [{"role": "user", "content": "What is 2 + 3? (0)"}]
        for _ in range(calls):
            messages += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"}]
        messages.append({"role": "assistant", "content": "The answer is 5."})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False).removesuffix("\n")
        assert tokenizer.decode(batch.prompt_ids[k] + batch.response_ids[k]) == rendered
        mask, lps = batch.loss_masks[k], batch.logprobs[k]
        observation = [t for t, m in zip(batch.response_ids[k], mask) if not m]
        assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" * calls
        assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(lps, mask))
    assert metrics["tools/calls"] == 3 and metrics["tools/samples_calling"] == 2 and metrics["tools/turns"] == 5


def test_an_episodes_routing_record_keeps_each_tokens_first_routing(tokenizer):
    """Routing replay (R3) with tools: a token keeps the routing of the call that first ran it (the one its
    log-prob came from); a turn's last token, sampled and never run in its own call, takes the next call's
    routing, as do the observation tokens; the episode's last token stays unrouted."""
    base = 1000
    script = Script(tokenizer, base, {(0, 0): CALL, (1, 0): CALL, (1, 1): CALL}, routing=True)
    batch, _ = _rollout(tokenizer).run(script, _prompts(tokenizer, 1), SamplingConfig(n=2, temperature=1.0,
                                                                                    max_new_tokens=64, seed=base))
    for k, record in enumerate(batch.routed_experts):
        prompt, mask = len(batch.prompt_ids[k]), batch.loss_masks[k]
        assert record.shape == (prompt + len(mask), 1, 2)
        expected, turn = [0] * prompt, 0
        for i, model_token in enumerate(mask):
            if i and model_token and not mask[i - 1]:  # the first token of the next turn
                turn += 1
            expected.append(turn if model_token else turn + 1)  # observations: first run by the next call
        for i in range(prompt, prompt + len(mask) - 1):  # a turn's last token: run first by the next call
            if mask[i - prompt] and not mask[i - prompt + 1]:
                expected[i] = expected[i] + 1
        expected[-1] = UNROUTED
        assert record[:, 0, 0].tolist() == expected, k


def test_turn_limit_budget_and_failures_end_or_continue_episodes(tokenizer):
    base = 0
    bad_json = "<tool_call>{not json}</tool_call>"
    boom = '<tool_call>{"name": "add", "arguments": {"a": "boom", "b": 1}}</tool_call>'
    script = Script(tokenizer, base, {(0, 0): CALL, (0, 1): CALL, (0, 2): CALL,  # always calls: turn limit
                                      (1, 0): bad_json, (2, 0): boom,  # both continue with an error observation
                                      (3, 0): CALL * 1})
    prompts = _prompts(tokenizer, 4)
    batch, metrics = _rollout(tokenizer, max_turns=3).run(
        script, prompts, SamplingConfig(n=1, temperature=1.0, max_new_tokens=128, prompt_seeds=(0, 1, 2, 3)))
    assert batch.tool_calls == [2, 0, 1, 1]  # the third call, in the last turn, is not run
    text = [tokenizer.decode(r) for r in batch.response_ids]
    assert text[0].count("<tool_call>") == 3 and text[0].count("tool\n5") == 2  # no observation after the last turn
    assert "error: the tool call is not valid JSON" in text[1] and text[1].endswith("The answer is 5.<|im_end|>")
    assert "error: tool 'add' raised RuntimeError: the tool broke" in text[2]
    assert metrics["tools/parse_errors"] == 1 and metrics["tools/errors"] == 1
    # a budget that leaves no room for the observation ends the episode as truncated
    tight = len(tokenizer.encode(CALL)) + 3
    batch, _ = _rollout(tokenizer, budget=tight, max_new_tokens=tight).run(
        Script(tokenizer, base, {(0, 0): CALL}), prompts[:1],
        SamplingConfig(n=1, temperature=1.0, max_new_tokens=tight, seed=base))
    assert batch.finish_reasons == ["length"] and all(batch.loss_masks[0])


def test_plain_mode_observation(tokenizer):
    script = Script(tokenizer, 0, {(0, 0): CALL}, end=tokenizer.eos_token)
    prompt = PromptExample(0, "What is 2 + 3?", tokenizer.encode("What is 2 + 3?"), "5", {})
    rollout = MultiTurnRollout(EnvConfig(name="test_add", parser="hermes"), tokenizer, chat=False,
                               max_new_tokens=64, budget=200)
    batch, _ = rollout.run(script, [prompt], SamplingConfig(n=1, temperature=1.0, max_new_tokens=64, seed=0))
    observation = [t for t, m in zip(batch.response_ids[0], batch.loss_masks[0]) if not m]
    assert tokenizer.decode(observation) == "\n<tool_response>\n5\n</tool_response>\n"
    assert json.loads(CALL.removeprefix("<tool_call>").removesuffix("</tool_call>"))["name"] == "add"


def test_turn_stops_on_the_call_end_token_and_the_template_closes_it(tmp_path):
    """With <tool_call> / </tool_call> as added tokens (as in Qwen2.5's tokenizer) a turn stops right after
    the call; the observation then starts with the end-of-turn marker the model did not write."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(
        "qwen2", tmp_path / "m", seed=0, added_tokens=("<tool_call>", "</tool_call>"), vocab_size=512))
    end_of_call = tokenizer.convert_tokens_to_ids("</tool_call>")
    script = Script(tokenizer, 0, {(0, 0): CALL + " and more words the engine never writes"})
    batch, _ = _rollout(tokenizer).run(script, _prompts(tokenizer, 1),
                                       SamplingConfig(n=1, temperature=1.0, max_new_tokens=128, seed=0))
    first_turn = batch.response_ids[0][:batch.loss_masks[0].index(0)]
    assert first_turn[-1] == end_of_call and tokenizer.decode(first_turn) == CALL
    observation = [t for t, m in zip(batch.response_ids[0], batch.loss_masks[0]) if not m]
    assert tokenizer.decode(observation) == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "What is 2 + 3? (0)"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False).removesuffix("\n")
    assert tokenizer.decode(batch.prompt_ids[0] + batch.response_ids[0]) == rendered


def test_each_episode_keeps_its_own_turn_budget(tokenizer):
    """An episode near the end of its budget cuts its own next turn, not its neighbours': sample 0 wrote a
    long first turn and has 3 tokens of room left, sample 1 a short one and plenty of room."""
    padding = "words " * 40
    turns = {(0, 0): padding + CALL, (1, 0): CALL}
    probe, _ = _rollout(tokenizer, budget=2000, max_new_tokens=512).run(
        Script(tokenizer, 0, turns), _prompts(tokenizer, 1), SamplingConfig(n=2, temperature=1.0, max_new_tokens=512, seed=0))
    after_first = [mask.index(1, mask.index(0)) for mask in probe.loss_masks]  # response tokens before turn 2
    budget = after_first[0] + 3
    batch, _ = _rollout(tokenizer, budget=budget, max_new_tokens=512).run(
        Script(tokenizer, 0, turns), _prompts(tokenizer, 1), SamplingConfig(n=2, temperature=1.0, max_new_tokens=512, seed=0))
    answer = tokenizer.encode("The answer is 5.", add_special_tokens=False)
    assert batch.response_ids[0][after_first[0]:] == answer[:3] and batch.finish_reasons[0] == "length"
    assert tokenizer.decode(batch.response_ids[1][after_first[1]:]) == "The answer is 5.<|im_end|>"
    assert batch.finish_reasons[1] == "stop"


def test_a_mistral_call_behind_a_special_token_is_seen(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: the turn is decoded with it kept (other special tokens,
    the end of turn, dropped), so the call runs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path / "m", seed=0))
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    call = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'
    batch, metrics = _rollout(tokenizer, parser="mistral").run(
        Script(tokenizer, 0, {(0, 0): call}), _prompts(tokenizer, 1),
        SamplingConfig(n=1, temperature=1.0, max_new_tokens=128, seed=0))
    assert metrics["tools/calls"] == 1 and batch.tool_calls == [1] and batch.env_rewards == [0.25]
    observation = [t for t, m in zip(batch.response_ids[0], batch.loss_masks[0]) if not m]
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_the_models_turn_is_refused_at_start_up(tmp_path):
    """A template that trims message content (as Llama-3's does) re-renders a model turn ending in a newline
    differently from the tokens the model wrote: the run stops when the rollout is built, naming it."""
    import copy

    from transformers import AutoTokenizer

    from megarlhf.core.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path / "m", seed=0))
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    assert trimming.chat_template != tokenizer.chat_template
    _rollout(tokenizer)  # the plain ChatML template passes
    with pytest.raises(ConfigError, match="rollout.env: the tokenizer's chat template cannot run multi-turn"):
        _rollout(trimming)


def test_tools_in_the_template_and_every_turn_rendered_with_them(tokenizer):
    """With a template that renders tools= (Qwen2.5-style), the prompt holds the environment's schemas and
    the whole sample is exactly the template's rendering of the conversation with the same tools=."""
    import copy

    from megarlhf.config.data import DataConfig
    from megarlhf.data import build_prompt_dataset
    from megarlhf.envs.prompting import tool_describer
    from model_providers.tiny_models import TOOLS_CHAT_TEMPLATE

    tools_tokenizer = copy.deepcopy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    config = EnvConfig(name="test_add", max_turns=3, parser="hermes", timeout_s=2.0)
    [prompt] = build_prompt_dataset([{"prompt": "What is 2 + 3?", "answer": "5"}], tools_tokenizer,
                                    DataConfig(train_path="-"), describe_tools=tool_describer(config, tools_tokenizer))
    schema = AddEpisode.tools[0].schema()
    assert prompt.tools == [schema] and json.dumps(schema) in prompt.prompt
    rollout = MultiTurnRollout(config, tools_tokenizer, chat=True, max_new_tokens=128, budget=600)
    render, seen = tools_tokenizer.apply_chat_template, []
    tools_tokenizer.apply_chat_template = lambda *args, **kwargs: seen.append(kwargs.get("tools")) or render(
        *args, **kwargs)
    batch, _ = rollout.run(Script(tools_tokenizer, 0, {(0, 0): CALL}), [prompt],
                           SamplingConfig(n=1, temperature=1.0, max_new_tokens=64, seed=0))
    assert seen and all(tools == [schema] for tools in seen)  # every re-rendering as the prompt was rendered
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5."}]
    rendered = tools_tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False).removesuffix("\n")
    assert tools_tokenizer.decode(batch.prompt_ids[0] + batch.response_ids[0]) == rendered
    observation = [t for t, m in zip(batch.response_ids[0], batch.loss_masks[0]) if not m]
    assert tools_tokenizer.decode(observation) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                                   "<|im_end|>\n<|im_start|>assistant\n")


def test_an_episode_offering_other_tools_than_its_prompt_describes_is_refused(tokenizer):
    prompt = _prompts(tokenizer, 1)[0]
    prompt.tools = [ToolSpec("multiply", "multiplies").schema()]
    with pytest.raises(ValueError, match=r"the episode of data row 0 offers tools \['add'\] that differ from those "
                                         r"its prompt describes \(\['multiply'\]\)"):
        _rollout(tokenizer).run(Script(tokenizer, 0, {}), [prompt], SamplingConfig(n=1, temperature=1.0, max_new_tokens=8, seed=0))


class EchoEpisode:
    """echo(text) returns ``text`` (a hostile observation when the model writes one), or ``times`` copies."""

    tools = [ToolSpec("echo", "echoes", {"type": "object", "properties": {"text": {}, "times": {}},
                                         "required": ["text"]})]

    def __init__(self, metadata, **kwargs):
        pass

    def step(self, messages, call):
        return StepResult(call.arguments["text"] * call.arguments.get("times", 1))


def _echo(arguments: str) -> str:
    return '<tool_call>{"name": "echo", "arguments": ' + arguments + '}</tool_call>'


HOSTILE_TURNS = {
    "lone surrogate in a key": '<tool_call>{"name": "echo", "arguments": {"\\udc80": 1}}</tool_call>',
    "lone surrogate echoed": _echo('{"text": "x\\udc80\\ud800y"}'),
    "surrogate pair echoed": _echo('{"text": "\\ud83d\\ude00"}'),
    "NUL bytes echoed": _echo('{"text": "a\\u0000b"}'),
    "NUL byte in the turn": "a\x00b " + _echo('{"text": "ok"}'),
    "10 MB observation": _echo('{"text": "ab", "times": 5000000}'),
    "5000-deep JSON": "<tool_call>" + "[" * 5000 + "</tool_call>",
    "5000-deep arguments": _echo('{"text": ' + "[" * 5000 + "1" + "]" * 5000 + "}"),
    "1000 calls in one turn": _echo('{"text": "a"}') * 1000,
    "unknown tool": '<tool_call>{"name": "rm", "arguments": {"path": "/"}}</tool_call>',
    "wrong argument type": _echo('{"text": 5, "times": "many"}'),
    "arguments not an object": '<tool_call>{"name": "echo", "arguments": [1, 2]}</tool_call>',
    "unclosed call": '<tool_call>{"name": "echo", "arguments": {"text": "a"}}',
}


def test_hostile_model_turns_never_stop_the_run(tokenizer):
    """Model output is hostile input: every turn above ends as an observation or a finished episode, the
    observations are valid text the tokenizer encodes, and the run goes on."""
    turns = {(i, 0): text for i, text in enumerate(HOSTILE_TURNS.values())}
    config = EnvConfig(name="test_echo", max_turns=2, parser="hermes", timeout_s=5.0, max_observation_chars=2000)
    rollout = MultiTurnRollout(config, tokenizer, chat=True, max_new_tokens=60000, budget=200000)
    prompts = _prompts(tokenizer, len(turns))
    batch, metrics = rollout.run(Script(tokenizer, 0, turns), prompts, SamplingConfig(
        n=1, temperature=1.0, max_new_tokens=60000, prompt_seeds=tuple(range(len(turns)))))
    assert len(batch.response_ids) == len(turns)
    for name, ids, mask in zip(HOSTILE_TURNS, batch.response_ids, batch.loss_masks):
        observation = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert observation.encode("utf-8").decode("utf-8") == observation, name  # valid text
        assert len(observation) < 2200, name
    assert metrics["tools/calls"] >= 4


def test_a_template_that_strips_reasoning_is_refused_at_start_up(tmp_path):
    """DeepSeek-R1's template keeps only what follows </think> of an assistant message: it renders a plain
    probe turn as written, so only a probe with reasoning tags sees it at start-up (not mid-run)."""
    import copy

    from transformers import AutoTokenizer

    from megarlhf.core.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path / "m", seed=0))
    stripping = copy.deepcopy(tokenizer)
    stripping.chat_template = tokenizer.chat_template.replace(
        "message['content']", "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
                              "else message['content'])")
    assert stripping.chat_template != tokenizer.chat_template
    with pytest.raises(ConfigError, match="cannot run multi-turn episodes: .* model turn is '<think>"):
        _rollout(stripping)


def test_an_episode_whose_output_breaks_the_template_ends_and_the_budget_stops_the_run(tokenizer):
    """A template that rewrites a turn by content the probe cannot foresee: that episode ends with finish
    reason "error" (counted), its neighbours go on; one failure past rollout.env.failed_episodes_budget
    stops the run with an error naming it."""
    import copy

    from megarlhf.core.errors import EpisodeFailureBudgetError

    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = tokenizer.chat_template.replace(
        "message['content']", "message['content'].replace('REWRITE', 'rewritten')")
    breaking = "REWRITE " + CALL
    turns = {(0, 0): CALL, (1, 0): breaking, (2, 0): CALL}
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=128, prompt_seeds=(0, 1, 2))
    config = EnvConfig(name="test_add", max_turns=3, parser="hermes", timeout_s=2.0, failed_episodes_budget=1)
    rollout = MultiTurnRollout(config, rewriting, chat=True, max_new_tokens=128, budget=600)
    batch, metrics = rollout.run(Script(rewriting, 0, turns), _prompts(rewriting, 3), sampling)
    assert batch.finish_reasons == ["stop", "error", "stop"] and metrics["tools/failed_episodes"] == 1.0
    assert batch.tool_calls == [1, 1, 1] and all(batch.loss_masks[1])  # its call ran; no observation was added
    with pytest.raises(EpisodeFailureBudgetError, match=r"failed_episodes_budget=1: 2 multi-turn episodes .* "
                                                        r"episode 1 \(turn 1\) ended in an error"):
        rollout.run(Script(rewriting, 0, turns), _prompts(rewriting, 3), sampling)


def test_a_repo_episode_fixes_its_bug_and_the_reward_replays_the_fix(tokenizer, tmp_path):
    """The repo environment in a rollout (its calls in worker processes): the model views the module,
    edits the buggy line, runs the visible tests (3/3 after the edit: the worker replayed it) and stops;
    the reward replays the same turns and scores the hidden tests 1.0."""
    from megarlhf.data.repo_tasks import TEMPLATES, write_tasks
    from megarlhf.isolation.sandbox import isolation
    from megarlhf.loops.rewarding import model_turns
    from megarlhf.rewards import RewardInput
    from megarlhf.rewards.repo import repo_tests

    if isolation() != "namespaces":
        pytest.skip("the code sandbox cannot isolate here")
    write_tasks(tmp_path, 1, 0, seed=5)
    row = json.loads((tmp_path / "train.jsonl").read_text())
    template = next(t for t in TEMPLATES if t.name == row["template"])
    module = next(p for p in row["files"] if p.endswith("/core.py"))
    call = lambda name, **args: '<tool_call>' + json.dumps({"name": name, "arguments": args}) + '</tool_call>'  # noqa
    turns = {(0, 0): call("view", path=module), (0, 1): call("edit", path=module, old=template.buggy,
                                                             new=template.correct),
             (0, 2): call("run_tests"), (0, 3): "Done."}
    prompt = PromptExample(0, "Fix it.", tokenizer.encode("Fix it."), "", row)
    config = EnvConfig(name="repo", max_turns=4, parser="hermes", timeout_s=10.0, num_workers=1,
                       describe_tools=False)
    rollout = MultiTurnRollout(config, tokenizer, chat=False, max_new_tokens=2000, budget=20000)
    batch, metrics = rollout.run(Script(tokenizer, 0, turns, end=tokenizer.eos_token), [prompt],
                                 SamplingConfig(n=1, temperature=1.0, max_new_tokens=2000, seed=0))
    rollout.close()
    text = tokenizer.decode(batch.response_ids[0])
    assert metrics["tools/calls"] == 3 and "1  def " in text and "edited " + module in text
    assert "3/3 tests passed" in text, text
    own = model_turns(tokenizer, batch.response_ids[0], batch.loss_masks[0])
    assert repo_tests(RewardInput("p", "r", metadata=row, turns=tuple(own))) == 1.0
