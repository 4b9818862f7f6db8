"""Train an EAGLE draft head for a target model on the target's own greedy answers.

    ratchet train-eagle --out DIR [--model PATH] [--code 300] [--articles 80] [--chat 200] [--epochs 3]

1. *requests* (eagle_data.py): code edits on standard-library functions, summaries of articles
   the target wrote itself, open questions — chat-formatted as a user sends them;
2. *answers*: the target's greedy answers, generated with the engine (batched);
3. *features*: one teacher-forced target forward per conversation gives ``f_i`` at every position;
4. *training* (EAGLE-1's objective plus one self-fed pass): the head reads pairs
   ``(x_{j+1}, f_j)`` and is trained so that ``g_{j+1}`` matches ``f_{j+1}`` (smooth L1) and scores
   ``x_{j+2}`` over the draft vocabulary (cross-entropy, weight ``--cls-weight``), on answer positions.
   A second pass feeds the head its own outputs ``g`` in place of ``f`` (as every draft step after
   the first does at run time) with the same targets.

The draft vocabulary is the ``--draft-vocab`` most frequent answer tokens. Greedy answers make the
targets exactly the tokens a greedy verification accepts. Steps 1-3 are cached in ``--cache``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from ratchetlm import LLM, SamplingParams
from ratchetlm.decoding.speculative.eagle import EagleConfig, EagleHead
from ratchetlm.kv.cache import NullSink
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.models.llama import LlamaModel
from ratchetlm.training import eagle_data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ratchet train-eagle", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder of the head")
    p.add_argument("--model", default=None, help="target model (default: the bundled SmolLM2)")
    p.add_argument("--cache", default=None, help="file to keep/reuse the generated data (requests, answers, features)")
    p.add_argument("--code", type=int, default=300, help="code-edit requests")
    p.add_argument("--articles", type=int, default=80, help="articles to write (two requests each)")
    p.add_argument("--chat", type=int, default=200, help="open-question requests")
    p.add_argument("--max-tokens", type=int, default=192, help="answer length cap")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--accum", type=int, default=8, help="conversations per optimizer step")
    p.add_argument("--cls-weight", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.05, help="feature noise, relative to the feature RMS")
    p.add_argument("--time-limit-min", type=float, default=30.0, help="stop training (and save) after this long")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_data(llm: LLM, a: argparse.Namespace) -> dict:
    """Requests → greedy answers → teacher-forced features. Returns plain tensors (cacheable)."""
    rng = random.Random(a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)

    def chat(user: str) -> str:
        return llm.apply_chat_template([{"role": "user", "content": user}])

    articles = [o.text.strip() for o in llm.generate([chat(r) for r in eagle_data.article_requests(a.articles, rng)],
                                                    SamplingParams(temperature=0.0, max_tokens=220))]
    requests = (eagle_data.code_requests(a.code, rng) + eagle_data.summary_requests(articles, 2, rng)
                + eagle_data.chat_requests(a.chat, rng))
    outs = llm.generate([chat(r) for r in requests], params)
    convs = [(o.prompt_token_ids, o.token_ids) for o in outs if o.token_ids]
    model = llm.engine.model
    feats = []
    with torch.inference_mode():
        for prompt, answer in convs:
            feats.append(target_features(model, prompt + answer).half())
    return {"prompts": [p for p, _ in convs], "answers": [x for _, x in convs], "features": feats}


def target_features(model: LlamaModel, ids: list[int]) -> torch.Tensor:  # [n, hidden] after the final norm
    pos = torch.arange(len(ids))
    batch = build_attention_batch(pos, [len(ids)], [torch.empty(0, dtype=torch.long)], [None], NullSink(), None)
    return model(torch.tensor(ids), batch)


def draft_vocabulary(answers: list[list[int]], k: int) -> torch.Tensor:
    counts = Counter(t for ans in answers for t in ans)
    return torch.tensor([t for t, _ in counts.most_common(k)], dtype=torch.long)


def head_pass(head: EagleHead, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
    """One causal pass over a whole conversation (draft indices 0..n-1)."""
    n = emb.shape[0]
    batch = build_attention_batch(torch.arange(n), [n], [torch.empty(0, dtype=torch.long)], [None], NullSink(), None)
    return head(emb, feat, batch)


def train(llm: LLM, data: dict, a: argparse.Namespace) -> EagleHead:
    torch.manual_seed(a.seed)
    target = llm.engine.model
    vocab = draft_vocabulary(data["answers"], a.draft_vocab)
    covered = sum(t in set(vocab.tolist()) for ans in data["answers"] for t in ans)
    total = sum(map(len, data["answers"]))
    print(f"{len(data['answers'])} conversations, {total} answer tokens; draft vocab {len(vocab)} covers "
          f"{covered / total:.3f} of them", flush=True)
    head = EagleHead(EagleConfig.for_target(llm.model_config, len(vocab)))
    cast(torch.Tensor, head.draft_vocab).copy_(vocab)
    with torch.no_grad():  # warm start: the target's last layer and final norm (same shapes)
        head.layer.load_state_dict(target.layers[-1].state_dict())
        head.norm.load_state_dict(target.norm.state_dict())
    w_head = (target.lm_head.weight if target.lm_head is not None else target.embed.weight).detach()[vocab]  # [K, H]
    remap = torch.full((llm.model_config.vocab_size,), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    order = list(range(len(data["answers"])))
    steps = max(1, int(a.epochs * len(order) / a.accum))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=steps, pct_start=0.05)
    t0, step, seen = time.time(), 0, 0
    log = dict(reg=0.0, cls=0.0, acc1=0.0, acc2=0.0, n=0.0)
    rng = random.Random(a.seed)
    while step < steps and time.time() - t0 < a.time_limit_min * 60:
        rng.shuffle(order)
        for i in order:
            prompt, answer = data["prompts"][i], data["answers"][i]
            ids = torch.tensor(prompt + answer)
            f = data["features"][i].float().clone()  # [n, H] (a normal tensor: autograd may save it)
            n, p = len(ids), len(prompt)
            if n < 3:
                continue
            # pair j = (x_{j+1}, f_j) for j = 0..n-2; targets f_{j+1}, x_{j+2}; loss where x_{j+2} is an answer token
            emb = target.embed(ids[1:]).detach()  # [n-1, H]
            fin = f[:-1] * (1 + a.noise * torch.randn_like(f[:-1]))
            tgt_f, tgt_x = f[1:], remap[torch.cat([ids[2:], ids[-1:]])]  # last row has no next token
            mask = torch.zeros(n - 1, dtype=torch.bool)
            mask[max(0, p - 2) : n - 2] = True
            tgt_x = torch.where(mask, tgt_x, torch.full_like(tgt_x, -100))
            g1 = head_pass(head, emb, fin)
            g_prev = torch.cat([fin[:1], g1[:-1]])  # self-fed: g_j in place of f_j (j >= 1)
            g2 = head_pass(head, emb, g_prev)
            loss = torch.zeros(())
            for k, g in enumerate((g1, g2)):  # pass 1 reads true features, pass 2 its own outputs
                reg = F.smooth_l1_loss(g[mask], tgt_f[mask])
                logits = g @ w_head.T  # [n-1, K]
                cls = F.cross_entropy(logits, tgt_x, ignore_index=-100)
                loss = loss + (1.0 if k == 0 else 0.5) * (reg + a.cls_weight * cls)
                with torch.no_grad():
                    log[f"acc{k + 1}"] += (logits.argmax(-1) == tgt_x)[tgt_x >= 0].float().mean().item()
                if k == 0:
                    log["reg"] += reg.item()
                    log["cls"] += cls.item()
            log["n"] += 1
            (loss / a.accum).backward()
            seen += 1
            if seen % a.accum == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                if step % 10 == 0:
                    m = max(1, log["n"])
                    print(f"step {step}/{steps} {time.time() - t0:.0f}s reg {log['reg'] / m:.4f} "
                          f"cls {log['cls'] / m:.3f} top1 {log['acc1'] / m:.3f} self-fed top1 {log['acc2'] / m:.3f}",
                          flush=True)
                    log = dict(reg=0.0, cls=0.0, acc1=0.0, acc2=0.0, n=0.0)
                if step >= steps or time.time() - t0 > a.time_limit_min * 60:
                    break
    return head.eval()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype="float32", max_num_seqs=16, progress=True)
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.is_file():
        data = torch.load(cache)
    else:
        data = build_data(llm, a)
        if cache is not None:
            torch.save(data, cache)
    head = train(llm, data, a)
    head.half().save(a.out)
    print(f"saved the EAGLE head to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
