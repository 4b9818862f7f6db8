"""Tiny random DeepSeek-V4 checkpoints built with HF transformers (the oracle).

Widths are tiny; capacity constants are the real ones (window 128, ratios 4/128,
indexer top-k 512, 16384 positions) so boundaries sit at their true positions.
"""

from __future__ import annotations

import pytest
import torch

LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe"]


def tiny_hf_config(**overrides):
    # 16 indexer heads: with few heads many slots score exactly 0 (all ReLUs off) and the
    # top-512 cut lands inside a tie that HF's topk breaks arbitrarily.
    from transformers import DeepseekV4Config

    kw = dict(
        vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        max_position_embeddings=16384, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
        o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=512,
        sliding_window=128, partial_rotary_factor=0.25, hc_mult=4,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
        eos_token_id=None, bos_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF initialises sinks, biases, hash tables and norms to constants that would hide
    bugs (every hash token on expert 0, zero sinks); give every tensor a random value."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", ".base", "hc_base", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(1.0, p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                perm = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]]
                                    for _ in range(b.shape[0])])
                b.copy_(perm)
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_hf_model(seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**overrides)).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="session")
def hf_model():
    torch.set_num_threads(1)
    return build_hf_model(seed=0)


def write_mtp_weights(folder, seed: int = 0) -> dict[str, torch.Tensor]:
    """Adds random weights of one MTP module to an HF-saved tiny V4 folder, in the official
    on-disk layout (ratchetlm/models/deepseek_v4/mtp.py): a sliding-window block with top-k MoE
    (names and shapes of the checkpoint's own layers 1 and 2) plus e_proj / h_proj / enorm /
    hnorm / norm / hc_head_*. Returns what it wrote."""
    from safetensors.torch import load_file, save_file

    saved: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    shapes = {}
    for k, v in saved.items():
        for layer, parts in (("1", ("attn.", "attn_norm", "ffn_norm", "hc_")), ("2", ("ffn.",))):
            prefix = f"model.layers.{layer}."
            if k.startswith(prefix) and k[len(prefix):].startswith(parts) and "compressor" not in k \
                    and "indexer" not in k:
                shapes[k[len(prefix):]] = v.shape
    h = saved["model.norm.weight"].shape[0]
    hc = saved["model.hc_head.hc_fn"].shape[0]
    shapes.update({"e_proj.weight": (h, h), "h_proj.weight": (h, h), "enorm.weight": (h,), "hnorm.weight": (h,),
                   "norm.weight": (h,), "hc_head_fn": (hc, hc * h), "hc_head_base": (hc,), "hc_head_scale": (1,)})
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith(("attn_sink", "_base", "gate.bias")):
            t = torch.randn(shape, generator=g) * (0.1 if name.endswith("gate.bias") else 1.0)
        elif name.endswith("_scale"):
            t = 0.5 + torch.rand(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / max(1.0, shape[-1] ** 0.5)
        out[f"mtp.0.{name}"] = t.contiguous()
    save_file(out, str(folder / "mtp.safetensors"))
    return out


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory, hf_model):
    """The tiny HF checkpoint plus random MTP weights (HF ignores ``mtp.*``)."""
    path = tmp_path_factory.mktemp("tiny_v4")
    hf_model.save_pretrained(path)
    write_mtp_weights(path)
    return path


@pytest.fixture(scope="session")
def v4_with_tokenizer(tiny_v4_dir, tmp_path_factory):
    """The tiny V4 checkpoint (with its MTP weights) plus a 96-word word-level tokenizer (its vocab size)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_v4_tok")
    for f in tiny_v4_dir.iterdir():
        shutil.copy(f, path / f.name)
    vocab = {f"w{i}": i for i in range(96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model(tiny_v4_dir):
    from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4

    return load_deepseek_v4(tiny_v4_dir)


LONG_LEN = 16384


@pytest.fixture(scope="session")
def long_run(model):
    """The reference forward over one 16384-token stream: (ids, logits [16384, vocab], traces).

    The reference is itself checked against HF (test_reference_vs_hf.py); decode at long
    positions is checked against it because HF's dense forward cannot reach 16k here."""
    from ratchetlm.models.deepseek_v4.reference import reference_forward

    ids = torch.randint(0, 96, (LONG_LEN,), generator=torch.Generator().manual_seed(2024))
    logits, traces = reference_forward(model, ids, chunk=512)
    return ids, logits, traces


# ---------------------------------------------------------------------- the one engine


def v4_engine(model, decoding: str = "autoregressive", decode_seq: int = 2, shuffle_seed: int | None = None,
              decoding_options: dict | None = None, **kw):
    """An :class:`LLMEngine` on the V4 model (the common engine: scheduler, block allocator,
    runner, strategies), with the layout's static shape ``decode_seq`` and optionally shuffled
    block ids (non-identity tables)."""
    from ratchetlm.engine.config import EngineConfig
    from ratchetlm.engine.llm_engine import LLMEngine

    model.layout_options = {"decode_seq": decode_seq}
    if shuffle_seed is not None:
        model.layout_options["shuffle_seed"] = shuffle_seed
    cfg = EngineConfig(device="cpu", dtype="float32", progress=False, decoding=decoding,
                       decoding_options=dict(decoding_options or {}), **kw)
    return LLMEngine(cfg, model, model.config)


def _register_teacher_forced():
    from ratchetlm.decoding.autoregressive import catch_up_commit, catch_up_proposal
    from ratchetlm.decoding.base import _REGISTRY, Commit, DecodeStrategy, register

    if "teacher_forced" in _REGISTRY:
        return

    @register("teacher_forced")
    class TeacherForced(DecodeStrategy):
        """Plain decoding that appends the test's tokens instead of sampled ones (so a near tie
        cannot fork two trajectories) and records, per sequence, every step's next-token logits
        and how many tokens each call committed."""

        def __init__(self, ctx, options=None):
            super().__init__(ctx, options)
            self.forced: dict[int, list[int]] = {}
            self.logits: dict[int, list[torch.Tensor]] = {}
            self.commits: list[dict[int, int]] = []

        def tokens_wanted(self, seq):
            return len(seq.token_ids) - seq.num_cached

        def propose(self, seqs, budgets):
            return [catch_up_proposal(s, b) for s, b in zip(seqs, budgets, strict=True)]

        def commit(self, seqs, proposals, logits):
            out = []
            self.commits.append(dict(self.ctx.runner.last_ring_writes))
            for s, p, lg in zip(seqs, proposals, logits, strict=True):
                c = catch_up_commit(s, p, lg, sample_next=False)
                if p.positions[0] + len(p.token_ids) == len(s.token_ids):
                    self.logits.setdefault(s.seq_id, []).append(lg[-1])
                    nxt = self.forced[s.seq_id][s.num_output_tokens]
                    c = Commit(kv_rows=c.kv_rows, token_ids=[nxt])
                out.append(c)
            return out


_register_teacher_forced()


def forced_run(engine, prompts: list[list[int]], forced: list[list[int]], restored: list | None = None,
               steps: int | None = None):
    """Runs ``prompts`` to completion on a ``teacher_forced`` engine, appending ``forced[i]``.
    ``restored[i]``: ``(traces, p)`` — start sequence ``i`` with its first ``p`` tokens already
    cached from the reference's traces (like a prefix-cache hit), instead of a prefill.
    ``steps``: stop after that many engine steps (the sequences stay live). Returns the sequence ids."""
    from ratchetlm.sampling_params import SamplingParams

    sids = []
    for i, (prompt, f) in enumerate(zip(prompts, forced, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=len(f), ignore_eos=True)
        sid = add_restored(engine, prompt, params, *(restored[i] if restored is not None else (None, 0)))
        engine.strategy.forced[sid] = f
        sids.append(sid)
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        engine.step()
        n += 1
    return sids


def add_restored(engine, prompt, params, traces=None, p: int = 0) -> int:
    """``engine.add_request``; with ``traces``, the first ``p`` prompt tokens are already cached
    from the reference's traces (like a prefix-cache hit: the engine computes only the rest)."""
    from ratchetlm.models.deepseek_v4.reference import prefix_traces

    sid = engine.add_request(list(prompt), params)
    if traces is not None and p > 0:
        seq = engine.seqs[sid]
        engine.blocks.grow(seq, p)
        engine.runner.layout.restore(sid, prefix_traces(traces, p))
        seq.num_cached = p
    return sid


def pool_bytes(engine) -> dict:
    """Every pool tensor of a V4 engine's cache, cloned (compare caches byte for byte)."""
    return {k: v.clone() for k, v in engine.runner.layout.pools.tensors.items()}
