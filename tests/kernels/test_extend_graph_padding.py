"""The extend-graph path (runtime/extend_graph.py) run eagerly on CPU under Triton's interpreter:
a step padded to its token bucket through the static buffers and block table gives the same
hidden states, KV and EPLB counts as the plain eager step, and its padding writes only the sink
slot. The GPU tests replay the captured graphs (tests/gpu/test_cuda_graph.py)."""

from __future__ import annotations

import pytest
import torch
from parity import make_runner, prompts_of_lengths

from moeserve.core import ForwardMode
from moeserve.runtime.extend_graph import ExtendGraphRunner, extend_buckets

TRITON = ["attention.backend=triton", "moe.backend=triton", "model.cpu_kernels=false"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; the GPU "
                                "replays the graphs in tests/gpu")


def test_buckets():
    assert extend_buckets(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert extend_buckets(100) == [16, 32, 64, 100]
    assert extend_buckets(16) == [16]


class _Steps:
    """Requests in table rows with slots; `batch` builds one EXTEND/MIXED step over them."""

    def __init__(self, runner):
        self.runner, self.lens, self.slots = runner, {}, {}
        self.rows = runner.memory.req_to_token.alloc(6)

    def batch(self, new: dict[int, list[int]], mode=ForwardMode.EXTEND):
        mem = self.runner.memory
        rows, prefix, ids, pos, locs = [], [], [], [], []
        for r, toks in new.items():
            row, p = self.rows[r], self.lens.get(r, 0)
            slots = mem.allocator.alloc(len(toks))
            mem.req_to_token.write(row, p, slots)
            rows.append(row)
            prefix.append(p)
            ids += toks
            pos += range(p, p + len(toks))
            locs.append(slots)
            self.lens[r] = p + len(toks)
        return self.runner.make_batch(mode, ids, pos, torch.cat(locs), rows, prefix,
                                      [len(t) for t in new.values()], return_all_logits=True)


@pytest.mark.parametrize("arch,extra", [("qwen3_moe", []), ("deepseek_v3", []), ("llama", []),
                                        ("qwen3_moe", ["attention.extend_block_m=128"])])
def test_padded_extend_equals_eager(tiny_model, arch, extra):
    runner = make_runner(tiny_model(arch), TRITON + extra)
    graphs = ExtendGraphRunner(runner, max_tokens=64, max_reqs=8, capture=False)
    if extra:  # the block table of the padded step is built in the backend's 128-row blocks
        assert graphs.block_m == 128
    rec = runner.recorder
    if rec is not None:
        rec.start()
    vocab = runner.hf_config.vocab_size
    steps = _Steps(runner)
    p = prompts_of_lengths([7, 19, 5, 21, 1, 12, 1], vocab, seed=4)
    pool = runner.memory.pool
    sink_key = pool.key_buffer(0)[0]
    first = {0: p[0], 1: p[1], 2: p[2]}  # 31 tokens: bucket 32
    second = {0: p[4], 1: p[5], 3: p[3], 2: p[6]}  # a decode-like rider, prefix hits: bucket 64
    for new, mode, bucket in [(first, ForwardMode.EXTEND, 32), (second, ForwardMode.MIXED, 64)]:
        fb = steps.batch(new, mode)
        assert graphs.bucket_of_step(fb) == bucket
        counts0 = rec._buf.clone() if rec is not None else None
        runner.attn_backend.init_forward_metadata(fb)
        eager = runner.model(fb)
        key = pool.key_buffer(0)[fb.out_cache_loc].clone()
        counts1 = rec._buf.clone() if rec is not None else None
        other = pool.key_buffer(0)[-1].clone()  # a slot nobody owns
        padded = graphs.run(fb, bucket)
        assert padded.shape == eager.shape
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool.key_buffer(0)[fb.out_cache_loc], key)
        assert torch.equal(pool.key_buffer(0)[-1], other)
        assert torch.isfinite(pool.key_buffer(0)[0]).all() and sink_key.shape == other.shape
        if rec is not None:  # the padded run recorded exactly the real tokens' routing again
            assert torch.equal(rec._buf - counts1, counts1 - counts0)
            assert (counts1 - counts0).sum() > 0


def test_bucket_of_step_refuses(tiny_model):
    runner = make_runner(tiny_model("qwen3_moe"), TRITON)
    graphs = ExtendGraphRunner(runner, max_tokens=32, max_reqs=4, capture=False)
    steps = _Steps(runner)
    vocab = runner.hf_config.vocab_size
    p = prompts_of_lengths([3] * 6 + [40], vocab, seed=1)
    assert graphs.bucket_of_step(steps.batch({0: p[0], 1: p[1]})) == 16
    assert graphs.bucket_of_step(steps.batch({5: p[6]})) is None  # 40 > 32 tokens
    five = steps.batch({i: p[i] for i in range(5)})  # 5 requests > max_reqs 4
    assert graphs.bucket_of_step(five) is None
    decode = steps.batch({0: [5]}, ForwardMode.DECODE)
    assert graphs.bucket_of_step(decode) is None  # the decode graphs' job
    tbo = steps.batch({1: [5, 6]})
    tbo.tbo = True
    assert graphs.bucket_of_step(tbo) is None
    dp = steps.batch({1: [7]})
    dp.global_num_tokens = [1, 9]
    assert graphs.bucket_of_step(dp) is None
