"""`model.quantization` on CPU: FP8 checkpoints dequantize exactly by default (auto); `fp8`
keeps the weights resident in e4m3 (torch reference matmuls on CPU) — quantized at load from a
float checkpoint into exactly the blocks `make_tiny --fp8` writes, and loaded as stored from an
FP8 one, where it equals the dequantized model; on the Triton path (interpreter) it stays within
FP8 tolerance. Projection dims are not multiples of 128."""

from __future__ import annotations

import pytest
import torch
from parity import make_runner, prefill_logits, prompts_of_lengths, rel_err

from moeserve.kernels.fp8_format import FP8
from moeserve.layers.fp8_linear import Fp8Linear, Fp8MergedLinear
from moeserve.layers.fp8_moe import Fp8MoEExperts
from moeserve.layers.linear import Linear
from moeserve.models.weight_bytes import weight_bytes
from moeserve.tools.make_tiny import make_tiny

FP8_ON = ["model.quantization=fp8"]
DIMS = dict(intermediate_size=200)  # the dense MLP: one full and one partial row block


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float32 checkpoint, the same model's FP8 checkpoint), tiny DeepSeek-V3."""
    d = tmp_path_factory.mktemp("fp8q")
    return (make_tiny("deepseek_v3", str(d / "f32"), seed=3, **DIMS),
            make_tiny("deepseek_v3", str(d / "fp8"), seed=3, fp8=True, **DIMS))


def _fp8_params(model) -> dict[str, torch.Tensor]:
    """Every FP8 weight (as bytes) and block scale of a model."""
    return {n: p.view(torch.uint8) if p.dtype == FP8 else p for n, p in model.named_parameters()
            if p.dtype == FP8 or n.endswith("scale_inv")}


def test_quantize_at_load_writes_the_checkpoint_blocks(checkpoints):
    f32, fp8 = checkpoints
    quantized = make_runner(f32, FP8_ON).model
    stored = make_runner(fp8, FP8_ON).model  # e4m3 tensors kept as stored
    mods = dict(quantized.named_modules())
    assert isinstance(mods["model.layers.0.mlp.gate_up_proj"], Fp8MergedLinear)
    assert isinstance(mods["model.layers.1.self_attn.q_b_proj"], Fp8Linear)
    assert isinstance(mods["model.layers.1.mlp.experts"], Fp8MoEExperts)
    assert isinstance(mods["model.layers.1.self_attn.kv_b_proj"], Fp8Linear)  # per-head GEMVs
    assert type(mods["lm_head"]) is Linear and mods["lm_head"].weight.dtype == torch.float32
    a, b = _fp8_params(quantized), _fp8_params(stored)
    assert a.keys() == b.keys() and len(a) > 20
    for name in a:
        assert torch.equal(a[name], b[name]), name
    mine = _fp8_params(make_runner(fp8, ["model.quantization=auto"]).model)
    assert mine == {}  # auto on CPU: dequantized at load


def test_fp8_resident_equals_dequantized_and_is_close_to_float(checkpoints):
    f32, fp8 = checkpoints
    runners = {"float": make_runner(f32), "quantized": make_runner(f32, FP8_ON),
               "dequantized": make_runner(fp8), "resident": make_runner(fp8, FP8_ON)}
    prompts = prompts_of_lengths([6, 13], runners["float"].hf_config.vocab_size, seed=4)
    logits = {k: prefill_logits(r, prompts) for k, r in runners.items()}
    for a, b in zip(logits["resident"], logits["dequantized"]):
        assert rel_err(a, b) < 1e-5  # the same dequantized weights, as a reference matmul
    for a, b in zip(logits["quantized"], logits["float"]):
        assert 1e-4 < rel_err(a, b) < 0.1  # weights rounded to e4m3 (measured 0.034)
    bytes_fp8 = weight_bytes(runners["resident"].model)
    bytes_f32 = weight_bytes(runners["float"].model)
    assert bytes_fp8["experts"] < 0.27 * bytes_f32["experts"]  # 1 byte vs 4, plus scales
    assert bytes_fp8["embeddings"] == bytes_f32["embeddings"]


def test_fp8_triton_path_in_the_interpreter_within_fp8_tolerance(checkpoints):
    """Every FP8 layer on its Triton path (activations quantized per token and 128 channels):
    the logits stay within FP8 tolerance of the reference path (measured ~0.035)."""
    runner = make_runner(checkpoints[1], FP8_ON)
    prompts = prompts_of_lengths([5, 11], runner.hf_config.vocab_size, seed=6)
    ref = prefill_logits(runner, prompts)
    layers = [m for m in runner.model.modules() if isinstance(m, (Fp8Linear, Fp8MoEExperts))]
    for m in layers:
        m.backend = "triton"
    out = prefill_logits(runner, prompts)
    clear = 0
    for a, b in zip(out, ref):
        assert 1e-4 < rel_err(a, b) < 0.1
        for pos in range(a.shape[0]):  # where the reference's choice is clear, it is kept
            top2 = b[pos].topk(2).values
            if float(top2[0] - top2[1]) > 2 * float((a[pos] - b[pos]).abs().max()):
                clear += 1
                assert int(a[pos].argmax()) == int(b[pos].argmax())
    assert clear > 0


def test_fp8_on_qwen3_moe_keeps_the_router_and_loads_merged_qkv(tiny_model):
    path = tiny_model("qwen3_moe")
    runner = make_runner(path, FP8_ON)
    mods = dict(runner.model.named_modules())
    assert isinstance(mods["model.layers.0.self_attn.qkv_proj"], Fp8MergedLinear)
    assert type(mods["model.layers.0.mlp.gate"]) is Linear  # the router
    prompts = prompts_of_lengths([7, 12], runner.hf_config.vocab_size, seed=2)
    for a, b in zip(prefill_logits(runner, prompts), prefill_logits(make_runner(path), prompts)):
        assert 1e-4 < rel_err(a, b) < 0.1


def test_dummy_weights_quantized_at_load(tiny_model):
    runner = make_runner(tiny_model("deepseek_v3"), [*FP8_ON, "model.load_format=dummy"])
    experts = runner.model.model.layers[1].mlp.experts
    w13, w2 = experts.stacked_weights(torch.float32)
    assert abs(float(w13.std()) - 0.02) < 2e-3 and abs(float(w2.std()) - 0.02) < 2e-3
    q_a = runner.model.model.layers[0].self_attn.fused_qkv_a_proj
    assert abs(float(q_a.dequantized().std()) - 0.02) < 2e-3
    prompts = prompts_of_lengths([4], runner.hf_config.vocab_size, seed=1)
    assert torch.isfinite(prefill_logits(runner, prompts)[0]).all()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fp8_experts_rebalanced_live_keep_greedy_outputs(checkpoints):
    """dp2 x ep2 with 2 redundant experts and a live EPLB rebalance every 4 steps, FP8 experts
    moving with their scales between the two ranks: greedy tokens equal one process."""
    from moeserve import Engine

    fp8 = checkpoints[1]
    prompts = prompts_of_lengths([5, 9, 14, 7, 11, 6], 30000, seed=8)
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    base = ["device=cpu", "model.dtype=float32", *FP8_ON]
    with Engine(fp8, base) as eng:
        expected = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                            sampling_params=greedy)]
    dp = [*base, "parallel.tp_size=2", "parallel.dp_size=2", "eplb.num_redundant_experts=2",
          "eplb.record_mode=stat", "eplb.rebalance_interval=4"]
    with Engine(fp8, dp) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
        ranks = eng.server_info()
    assert outs == expected
    assert all(r.get("eplb_rebalances", 0) >= 2 for r in ranks), ranks


def _copy_with(src: str, dst: str, tensors: dict, config_update: dict | None = None) -> str:
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_update or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_auto_on_cuda_keeps_exactly_what_the_checkpoint_stores_in_fp8(checkpoints, tmp_path,
                                                                      monkeypatch):
    """The auto plan as CUDA resolves it (Triton FP8 kernels, here in the interpreter): weights
    the checkpoint stores in float stay float; on CPU, and with none, nothing is FP8."""
    import moeserve.runtime.model_runner as mr
    from moeserve.config import compose
    from moeserve.kernels.fp8_format import dequantize_fp8_blocks
    from moeserve.models.quantization import QuantPlan, resolve_quant_plan
    from moeserve.tools.tiny_checkpoint import read_checkpoint

    tensors = read_checkpoint(checkpoints[1])
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = dequantize_fp8_blocks(tensors[name], tensors.pop(name + "_scale_inv"))
    path = _copy_with(checkpoints[1], str(tmp_path / "mixed"), tensors)
    hf = mr.load_hf_config(path)
    auto, none = (compose([f"model.quantization={q}"]).model for q in ("auto", "none"))
    plan = resolve_quant_plan(auto, hf, path, torch.device("cuda"))
    assert plan.fp8 and plan.backend == "triton" and plan.block == (128, 128)
    assert name not in plan.checkpoint_fp8
    assert name.replace("o_proj", "q_a_proj") in plan.checkpoint_fp8
    assert resolve_quant_plan(auto, hf, path, torch.device("cpu")) == QuantPlan()
    assert resolve_quant_plan(none, hf, path, torch.device("cuda")) == QuantPlan()
    monkeypatch.setattr(mr, "resolve_quant_plan",
                        lambda m, h, p, d: resolve_quant_plan(m, h, p, torch.device("cuda")))
    runner = make_runner(path)
    mods = dict(runner.model.named_modules())
    assert type(mods["model.layers.0.self_attn.o_proj"]) is Linear
    assert mods["model.layers.0.self_attn.fused_qkv_a_proj"].backend == "triton"
    assert mods["model.layers.1.mlp.experts"].backend == "torch"  # moe.backend=auto on CPU
    monkeypatch.undo()
    prompts = prompts_of_lengths([7], runner.hf_config.vocab_size, seed=3)
    a, b = prefill_logits(runner, prompts)[0], prefill_logits(make_runner(path), prompts)[0]
    assert 1e-4 < rel_err(a, b) < 0.1


@pytest.mark.parametrize("qc,needle", [({"quant_method": "awq"}, "quant_method 'awq'"),
                                       ({"quant_method": "fp8", "weight_block_size": [100, 128]},
                                        "powers of two"),
                                       ({"quant_method": "fp8", "activation_scheme": "static"},
                                        "dynamic")])
def test_unsupported_quantization_configs_name_the_key(checkpoints, tmp_path, qc, needle):
    from moeserve.config import ConfigError
    from moeserve.tools.tiny_checkpoint import read_checkpoint

    path = _copy_with(checkpoints[1], str(tmp_path / "q"), read_checkpoint(checkpoints[1]),
                      {"quantization_config": qc})
    with pytest.raises(ConfigError, match=needle) as err:
        make_runner(path, FP8_ON)
    assert err.value.key == "model.quantization"


def test_fp8_lm_head_is_quantized_at_load_and_stays_within_fp8_tolerance(checkpoints):
    """model.fp8_lm_head: DeepSeek's bf16 (here float32) LM head quantized at load into 128 x 128
    blocks; its weight is the float one within e4m3 rounding, the logits within FP8 tolerance of
    the float model, and the rest of the model is the one without the flag."""
    f32 = checkpoints[0]
    plain, with_head = make_runner(f32, FP8_ON), make_runner(f32, [*FP8_ON, "model.fp8_lm_head=true"])
    head = with_head.model.lm_head
    assert isinstance(head, Fp8Linear) and head.weight.dtype == FP8
    w = plain.model.lm_head.weight.detach()
    err = (head.dequantized() - w).abs()
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of the largest magnitude
    assert 0 < float(err.max()) <= 2 ** -4 * float(w.abs().max())
    prompts = prompts_of_lengths([6, 13], plain.hf_config.vocab_size, seed=7)
    for a, b in zip(prefill_logits(with_head, prompts), prefill_logits(plain, prompts)):
        assert 1e-5 < rel_err(a, b) < 0.1
    a, b = _fp8_params(with_head.model), _fp8_params(plain.model)
    assert set(a) - set(b) == {"lm_head.weight", "lm_head.weight_scale_inv"}
    assert all(torch.equal(a[n], b[n]) for n in b)


def test_fp8_lm_head_needs_fp8_weights_and_an_untied_head(tiny_model):
    from moeserve.config import ConfigError

    with pytest.raises(ConfigError, match="quantization") as err:
        make_runner(tiny_model("deepseek_v3"), ["model.quantization=none", "model.fp8_lm_head=true"])
    assert err.value.key == "model.fp8_lm_head"
    with pytest.raises(ConfigError, match="tied") as err:
        make_runner(tiny_model("qwen2"), [*FP8_ON, "model.fp8_lm_head=true"])
    assert err.value.key == "model.fp8_lm_head"
    runner = make_runner(tiny_model("llama"), ["model.fp8_lm_head=true"])  # auto, float: ignored
    assert type(runner.model.lm_head) is Linear


def test_fp8_gemm_deep_gemm_is_chosen_by_config_and_needs_deep_gemm(checkpoints, monkeypatch):
    """model.fp8_gemm=deep_gemm: the FP8 linears' backend on CUDA where deep_gemm imports; a
    config error naming the key where it does not; CPU keeps the torch reference."""
    from moeserve.config import ConfigError, compose
    from moeserve.models import quantization
    from moeserve.runtime import model_runner as mr

    path = checkpoints[1]
    hf = mr.load_hf_config(path)
    model_cfg = compose([*FP8_ON, "model.fp8_gemm=deep_gemm"]).model
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(quantization, "deep_gemm_module", lambda: None)
    with pytest.raises(ConfigError, match="deep_gemm") as err:
        quantization.resolve_quant_plan(model_cfg, hf, path, cuda)
    assert err.value.key == "model.fp8_gemm"
    assert quantization.resolve_quant_plan(model_cfg, hf, path, cpu).backend == "torch"
    monkeypatch.setattr(quantization, "deep_gemm_module", lambda: object())
    assert quantization.resolve_quant_plan(model_cfg, hf, path, cuda).backend == "deep_gemm"
    triton = compose(FP8_ON).model
    assert quantization.resolve_quant_plan(triton, hf, path, cuda).backend == "triton"
    with pytest.raises(ConfigError) as err:
        compose(["model.fp8_gemm=cutlass"])
    assert err.value.key == "model.fp8_gemm"
