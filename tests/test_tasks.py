"""Tasks and rewards as a user brings them: verl's parquet rows and scorers, datasets folders, chat
message prompts, reasoning-gym's problems, and a held-out split. CPU, no server."""
import asyncio
import json
from pathlib import Path

import pytest

from rollout.config import RolloutConfig
from rollout.data import PromptSource, prompt_ids
from rollout.rewards import final_answer, get_reward
from rollout.tasks import dataset_items, reasoning_gym_score
from rollout.types import Sample
from trainer_bridge.backend import check_prompts, task_items, val_items
from trainer_bridge.config import TaskConfig

REAL_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "smollm2-135m-instruct"
VERL_ROWS = [{"data_source": "openai/gsm8k",
              "prompt": [{"role": "system", "content": "Think step by step."},
                         {"role": "user", "content": f"What is {i} + {i}? End with '#### <number>'."}],
              "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
              "extra_info": {"split": "train", "index": i}} for i in range(5)]


def real_tokenizer():
    if not (REAL_MODEL / "tokenizer.json").exists():
        pytest.skip("make setup-real makes it (the SmolLM2-135M-Instruct checkpoint, for its chat template)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(REAL_MODEL)


def sample_of(item: dict, response: str) -> Sample:
    """The sample the manager makes of an item (PromptSource's metadata), with a response."""
    drawn = PromptSource([item], shuffle=False).next()
    sample = Sample("g", 0, [1], drawn.prompt, drawn.label, metadata=dict(drawn.metadata))
    sample.response_text = response
    return sample


def score(spec: str, sample: Sample) -> float:
    return asyncio.run(get_reward(spec)(sample))


def test_verl_parquet_rows_are_read_with_their_messages_answer_and_metadata(tmp_path):
    import pandas as pd
    pd.DataFrame(VERL_ROWS).to_parquet(tmp_path / "train.parquet")
    items = dataset_items(str(tmp_path / "train.parquet"))
    assert len(items) == 5 and items[3]["answer"] == "6"
    assert items[3]["prompt"] == VERL_ROWS[3]["prompt"]          # the messages, no None-filled keys
    assert items[3]["data_source"] == "openai/gsm8k" and items[3]["extra_info"] == {"split": "train", "index": 3}
    meta = sample_of(items[3], "").metadata                      # what the reward sees
    assert meta["data_source"] == "openai/gsm8k" and meta["extra_info"]["index"] == 3


def test_datasets_folders_are_read_and_a_split_is_picked_by_name(tmp_path):
    import datasets
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "saved"))
    assert [it["answer"] for it in dataset_items(str(tmp_path / "saved"), "question")] == ["0", "1", "2", "3"]
    assert [it["answer"] for it in dataset_items(str(tmp_path / "saved"), "question", split="test")] == ["4", "5"]
    with pytest.raises(ValueError, match="task.split"):
        dataset_items(str(tmp_path / "saved"), "question", split="dev")
    files = tmp_path / "files"
    files.mkdir()
    for name, part in (("train", rows[:3]), ("test", rows[3:])):
        (files / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    items = dataset_items(str(files), "question")
    assert [it["prompt"] for it in items] == ["q0", "q1", "q2"] and items[0]["data_source"] == "files"
    task = TaskConfig(name="dataset", path=str(files), prompt_key="question", val_path=str(files))
    assert task.problems() == [] and [it["prompt"] for it in val_items(task, 0)] == ["q3", "q4", "q5"]


@pytest.mark.parametrize("returns", ["float", "dict", "async"])
def test_verl_compute_score_works_unchanged(tmp_path, monkeypatch, returns):
    module = f"my_verl_reward_{returns}"         # one module each: a module is imported once
    (tmp_path / f"{module}.py").write_text(f'''
def check(data_source, solution_str, ground_truth, extra_info):
    assert data_source == "openai/gsm8k" and extra_info["index"] == 3, (data_source, extra_info)
    return solution_str.split("####")[-1].strip() == ground_truth

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = check(data_source, solution_str, ground_truth, extra_info)
    return {{"float": float(right), "dict": {{"score": float(right), "acc": right}}}}["{returns}"]

async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
    return float(check(data_source, solution_str, ground_truth, extra_info))
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"{module}:compute_score" + ("_async" if returns == "async" else "")
    item = {"prompt": VERL_ROWS[3]["prompt"], "answer": "6", "data_source": "openai/gsm8k",
            "extra_info": VERL_ROWS[3]["extra_info"]}
    right, wrong = sample_of(item, "3 + 3 = 6\n#### 6"), sample_of(item, "#### 7")
    assert (score(spec, right), score(spec, wrong)) == (1.0, 0.0)
    if returns == "dict":
        assert right.metadata["reward_info"] == {"acc": True}     # verl's extra keys kept on the sample
    assert TaskConfig(name="copy", reward=spec).problems() == []


def test_rewards_of_one_sample_still_work_and_other_signatures_are_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text('''
def by_sample(sample):
    return float(sample.response_text == sample.label)

def two_args(prompt, response):
    return 1.0

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score("my_rewards:by_sample", sample_of({"prompt": "p", "answer": "a"}, "a")) == 1.0
    problems = TaskConfig(name="copy", reward="my_rewards:two_args").problems()
    assert len(problems) == 1 and "task.reward=" in problems[0] and "solution_str" in problems[0]
    with pytest.raises(ValueError, match="without 'score'"):
        score("my_rewards:no_score", sample_of({"prompt": "p", "answer": "a"}, "a"))


def test_message_prompts_go_through_the_chat_template():
    tokenizer = real_tokenizer()
    messages = VERL_ROWS[0]["prompt"]
    ids = prompt_ids(tokenizer, messages, chat=True)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    text = tokenizer.decode(ids)
    assert "Think step by step." in text and text.endswith("<|im_start|>assistant\n")
    assert prompt_ids(tokenizer, "hi", chat=True) == prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], True)
    check_prompts([{"prompt": messages}], tokenizer, RolloutConfig(max_new_tokens=16), 2048)
    with pytest.raises(ValueError, match="rollout.use_chat_template=auto"):
        check_prompts([{"prompt": "text"}, {"prompt": messages}], tokenizer,
                      RolloutConfig(max_new_tokens=16, use_chat_template="false"), 2048)


def test_message_prompts_without_a_chat_template_say_what_to_change():
    from inference_server.tiny_model import build_char_tokenizer
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has none"):
        prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], chat=False)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        prompt_ids(build_char_tokenizer(), [{"text": "hi"}], chat=True)


def test_final_answer_reads_hashes_boxes_and_the_last_number():
    assert final_answer("7 + 5 = 12\n#### 12") == "12"
    assert final_answer("so \\boxed{1,234.0} done") == "1234"
    assert final_answer("it is 3, then 4.") == "4"
    assert final_answer("#### twelve") == "twelve" and final_answer("no idea") is None


def test_reasoning_gym_items_are_scored_by_reasoning_gyms_scorer():
    pytest.importorskip("reasoning_gym", reason="make setup-real installs it")
    task = TaskConfig(name="reasoning_gym", rg_dataset="basic_arithmetic", num_prompts=20,
                      rg_config={"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"],
                                 "allow_parentheses": False, "allow_negation": False},
                      reward="rollout.tasks:reasoning_gym_score")
    assert task.problems() == []
    items = task_items(task, seed=0)
    assert len(items) == 20 and items == task_items(task, seed=0)        # reproducible from the seed
    item = items[0]
    assert item["prompt"].endswith("Give the final answer as '#### <number>'.")
    assert item["data_source"] == "reasoning_gym/basic_arithmetic"
    want = int(item["answer"])
    assert score(task.reward, sample_of(item, f"Let me add.\n#### {want}")) == 1.0
    assert score(task.reward, sample_of(item, f"\\boxed{{{want}}}")) == 1.0
    assert score(task.reward, sample_of(item, f"#### {want + 100}")) == 0.0
    assert score(task.reward, sample_of(item, "I do not know.")) == 0.0
    assert reasoning_gym_score("reasoning_gym/chain_sum", "#### 9", "9") == 1.0      # verl's call, as verl makes it


def test_held_out_items_are_disjoint_from_training_and_none_for_a_dataset(tmp_path):
    task = TaskConfig(name="add", num_digits=2, num_prompts=2000, val_size=64)
    train = {it["prompt"] for it in task_items(task, seed=0)}
    val = val_items(task, seed=0)
    assert len(val) == 64 and not train & {it["prompt"] for it in val}
    assert len({it["prompt"] for it in val}) == 64 and val == val_items(task, seed=0)
    assert val_items(TaskConfig(name="copy", num_digits=1), seed=0) == []   # all ten problems are training's
    assert val_items(TaskConfig(name="add", val_size=0), seed=0) == []
    (tmp_path / "d.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    assert val_items(TaskConfig(name="dataset", path=str(tmp_path / "d.jsonl")), seed=0) == []


def test_reasoning_gym_held_out_items_are_disjoint_from_training():
    pytest.importorskip("reasoning_gym", reason="make setup-real installs it")
    task = TaskConfig(name="reasoning_gym", num_prompts=500, val_size=32, reward="rollout.tasks:reasoning_gym_score",
                      rg_config={"max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False})
    train = {it["prompt"] for it in task_items(task, seed=3)}
    val = val_items(task, seed=3)
    assert len(val) == 32 and not train & {it["prompt"] for it in val}


@pytest.mark.parametrize("fields, named", [
    ({"name": "dataset"}, "task.path is required"),
    ({"name": "dataset", "path": "/no/such/data.jsonl"}, "task.path='/no/such/data.jsonl': no such"),
    ({"name": "dataset", "path": __file__}, "expected a .jsonl"),
    ({"val_path": "/no/such/folder"}, "task.val_path='/no/such/folder'"),
    ({"val_size": -1}, "task.val_size=-1"),
    ({"name": "arith"}, "reasoning_gym (task=arith)"),
    ({"name": "reasoning_gym", "reward": "rollout.tasks:reasoning_gym_score", "rg_dataset": "basic_arithmetc"},
     "task.rg_dataset='basic_arithmetc'"),
    ({"name": "reasoning_gym", "reward": "rollout.tasks:reasoning_gym_score", "rg_config": {"max_term": 2}},
     "task.rg_config has ['max_term']"),
    ({"name": "reasoning_gym", "reward": "rollout.tasks:reasoning_gym_score", "rg_config": {"max_digits": 0}},
     "task.rg_config="),
    ({"name": "reasoning_gym", "reward": "rollout.tasks:reasoning_gym_score",   # reasoning-gym's wrong answers
      "rg_config": {"operators": ["+", "*"], "allow_parentheses": False}}, "operators: ['+', '-']"),
    ({"name": "reasoning_gym", "reward": "rollout.tasks:reasoning_gym_score", "prompt_template": "Solve it."},
     "task.prompt_template="),
    ({"name": "reasoning_gym"}, "rollout.tasks:reasoning_gym_score"),
])
def test_bad_task_settings_are_named(fields, named, tmp_path):
    if fields.get("name") == "reasoning_gym":
        pytest.importorskip("reasoning_gym", reason="make setup-real installs it")
    if fields.get("path") == __file__:
        fields = {**fields, "path": str(tmp_path / "data.csv")}
        (tmp_path / "data.csv").write_text("prompt,answer\n")
    problems = TaskConfig(**fields).problems()
    assert any(named in p for p in problems), problems


def test_the_shipped_task_configs_compose_and_validate():
    pytest.importorskip("reasoning_gym", reason="make setup-real installs it")
    from trainer_bridge.train import compose_job
    job = compose_job(["task=arith", "model=tiny", f"model.path={REAL_MODEL}"])
    assert job.task.name == "reasoning_gym" and job.task.problems() == []
    assert job.rollout.max_new_tokens <= 192


def test_reasoning_gym_missing_names_the_make_target(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)          # import fails, as when not installed
    problems = TaskConfig(name="reasoning_gym", reward="rollout.tasks:reasoning_gym_score").problems()
    assert any("make setup-real" in p for p in problems), problems
