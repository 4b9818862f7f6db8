"""Our model's logits equal HF transformers' on the same weights, for prefill and for decode
steps that read the paged cache."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.decoding.base import Proposal
from tests.conftest import make_tiny_hf_folder

PROMPT = "The ratchet only moves forward: committed tokens are never taken back."


def _engine_logits(llm: LLM, ids: list[int], n_decode: int) -> list[torch.Tensor]:
    """Prefill ``ids[:-n_decode]`` then feed the remaining tokens one at a time through the paged
    cache, returning logits for every position from the prefill's last one on."""
    eng = llm.engine
    sid = eng.add_request(ids[: len(ids) - n_decode], SamplingParams(max_tokens=n_decode + 1, temperature=0))
    seq = eng.seqs[sid]
    eng.scheduler.schedule()  # admits the sequence and reserves its blocks
    eng.blocks.grow(seq, len(ids))
    out = []
    start = len(ids) - n_decode
    p = Proposal(token_ids=ids[:start], positions=list(range(start)), logit_rows=[start - 1])
    out.append(eng.runner.execute([seq], [p]).logits[0][0])
    seq.num_cached = start
    for i in range(start, len(ids)):
        p = Proposal(token_ids=[ids[i]], positions=[i], logit_rows=[0])
        out.append(eng.runner.execute([seq], [p]).logits[0][0])
        seq.num_cached += 1
    eng.abort(sid)
    eng.release(sid)
    return out


@pytest.mark.parametrize("engine", ["llm_fp32", "llm_fp32_dense"])
def test_smollm_logits_match_hf_prefill_and_paged_decode(engine, hf_smollm, request):
    llm_fp32 = request.getfixturevalue(engine)
    ids = llm_fp32.tokenize(PROMPT)
    n_decode = 6
    ours = _engine_logits(llm_fp32, ids, n_decode)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float()
    start = len(ids) - n_decode
    for j, lg in enumerate(ours):
        r = ref[start - 1 + j]
        # fp32 on both sides; observed max |diff| is ~1e-4 on logits of magnitude ~30
        assert torch.allclose(lg, r, atol=2e-3, rtol=0), (j, (lg - r).abs().max())
        assert int(lg.argmax()) == int(r.argmax())
    assert llm_fp32.engine.blocks.num_free == llm_fp32.engine.blocks.num_blocks


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_tiny_hf_folder_logits_match_hf(tmp_path, smollm_tokenizer, arch):
    path, hf = make_tiny_hf_folder(tmp_path, arch, smollm_tokenizer)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64)
    assert llm.model_config.architecture == arch
    assert llm.model_config.qk_norm == (arch == "Qwen3ForCausalLM")
    ids = llm.tokenize("tiny random model, real tokenizer: 12345 你好")
    ours = _engine_logits(llm, ids, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    start = len(ids) - 4
    for j, lg in enumerate(ours):
        assert torch.allclose(lg, ref[start - 1 + j], atol=1e-4, rtol=1e-4), (arch, j)
