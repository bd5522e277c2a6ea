"""SFT tool transcripts (megarlhf.envs.transcripts): a transcript's SFT tokens are exactly the tokens a
multi-turn chat rollout of the same conversation produces (prompt with the tool description, the call,
the tool's message, the answer), the tool's answer comes from running the tool, the share of transcripts
follows the seeded fraction, and mismatched inputs are refused by row."""
import pytest

from megarlhf.data.prompts import build_prompt_dataset
from megarlhf.data.sft import sft_example
from megarlhf.config.data import DataConfig
from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.prompting import tool_describer
from megarlhf.envs.transcripts import transcript_rows
from megarlhf.core.errors import DataError
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.multi_turn import MultiTurnRollout
from model_providers.tiny_models import train_tiny_tokenizer

CALCULATOR = EnvConfig(name="calculator", parser="hermes", max_turns=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer().save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)  # the tiny models' ChatML template, like SmolLM2's


def _problems(count: int) -> tuple[list[dict], list[dict]]:
    problems, solutions = [], []
    for i in range(count):
        a, b, c = 10 + i, 7, 3
        prompt = f"What is ({a} + {b}) - {c}?"
        problems.append({"prompt": prompt, "answer": str(a + b - c), "expression": f"({a} + {b}) - {c}"})
        solutions.append({"prompt": prompt, "response": f"{a} + {b} = {a + b}. The answer is {a + b - c}."})
    return problems, solutions


class Replay:
    """A turn generator that writes the transcript's assistant turns, in order, as a chat model would
    (the text, then the end-of-turn token)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts, sampling: SamplingConfig) -> RolloutBatch:
        batch = RolloutBatch()
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.end]
            batch.prompt_index.append(i)
            batch.prompt_ids.append(list(prompt))
            batch.response_ids.append(ids)
            batch.logprobs.append([-0.5] * len(ids))
            batch.finish_reasons.append("stop")
        return batch


@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_a_transcript_is_token_for_token_what_the_rollout_renders(tokenizer, system_prompt):
    problems, solutions = _problems(1)
    row = transcript_rows(problems, solutions, CALCULATOR, tokenizer, tool_fraction=1.0, seed=0,
                          system_prompt=system_prompt)[0]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][0]["content"].startswith(system_prompt or "You can call the following tools")
    assert row["messages"][3]["content"] == "14"  # computed by the calculator: (10 + 7) - 3
    assert row["messages"][4]["content"] == "The answer is 14."
    sft = sft_example(row, tokenizer, DataConfig(messages_key="messages", chat_template="always"), True, "row 0")

    config = DataConfig(chat_template="always", system_prompt=system_prompt)
    prompt = build_prompt_dataset(problems, tokenizer, config, describe_tools=tool_describer(CALCULATOR, tokenizer))[0]
    rollout = MultiTurnRollout(CALCULATOR, tokenizer, chat=True, max_new_tokens=96, budget=400)
    turns = [row["messages"][2]["content"], row["messages"][4]["content"]]
    batch, metrics = rollout.run(Replay(tokenizer, turns), [prompt], SamplingConfig(n=1, temperature=1.0,
                                                                                    max_new_tokens=96))
    rolled = batch.prompt_ids[0] + batch.response_ids[0]
    assert metrics["tools/calls"] == 1 and batch.finish_reasons[0] == "stop"
    # the SFT conversation ends with the template's newline after the last end-of-turn, which a rollout
    # never generates; everything before it is the rollout's sequence
    assert sft.input_ids[:len(rolled)] == rolled
    assert tokenizer.decode(sft.input_ids[len(rolled):]) == "\n"
    # every token the rollout trains on (the model's turns) is an SFT training token too
    rollout_mask = [0] * len(batch.prompt_ids[0]) + batch.loss_masks[0]
    assert all(s >= r for s, r in zip(sft.loss_mask, rollout_mask)) and sum(rollout_mask) > 0


def test_the_share_of_transcripts_follows_the_seeded_fraction(tokenizer):
    problems, solutions = _problems(200)
    for fraction, expected in ((0.0, 0), (1.0, 200)):
        rows = transcript_rows(problems, solutions, CALCULATOR, tokenizer, fraction, seed=0)
        assert sum(len(r["messages"]) == 5 for r in rows) == expected
    rows = transcript_rows(problems, solutions, CALCULATOR, tokenizer, 0.3, seed=0)
    calls = [len(r["messages"]) == 5 for r in rows]
    assert 40 <= sum(calls) <= 80
    assert rows == transcript_rows(problems, solutions, CALCULATOR, tokenizer, 0.3, seed=0)
    assert calls != [len(r["messages"]) == 5 for r in transcript_rows(problems, solutions, CALCULATOR, tokenizer,
                                                                      0.3, seed=1)]
    worked = rows[calls.index(False)]["messages"]  # the tool is offered there too, and not used
    assert worked[0]["role"] == "system" and "calculator" in worked[0]["content"]
    assert worked[2]["content"] == solutions[calls.index(False)]["response"]


def test_mismatched_inputs_are_refused_by_row(tokenizer):
    problems, solutions = _problems(3)
    with pytest.raises(DataError, match="row 1: the problem's prompt"):
        transcript_rows(problems, [solutions[0], solutions[0], solutions[2]], CALCULATOR, tokenizer, 1.0, 0)
    wrong = [dict(p) for p in problems]
    wrong[2]["answer"] = "99"
    with pytest.raises(DataError, match=r"row 2: the tool returned '16' for '\(12 \+ 7\) - 3', but the row's "
                                        r"answer is '99'"):
        transcript_rows(wrong, solutions, CALCULATOR, tokenizer, 1.0, 0)
    wrong[2] = {**problems[2], "expression": "import os"}
    with pytest.raises(DataError, match="row 2: the tool refused the row's expression 'import os'"):
        transcript_rows(wrong, solutions, CALCULATOR, tokenizer, 1.0, 0)
    with pytest.raises(DataError, match=r"row 1 of the problems has no field 'expression'; its fields: \['answer', "
                                        r"'prompt'\]"):
        transcript_rows([problems[0], {"prompt": "p", "answer": "1"}], solutions[:2], CALCULATOR, tokenizer, 1.0, 0)
    with pytest.raises(DataError, match="row 0 of the solutions has no field 'response'"):
        transcript_rows(problems[:1], [{"prompt": problems[0]["prompt"]}], CALCULATOR, tokenizer, 1.0, 0)
    with pytest.raises(DataError, match="3 problems but 2 solutions"):
        transcript_rows(problems, solutions[:2], CALCULATOR, tokenizer, 1.0, 0)
    with pytest.raises(DataError, match=r"tool_fraction must be in \[0, 1\]"):
        transcript_rows(problems, solutions, CALCULATOR, tokenizer, 1.5, 0)


def test_a_template_that_renders_tools_itself_is_refused(tokenizer):
    renders_tools = tokenizer.chat_template.replace("{% for message", "{% if tools %}TOOLS{% endif %}{% for message", 1)
    tokenizer_with_tools = type(tokenizer).from_pretrained(tokenizer.name_or_path, chat_template=renders_tools)
    problems, solutions = _problems(1)
    with pytest.raises(DataError, match="renders tools= itself"):
        transcript_rows(problems, solutions, CALCULATOR, tokenizer_with_tools, 1.0, 0)
