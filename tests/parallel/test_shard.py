"""What each tensor-parallel rank holds (models/shard.py), checked without starting any process:
head and KV-head ranges (KV heads replicated when there are fewer than ranks), the refusals naming
the numbers, and GGUF block weights sliced in place (rows and block-aligned columns) giving exactly
the dequantized slices, through the kernels too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ratchetlm.cli import build_parser, engine_kwargs
from ratchetlm.engine.config import EngineConfig
from ratchetlm.layers.block_quant import BlockWeight, block_matmul
from ratchetlm.models.loader import ModelLoadError
from ratchetlm.models.registry import check_tensor_parallel
from ratchetlm.models.shard import TPShard, check_divisible, col_slice, row_slice
from tests.core.gguf_factory import encode_tensor


def cfg(h=4, hkv=2, inter=128, vocab=258, hidden=64, d=16):
    return SimpleNamespace(num_heads=h, num_kv_heads=hkv, intermediate_size=inter, vocab_size=vocab,
                           hidden_size=hidden, head_dim=d)


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    assert [(s.q0, s.nq, s.kv0, s.nkv) for s in (TPShard.of(cfg(8, 4), r, 2) for r in range(2))] == \
        [(0, 4, 0, 2), (4, 4, 2, 2)]
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1 (query head j reads j // 4)
    shards = [TPShard.of(cfg(8, 2), r, 4) for r in range(4)]
    assert [(s.q0, s.nq, s.kv0, s.nkv) for s in shards] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    # an odd vocabulary: ceil(259 / 2) rows, the last rank one fewer; logits padded to 130 for the gather
    a, b = (TPShard.of(cfg(vocab=259), r, 2) for r in range(2))
    assert (a.v0, a.nv, b.v0, b.nv, b.vocab_per) == (0, 130, 130, 129, 130)


def test_shapes_that_do_not_split_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's 9 attention heads"):
        check_divisible(cfg(9, 3, inter=1536), 2)
    with pytest.raises(ValueError, match="4 KV heads or be a multiple of them"):
        check_divisible(cfg(12, 4), 3)
    with pytest.raises(ValueError, match="MLP width \\(130\\)"):
        check_divisible(cfg(inter=130), 4)
    check_divisible(cfg(9, 3, inter=1536), 3)  # SmolLM2-135M splits over 3 ranks


def test_deepseek_v4_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    with pytest.raises(ModelLoadError, match="DeepSeek-V4 does not run with tensor_parallel_size > 1"):
        check_tensor_parallel(str(tmp_path), 2)


def test_dense_pieces_are_this_ranks_rows_and_columns():
    c = cfg(4, 2)
    qkv = torch.arange((4 + 2 + 2) * 16, dtype=torch.float32)[:, None].expand(-1, 64)  # row i holds i
    s = TPShard.of(c, 1, 2)
    got = torch.cat([piece for _, piece in s.split("qkv", qkv)])[:, 0].long().tolist()
    assert got == list(range(32, 64)) + list(range(64 + 16, 64 + 32)) + list(range(96 + 16, 96 + 32))
    # a separate k_proj tensor (full rows 64..96) gives only its piece, at its local offset
    ((local, piece),) = s.split("qkv", qkv[64:96], first_row=64)
    assert local == 32 and piece[:, 0].long().tolist() == list(range(80, 96))
    ((_, o),) = s.split("o_proj", torch.arange(64.0)[None, :].expand(64, -1))
    assert o[0].long().tolist() == list(range(32, 64))


def _q(type_name: str, n: int, k: int) -> tuple[BlockWeight, torch.Tensor]:
    rng = np.random.default_rng(0)
    data, _ = encode_tensor("w", rng.standard_normal((n, k)).astype(np.float32), type_name, rng)
    w = BlockWeight.from_gguf(type_name, np.ascontiguousarray(data), k)
    return w, w.dequantize()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F16"])
def test_block_slices_are_the_dequantized_slices_without_a_copy(type_name):
    w, dense = _q(type_name, 12, 512)
    mapped = w.take_rows(np.array([5, 3, 11, 0, 1, 2, 4, 6, 7, 8, 9, 10]))  # a Q/K row map, as GGUF loads
    rows = row_slice(BlockWeight.cat([w, mapped]), 10, 17)  # across the two parts
    assert torch.equal(rows.dequantize(), torch.cat([dense, dense[mapped.parts[0].rowmap]])[10:17])
    cols = col_slice(w, 256, 512, "down")
    assert np.shares_memory(cols.parts[0].data, w.parts[0].data)
    assert torch.equal(cols.dequantize(), dense[:, 256:512])
    x = torch.randn(3, 256)
    torch.testing.assert_close(block_matmul(x, cols), x @ dense[:, 256:512].T, rtol=1e-5, atol=1e-5)


def test_a_column_split_inside_a_block_is_refused():
    w, _ = _q("Q4_K", 4, 512)
    with pytest.raises(ValueError, match="Q4_K blocks hold 256 weights"):
        col_slice(w, 128, 384, "blk.0.ffn_down")


def test_config_and_flags():
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            EngineConfig(tensor_parallel_size=bad)
    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2
    from ratchetlm.server.cli import build_parser as serve_parser

    assert engine_kwargs(serve_parser().parse_args(["--tensor-parallel-size", "3"]))["tensor_parallel_size"] == 3
