"""``ratchet train-wedlm``: train a tiny Qwen3-architecture WeDLM model on the generated corpus.

The model is HF ``Qwen3ForCausalLM`` (the engine's loader reads the saved folder; the same
folder loads in transformers), trained with the dual-stream objective of
:mod:`ratchetlm.training.wedlm_objective` on packed documents from
:mod:`ratchetlm.training.corpus`. The output folder holds ``config.json`` (with
``mask_token_id``), ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ratchetlm.training.corpus import documents, held_out, vocabulary_words
from ratchetlm.training.tokenizer_build import build_tokenizer
from ratchetlm.training.wedlm_objective import build_wedlm_batch, wedlm_loss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ratchet train-wedlm", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output HF folder")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--time-limit-min", type=float, default=25.0, help="stop (and save) after this much time")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--ar-weight", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init-from", default=None, help="continue from a saved folder (fresh optimizer and schedule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=100)
    a = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "block_size", "hidden_size", "layers", "heads",
                 "kv_heads", "intermediate_size", "threads"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if a.seq_len % a.block_size:
        raise ValueError(f"--seq-len ({a.seq_len}) must be a multiple of --block-size ({a.block_size})")
    if a.hidden_size % a.heads or a.heads % a.kv_heads:
        raise ValueError("--hidden-size must divide by --heads and --heads by --kv-heads")
    return a


def packed_batches(tok, seed: int, batch: int, seq_len: int) -> Iterator[torch.Tensor]:  # yields [B, L]
    """Documents + <eos>, concatenated and cut into ``seq_len`` chunks (held-out prompts excluded)."""
    exclude = {ex.prompt for ex in held_out(256)}
    docs = documents(seed, exclude)
    buf: list[int] = []
    while True:
        rows = []
        for _ in range(batch):
            while len(buf) < seq_len:
                buf += tok.encode(next(docs), add_special_tokens=False) + [tok.eos_token_id]
            rows.append(buf[:seq_len])
            buf = buf[seq_len:]
        yield torch.tensor(rows, dtype=torch.long)


def make_model(a: argparse.Namespace, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.hidden_size // a.heads, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    cfg.mask_token_id = tok.mask_token_id
    torch.manual_seed(a.seed)
    return Qwen3ForCausalLM(cfg)


def save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    d["mask_token_id"] = tok.mask_token_id  # WeDLM: the engine refuses a model without one
    cfg_path.write_text(json.dumps(d, indent=2) + "\n")
    for extra in ("generation_config.json", "special_tokens_map.json"):
        (out / extra).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = build_tokenizer(vocabulary_words())
    if a.init_from:
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM.from_pretrained(a.init_from, dtype=torch.float32)
        if model.config.vocab_size != len(tok):
            raise ValueError(f"--init-from {a.init_from}: vocab {model.config.vocab_size} != corpus vocab {len(tok)}")
    else:
        model = make_model(a, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, vocab {len(tok)}, mask id {tok.mask_token_id}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))
    gen = torch.Generator().manual_seed(a.seed)
    data = packed_batches(tok, a.seed, a.batch_size, a.seq_len)
    t0 = time.perf_counter()
    model.train()
    step = 0
    for step in range(1, a.steps + 1):
        b = build_wedlm_batch(next(data), tok.mask_token_id, a.block_size, gen)
        logits = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask).logits
        loss, mlm, ar = wedlm_loss(logits, b, a.ar_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        elapsed = time.perf_counter() - t0
        if step % a.log_every == 0 or step == 1:
            print(f"step {step} loss {loss.item():.4f} mlm {mlm.item():.4f} ar {ar.item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} elapsed {elapsed:.0f}s", flush=True)
        if step % a.save_every == 0:
            save(model, tok, Path(a.out))
        if elapsed > a.time_limit_min * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    model.eval()
    save(model, tok, Path(a.out))
    print(f"saved {a.out} after {step} steps in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
