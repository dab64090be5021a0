"""lm-evaluation-harness scores the same local tasks in-process on transformers (its `hf` model)
and through our HTTP API (`local-completions`, `local-chat-completions`): the oracle nobody here
wrote. The tasks are lm-eval YAML configs over JSON files generated here (Hub datasets cannot be
downloaded): multiple choice by loglikelihood over "what comes after N" items whose answers are
fixed by construction, and a short greedy chat generation task.

- SmolLM2 float32 (the shared server): per-item loglikelihoods within 1e-3, the same accuracy;
  the same generations and exact-match score;
- a tiny DeepSeek-V3-style MoE served with DP attention 2 x EP 2 against transformers on the
  same checkpoint in one process: per-item loglikelihoods within 1e-3, the same accuracy.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the test extra) is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MC_TASK, GEN_TASK = "moeserve_successor", "moeserve_chat_answers"
NUM_ITEMS = 16
TOL = 1e-3
QUESTIONS = ["What is the capital of France?", "What colour is the sky on a clear day?",
             "How many legs does a spider have?", "What is 2 + 2?",
             "Name a fruit that is yellow.", "What is the opposite of hot?"]


def successor_items(n: int, seed: int = 0) -> list[dict]:
    """'What number comes after N?' with the right answer and three wrong ones, shuffled."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        x = rng.randrange(2, 90)
        wrong = rng.sample([x - 1, x + 2, x + 10, x * 2, x - 10], 3)
        choices = [x + 1, *wrong]
        rng.shuffle(choices)
        items.append({"question": f"Question: What number comes after {x}?\nAnswer:",
                      "choices": [f" {c}" for c in choices], "answer": choices.index(x + 1)})
    return items


def write_task(folder, name: str, items: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\n{body}")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' forwards here in one thread: two, on a busy 2-core machine, wait for each
    other at every op (and the server's processes need the cores too)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """lm-eval's TaskManager over the two generated tasks only (no built-in task index)."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_task(folder, MC_TASK, successor_items(NUM_ITEMS),
               'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
               'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
               "metric_list:\n  - metric: acc\n")
    write_task(folder, GEN_TASK, [{"question": q, "answer": ""} for q in QUESTIONS],
               'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
               'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n'
               "  max_gen_toks: 12\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n")
    return TaskManager(include_path=str(folder), include_defaults=False)


def evaluate(model, task: str, tasks, **kw) -> tuple[dict, dict[int, list]]:
    """(metrics, doc id -> per-item responses)."""
    out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=tasks,
                                  log_samples=True, **kw)
    return out["results"][task], {s["doc_id"]: s["resps"] for s in out["samples"][task]}


def hf_lm(path: str):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return HFLM(pretrained=model, tokenizer=path, batch_size=16, max_length=2048)


def completions_lm(url: str, model: str, path: str) -> str:
    """lm-eval's `local-completions` model args: token-id prompts in batches of 16, echo +
    logprobs=1 + max_tokens=1 per loglikelihood request."""
    return (f"model={model},base_url={url}/v1/completions,tokenizer={path},"
            "tokenizer_backend=huggingface,tokenized_requests=True,batch_size=16,max_retries=1")


def assert_same_loglikelihoods(ours: dict[int, list], theirs: dict[int, list]) -> float:
    assert ours.keys() == theirs.keys() and len(ours) == NUM_ITEMS
    worst = 0.0
    for doc, resps in theirs.items():
        assert len(ours[doc]) == len(resps) == 4
        for (a, _), (b, _) in zip((r[0] for r in ours[doc]), (r[0] for r in resps)):
            worst = max(worst, abs(a - b))
    assert worst < TOL, worst
    return worst


@pytest.fixture(scope="module")
def smollm2():
    from moeserve.models.embedded import embedded_model_path

    path = embedded_model_path()
    return path, hf_lm(path)


def test_loglikelihoods_match_hf(smollm2_tools_server, smollm2, tasks):
    path, hf = smollm2
    ref, ref_items = evaluate(hf, MC_TASK, tasks)
    ours, our_items = evaluate("local-completions", MC_TASK, tasks, model_args=completions_lm(
        smollm2_tools_server.url, "smollm2-135m-instruct", path))
    worst = assert_same_loglikelihoods(our_items, ref_items)
    print(f"SmolLM2 float32: max |d loglikelihood| {worst:.2e}, acc {ours['acc,none']} (server) "
          f"vs {ref['acc,none']} (hf) over {NUM_ITEMS} items")
    assert ours["acc,none"] == ref["acc,none"] > 0.25  # better than chance: it measures something


def test_chat_generations_match_hf(smollm2_tools_server, smollm2, tasks):
    _, hf = smollm2
    ref, ref_items = evaluate(hf, GEN_TASK, tasks, apply_chat_template=True)
    args = (f"model=smollm2-135m-instruct,base_url={smollm2_tools_server.url}"
            "/v1/chat/completions,max_retries=1,num_concurrent=3")
    ours, our_items = evaluate("local-chat-completions", GEN_TASK, tasks, model_args=args,
                               apply_chat_template=True)
    assert our_items == ref_items and any(r[0][0].strip() for r in ref_items.values())
    assert ours["exact_match,none"] == ref["exact_match,none"]


@pytest.fixture(scope="module")
def moe_dp2_ep2(tiny_model):
    from live_server import LiveServer

    path = tiny_model("deepseek_v3")
    live = LiveServer([f"model.path={path}", "device=cpu", "model.dtype=float32",
                       "parallel.tp_size=2", "parallel.dp_size=2", "parallel.a2a_backend=a2a"],
                      env={"OMP_NUM_THREADS": "1"}).wait_healthy()
    yield live, path
    live.stop()


def test_moe_dp2_ep2_server_matches_single_process_hf(moe_dp2_ep2, tasks):
    live, path = moe_dp2_ep2
    ref, ref_items = evaluate(hf_lm(path), MC_TASK, tasks)
    name = os.path.basename(os.path.normpath(path))
    ours, our_items = evaluate("local-completions", MC_TASK, tasks,
                               model_args=completions_lm(live.url, name, path))
    worst = assert_same_loglikelihoods(our_items, ref_items)
    print(f"tiny DeepSeek-V3 dp2 x ep2: max |d loglikelihood| {worst:.2e}, acc "
          f"{ours['acc,none']} vs {ref['acc,none']}")
    assert ours["acc,none"] == ref["acc,none"]
