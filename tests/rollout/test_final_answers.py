"""The optional episode hooks over a scripted turn generator: ``final_answer`` takes the model's final turn (also in
the last of max_turns, also a turn cut by the response budget, also in a worker process for a stateless
environment) and its reward joins the episode's; ``close`` runs once per episode when the rollout ends,
also when it fails."""
import pytest

from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.api import StepResult, stateless
from megarlhf.envs.runner import ToolRunner
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.multi_turn import MultiTurnRollout
from rollout.test_multi_turn import CALL, AddEpisode, Script, _prompts, tokenizer  # noqa: F401 (fixture)

CLOSED: list[str] = []


class AnsweringEpisode(AddEpisode):
    """AddEpisode that scores final answers: 1.0 when the answer contains the row's ground truth; a row
    whose ``silent`` field is set gives no answer (None)."""

    def final_answer(self, messages):
        if self.metadata.get("silent"):
            return None
        return StepResult("ignored", done=False, reward=float(self.metadata["ground_truth"] in messages[-1]["content"]))

    def close(self):
        CLOSED.append(self.metadata["ground_truth"])


@stateless
def answering_worker(metadata, **kwargs):
    return AnsweringEpisode(metadata)


def _rollout(tokenizer, budget=600, max_turns=3):
    config = EnvConfig(name=f"{__name__}:AnsweringEpisode", max_turns=max_turns, parser="hermes", timeout_s=2.0)
    return MultiTurnRollout(config, tokenizer, chat=True, max_new_tokens=128, budget=budget)


def test_final_answers_are_scored_by_the_environment_and_episodes_closed(tokenizer):
    CLOSED.clear()
    script = Script(tokenizer, 0, {(0, 0): "The answer is 5.", (1, 0): CALL, (1, 1): "It is 5.",
                                   (2, 0): "The answer is 6."})
    batch, metrics = _rollout(tokenizer).run(script, _prompts(tokenizer, 3),
                                             SamplingConfig(n=1, temperature=1.0, max_new_tokens=64,
                                                            prompt_seeds=(0, 1, 2)))
    assert batch.env_rewards == [1.0, 1.25, 0.0] and batch.finish_reasons == ["stop"] * 3
    assert metrics["tools/answers"] == 3 and metrics["tools/calls"] == 1
    assert CLOSED == ["5", "5", "5"]  # the prompts' ground truth reached the episodes as metadata


def test_an_answer_is_taken_in_the_last_turn_and_when_the_budget_cuts_it(tokenizer):
    long = "The answer is 5 " + "and that is all " * 40
    batch, metrics = _rollout(tokenizer, budget=12).run(
        Script(tokenizer, 0, {(0, 0): long}), _prompts(tokenizer, 1),
        SamplingConfig(n=1, temperature=1.0, max_new_tokens=12, seed=0))
    assert batch.finish_reasons == ["length"] and batch.env_rewards == [1.0] and metrics["tools/answers"] == 1
    batch, metrics = _rollout(tokenizer, budget=12).run(  # a call cut by the budget is not run
        Script(tokenizer, 0, {(0, 0): CALL}), _prompts(tokenizer, 1),
        SamplingConfig(n=1, temperature=1.0, max_new_tokens=len(tokenizer.encode(CALL)) + 1, seed=0))
    assert metrics["tools/not_run"] + metrics["tools/parse_errors"] == 1 and metrics["tools/calls"] == 0
    batch, metrics = _rollout(tokenizer, max_turns=1).run(
        Script(tokenizer, 0, {(0, 0): "5"}), _prompts(tokenizer, 1),
        SamplingConfig(n=1, temperature=1.0, max_new_tokens=12, seed=0))
    assert batch.env_rewards == [1.0] and metrics["tools/answers"] == 1


def test_episodes_are_closed_when_the_rollout_fails(tokenizer):
    CLOSED.clear()

    def broken(prompts, sampling):
        if sampling.n == 1 and CLOSED == [] and broken.turns:
            raise RuntimeError("the engine died")
        broken.turns += 1
        return Script(tokenizer, 0, {(0, 0): CALL, (1, 0): CALL})(prompts, sampling)

    broken.turns = 0
    with pytest.raises(RuntimeError, match="the engine died"):
        _rollout(tokenizer).run(broken, _prompts(tokenizer, 2), SamplingConfig(n=1, temperature=1.0,
                                                                               max_new_tokens=64,
                                                                               prompt_seeds=(0, 1)))
    assert CLOSED == ["5", "5"]


@pytest.mark.parametrize("name", [f"{__name__}:AnsweringEpisode", f"{__name__}:answering_worker"])
def test_answers_in_process_and_in_worker_processes(name):
    runner = ToolRunner(EnvConfig(name=name, parser="hermes", num_workers=2))
    handles = runner.start([{"ground_truth": "5"}, {"ground_truth": "7"}, {"ground_truth": "5", "silent": True}])
    turns = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
             for text in ("it is 5", "it is 5", "it is 5")]
    batch = runner.step(handles, turns)
    assert [(o.observation, o.done, o.reward) for o in batch.outcomes] == [(None, True, 1.0), (None, True, 0.0),
                                                                           (None, True, None)]
    assert batch.metrics["tools/answers"] == 2.0 and batch.failures == []
    runner.close()
