"""Preference pairs with the tiny Qwen2 tokenizer that ``make_tiny_model`` saves (ChatML template): ids
and masks against the pieces tokenized by hand (chat and plain), the three row formats giving the same
pair, masks only on the response's assistant turns, length filtering that drops a pair's two sides
together, and every bad-input error with its row location (``file:line``, 1-based) and key."""
from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from megarlhf.config.data import PreferenceDataConfig
from megarlhf.data.preference import build_preference_dataset, load_preference_dataset
from megarlhf.config.data import DataConfig
from model_providers.tiny_models import make_tiny_model

END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def plain_tok(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    return plain


def _ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def _runs(ids, mask):
    """The contiguous runs of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _one(rows, tok, **data):
    [pair] = build_preference_dataset(rows, tok, DataConfig(train_path="-", **data)).pairs
    return pair


def test_chat_strings_masks_exact_at_the_boundaries(tok):
    row = {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "It is 6."}
    pair = _one([row], tok, system_prompt="Be brief.")
    prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
              "<|im_start|>assistant\n")
    prompt_ids = _ids(tok, prompt)
    assert pair.prompt_len == len(prompt_ids) and pair.chosen_mask[0] == 0
    for ids, mask, response in ((pair.chosen_ids, pair.chosen_mask, row["chosen"]),
                                (pair.rejected_ids, pair.rejected_mask, row["rejected"])):
        response_ids = _ids(tok, response) + _ids(tok, "<|im_end|>") + _ids(tok, "\n")
        assert ids == prompt_ids + response_ids
        assert mask == [0] * len(prompt_ids) + [1] * len(response_ids)
        assert tok.decode(ids) == prompt + response + END


def test_row_formats_give_the_same_pair(tok):
    strings = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}
    user = {"role": "user", "content": "Name a colour."}
    conversational = {"prompt": [user], "chosen": [{"role": "assistant", "content": "Blue."}],
                      "rejected": [{"role": "assistant", "content": "Seven.", "extra": 1}]}
    whole = {"prompt": "Name a colour.", "chosen": [user, {"role": "assistant", "content": "Blue."}],
             "rejected": [user, {"role": "assistant", "content": "Seven."}]}
    pairs = [_one([row], tok) for row in (strings, conversational, whole)]
    assert pairs[0] == pairs[1] == pairs[2]


def test_only_the_responses_assistant_turns_carry_loss(tok):
    prompt = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "earlier"},
              {"role": "user", "content": "b?"}]
    row = {"prompt": prompt,
           "chosen": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "more?"},
                      {"role": "assistant", "content": "second"}],
           "rejected": "no"}
    pair = _one([row], tok, system_prompt="S")
    messages = [{"role": "system", "content": "S"}] + prompt
    assert pair.prompt_len == len(_ids(tok, tok.apply_chat_template(messages, tokenize=False,
                                                                    add_generation_prompt=True)))
    assert tok.decode(pair.chosen_ids) == tok.apply_chat_template(messages + row["chosen"], tokenize=False)
    assert [tok.decode(r) for r in _runs(pair.chosen_ids, pair.chosen_mask)] == ["first" + END, "second" + END]
    assert [tok.decode(r) for r in _runs(pair.rejected_ids, pair.rejected_mask)] == ["no" + END]
    assert pair.chosen_ids[:pair.prompt_len] == pair.rejected_ids[:pair.prompt_len]


def test_plain_mode(tok, plain_tok):
    row = {"q": "What is 2 + 3?", "good": " 5", "bad": " 6"}
    keys = PreferenceDataConfig(prompt_key="q", chosen_key="good", rejected_key="bad")
    for tokenizer, mode in ((plain_tok, "auto"), (tok, "never")):
        data = DataConfig(train_path="-", chat_template=mode, system_prompt="S")
        [pair] = build_preference_dataset([row], tokenizer, data, keys).pairs
        prompt_ids = _ids(tok, "S\n\nWhat is 2 + 3?", special=True)
        assert pair.prompt_len == len(prompt_ids)
        for ids, mask, response in ((pair.chosen_ids, pair.chosen_mask, " 5"),
                                    (pair.rejected_ids, pair.rejected_mask, " 6")):
            response_ids = _ids(tok, response) + [tok.eos_token_id]
            assert ids == prompt_ids + response_ids
            assert mask == [0] * len(prompt_ids) + [1] * len(response_ids)


def test_length_filter_drops_both_sides_together(tok, caplog):
    long = "many words here " * 20
    rows = [{"prompt": "p", "chosen": "short a", "rejected": "short b"},
            {"prompt": "p", "chosen": long, "rejected": "short b"},
            {"prompt": "p", "chosen": "short a", "rejected": long}]
    full = build_preference_dataset(rows, tok, DataConfig(train_path="-"))
    short, longest = len(full[0].chosen_ids), len(full[1].chosen_ids)
    assert max(len(full[0].rejected_ids), len(full[1].rejected_ids), len(full[2].chosen_ids)) == short < longest
    data = build_preference_dataset(rows, tok, DataConfig(train_path="-", max_sequence_length=short),
                                    source="pairs.jsonl")
    assert [p.index for p in data.pairs] == [0] and data.num_dropped == 2 and full.num_dropped == 0
    assert "pairs.jsonl: dropped 2 of 3 preference pairs" in caplog.text
    with pytest.raises(ValueError, match="no preference pair is left"):
        build_preference_dataset(rows[1:], tok, DataConfig(train_path="-", max_sequence_length=short))


def test_parquet_and_save_to_disk_sources(tok, tmp_path):
    import datasets

    rows = [{"prompt": "p1", "chosen": "a", "rejected": "b"}, {"prompt": "p2", "chosen": "c", "rejected": "c"}]
    datasets.Dataset.from_list(rows[:1]).save_to_disk(str(tmp_path / "dir"))
    [pair] = load_preference_dataset(str(tmp_path / "dir"), tok, DataConfig(train_path="-")).pairs
    assert pair == _one(rows[:1], tok)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"d\.parquet row 2: fields 'chosen' and 'rejected' give the same tokens"):
        load_preference_dataset(str(tmp_path / "d.parquet"), tok, DataConfig(train_path="-"))


GOOD = {"prompt": "p", "chosen": "yes", "rejected": "no"}
USER = {"role": "user", "content": "p"}


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "p", "chosen": "yes"}, r"the row has no field 'rejected' \(rejected_key\); its fields: \['chosen', "),
    ({"chosen": "yes", "rejected": "no"}, r"the row has no field 'prompt' \(prompt_key\)"),
    ({**GOOD, "chosen": ""}, r"field 'chosen' \(chosen_key\) is an empty response"),
    ({**GOOD, "rejected": "  \n"}, r"field 'rejected' \(rejected_key\) is an empty response"),
    ({**GOOD, "chosen": []}, r"field 'chosen' \(chosen_key\) is an empty response"),
    ({**GOOD, "rejected": [USER]}, r"field 'rejected' \(rejected_key\) is an empty response"),
    ({**GOOD, "chosen": [{"role": "assistant", "content": " "}]}, r"field 'chosen' .* is an empty response"),
    ({**GOOD, "chosen": 5}, r"field 'chosen' \(chosen_key\) must be a string or a list of chat messages, got int"),
    ({**GOOD, "rejected": None}, r"field 'rejected' \(rejected_key\) must be a string .*got NoneType"),
    ({**GOOD, "prompt": {"text": "p"}}, r"field 'prompt' \(prompt_key\) must be a string .*got dict"),
    ({**GOOD, "rejected": "yes"}, r"fields 'chosen' and 'rejected' give the same tokens; .*no preference"),
    ({**GOOD, "rejected": [{"role": "assistant", "content": "yes"}]}, r"fields .* give the same tokens"),
    ({**GOOD, "prompt": ""}, r"field 'prompt' \(prompt_key\) is an empty prompt"),
    ({**GOOD, "prompt": []}, r"field 'prompt' \(prompt_key\) is an empty prompt"),
    ({**GOOD, "chosen": [{"role": "assistant"}]}, r"field 'chosen' \(chosen_key\): message 0 is not a"),
    ({**GOOD, "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     r"field 'chosen' \(chosen_key\) is a conversation that does not begin with the prompt"),
    ({**GOOD, "rejected": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     r"field 'rejected' \(rejected_key\): the response must start and end with an assistant message"),
])
def test_errors_name_the_line_and_key(tok, tmp_path, bad, match):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")  # line 2 is blank: the bad row is line 3
    with pytest.raises(ValueError, match=rf"pairs\.jsonl:3: {match}"):
        load_preference_dataset(str(path), tok, DataConfig(train_path=str(path)))


def test_other_errors(tok, plain_tok, tmp_path):
    row = {**GOOD, "chosen": [{"role": "assistant", "content": "yes"}]}
    with pytest.raises(ValueError, match=r"row 1: field 'chosen' \(chosen_key\) is a list of chat messages, "
                                         r"but no chat template is used"):
        build_preference_dataset([row], plain_tok, DataConfig(train_path="-"))
    keys = PreferenceDataConfig(chosen_key="good")
    with pytest.raises(ValueError, match=r"row 2: the row has no field 'good' \(chosen_key\)"):
        build_preference_dataset([{**GOOD, "good": "a"}, GOOD], tok, DataConfig(train_path="-"), keys)
    with pytest.raises(ValueError, match="data.messages_key is not read for preference pairs"):
        build_preference_dataset([GOOD], tok, DataConfig(train_path="-", messages_key="messages"))
    with pytest.raises(ValueError, match="three different keys"):
        PreferenceDataConfig(rejected_key="chosen")
    with pytest.raises(ValueError, match=r"PreferenceDataConfig\.prompt_key must be a non-empty string"):
        PreferenceDataConfig(prompt_key="")
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: malformed JSON line"):
        load_preference_dataset(str(path), tok, DataConfig(train_path=str(path)))


def test_chat_sides_end_at_the_eos_a_rollout_stops_on(tok):
    """With an instruct tokenizer whose EOS closes the assistant turn (ChatML's <|im_end|>, as SmolLM2's and
    Qwen2.5-Instruct's), each side ends on that token, as a rollout does, so that a reward model trained on
    the pairs scores the token it will be read at in RL, not the newline the template writes after it."""
    instruct = copy.deepcopy(tok)
    instruct.eos_token = "<|im_end|>"
    row = {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "It is 6."}
    pair = _one([row], instruct)
    for ids, mask in ((pair.chosen_ids, pair.chosen_mask), (pair.rejected_ids, pair.rejected_mask)):
        assert ids[-1] == instruct.convert_tokens_to_ids("<|im_end|>") and mask[-1] == 1
        assert instruct.decode(ids).endswith("<|im_end|>")


# ------------------------------------------------------------------------------------- unpaired rows

def _unpaired(rows, tok, **data):
    return build_preference_dataset(rows, tok, DataConfig(train_path="-", **data), paired=False)


def test_unpaired_rows_encode_as_a_side_and_kl_rows_take_the_previous_completion(tok):
    rows = [{"prompt": "What is 2 + 3?", "completion": "5.", "label": True},
            {"prompt": "Name a colour.", "completion": "Seven.", "label": False},
            {"prompt": "Say hi.", "completion": "Hi!", "label": True}]
    examples = _unpaired(rows, tok, system_prompt="Be brief.").pairs
    pair = _one([{"prompt": "What is 2 + 3?", "chosen": "5.", "rejected": "6."}], tok, system_prompt="Be brief.")
    assert (examples[0].ids, examples[0].mask, examples[0].prompt_len) == (pair.chosen_ids, pair.chosen_mask,
                                                                           pair.prompt_len)
    assert [e.desirable for e in examples] == [True, False, True]
    for k, example in enumerate(examples):
        other = examples[k - 1]  # the first example takes the last one's completion
        p = example.prompt_len
        assert example.kl_ids == example.ids[:p] + other.ids[other.prompt_len:]
        assert example.kl_mask == [0] * p + other.mask[other.prompt_len:]
    assert tok.decode(examples[1].kl_ids).endswith("Name a colour.<|im_end|>\n<|im_start|>assistant\n5." + END)


def test_unpaired_kl_rows_are_cut_to_the_length_limit_and_long_rows_dropped(plain_tok):
    rows = [{"prompt": "a b", "completion": " c", "label": True},
            {"prompt": "d", "completion": " e f g h i j k l m n o p", "label": False},
            {"prompt": "q r s", "completion": " t", "label": False}]
    full = _unpaired(rows, plain_tok, max_sequence_length=1000).pairs
    limit = max(len(e.ids) for e in full) - 1  # the longest row is dropped
    kept = _unpaired(rows, plain_tok, max_sequence_length=limit)
    assert kept.num_dropped == 1 and [e.index for e in kept.pairs] == [0, 2]
    assert all(len(e.kl_ids) <= limit and len(e.kl_mask) == len(e.kl_ids) for e in kept.pairs)
    with pytest.raises(ValueError, match="at least two different prompts.* 1 rows with 1 prompts .* dropping 0"):
        _unpaired(rows[:1], plain_tok)


def test_kl_rows_skip_rows_of_the_same_prompt(plain_tok):
    # pairs unpaired the usual way: a prompt's desirable and undesirable rows side by side
    rows = [{"prompt": p, "completion": c, "label": label}
            for p, good, bad in (("a", " 1", " 2"), ("b", " 3", " 4"), ("c", " 5", " 6"))
            for c, label in ((good, True), (bad, False))]
    examples = _unpaired(rows, plain_tok).pairs
    completion = [e.ids[e.prompt_len:] for e in examples]
    # row k takes the completion of the nearest earlier row of another prompt: rows 0, 1 (prompt a) take
    # row 5's (c, " 6"); rows 2, 3 (prompt b) take row 1's (a, " 2"); rows 4, 5 take row 3's
    for k, source in enumerate((5, 5, 1, 1, 3, 3)):
        assert examples[k].kl_ids[examples[k].prompt_len:] == completion[source], k
    with pytest.raises(ValueError, match="at least two different prompts"):
        _unpaired(rows[:2], plain_tok)


@pytest.mark.parametrize("label, match", [(1, "must be true .* or false"), ("yes", "must be true"),
                                          (None, "must be true")])
def test_unpaired_label_errors_name_the_row_and_key(tok, tmp_path, label, match):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "p", "completion": "c", "label": True}, {"prompt": "p", "completion": "c", "label": label}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"rows.jsonl:2: field 'label' \(label_key\) {match}"):
        load_preference_dataset(str(path), tok, DataConfig(train_path=str(path)), paired=False)
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: the row has no field 'label' \(label_key\)"):
        load_preference_dataset(str(path), tok, DataConfig(train_path=str(path)), paired=False)
    with pytest.raises(ValueError, match="prompt_key, completion_key, label_key must be three different keys"):
        PreferenceDataConfig(label_key="prompt")
