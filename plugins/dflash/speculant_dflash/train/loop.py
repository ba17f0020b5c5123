"""Training a DFlash drafter on collected data (speculant.training): draft vocabulary, the block
loss, checkpoints.

* Draft vocabulary: the `n_draft_vocab` tokens the target predicts most often (top-1) on the
  training documents, with the target's end-of-generation tokens always in; `d2t` maps them.
* Batches: random windows of `window` positions (each within one document); in each window
  `blocks` anchors a (distinct, 1 <= a <= window - B + 1): the block [x_a, MASK x (B-1)] at
  positions a.. with the context of positions 0..a-1 (train/net.py), as the drafter sees a
  history of a committed tokens and the sampled x_a.
* Loss (DFlash's objective): row i of a block predicts the token at a + i from the context
  injection; cross-entropy against the target's distribution there (its top-K, renormalised over
  the draft vocabulary), weighted exp(-(i-1)/gamma) so the early rows, which decide how much of a
  draft is accepted, count most (gamma = B/2, the paper's choice scaled: 4 for B = 8).
* Metrics: per row, the drafter's argmax equals the target's top-1; and the mean accepted length
  of greedy drafts against the target's top-1 (1 + the rows right in a row from row 1), the
  number that predicts the speedup.
* The drafter starts from the target where the shapes allow it: lm_head rows from the target's
  output head, output_norm from the target's; the rest is random (std 0.02).
* Held-out: every 20th document is never trained on; its metrics are reported at each
  checkpoint and at the end.
* Checkpoints (`dflash-ckpt.pt` in the data directory: weights, optimizer, step, vocabulary,
  config) every `save_every` steps and at the end; a rerun resumes from it. The name leaves room
  for another trainer's checkpoint in a directory both read.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speculant.training import Shards, draft_vocabulary, init_from_head, split, target_tensor, target_to_draft, top1_cross_entropy

from speculant_dflash.layout import DFlashConfig
from speculant_dflash.train.net import DFlashNet

CHECKPOINT = "dflash-ckpt.pt"


class Batches:
    """Random windows with their blocks and labels."""

    def __init__(self, shards: Shards, docs: list, t2d: torch.Tensor, window: int, block: int, blocks: int, mask: int,
                 seed: int):
        self.shards, self.t2d, self.window, self.block, self.blocks, self.mask = shards, t2d, window, block, blocks, mask
        self.docs = [d for d in docs if d[2] - d[1] >= block + 2]
        if not self.docs:
            raise ValueError(f"no document is longer than a block of {block} tokens")
        self.rng = np.random.default_rng(seed)

    def window_of(self, doc):
        s, a, b = doc
        sh = self.shards.shards[s]
        T = min(self.window, b - a)
        start = a + int(self.rng.integers(0, b - a - T + 1))
        rows = slice(start, start + T)
        tokens = torch.from_numpy(np.asarray(sh["tokens"][rows], dtype=np.int64))
        hidden = torch.from_numpy(np.asarray(sh["hidden"][rows], dtype=np.float32))
        ids = torch.from_numpy(np.asarray(sh["top_ids"][rows], dtype=np.int64))
        p = torch.from_numpy(np.asarray(sh["top_p"][rows], dtype=np.float32))
        return tokens, hidden, ids, p, T

    def batch(self, n: int, docs=None):
        docs = docs or self.docs
        items = [self.window_of(docs[int(i)]) for i in self.rng.integers(0, len(docs), n)]
        T = min(it[4] for it in items)
        Bs = self.block
        n_anchor = T - Bs + 1  # anchors 1..T-Bs+1: every label row (a+i-1 <= T-1) inside the window
        nb = min(self.blocks, n_anchor)
        anchors = torch.stack([torch.from_numpy(np.sort(self.rng.choice(n_anchor, nb, replace=False)) + 1) for _ in items])
        tokens = torch.stack([it[0][:T] for it in items])
        hidden = torch.stack([it[1][:T] for it in items])
        ids, p = torch.stack([it[2][:T] for it in items]), torch.stack([it[3][:T] for it in items])
        block_tokens = torch.full((n, nb, Bs), self.mask, dtype=torch.long)
        block_tokens[:, :, 0] = tokens.gather(1, anchors)
        # row i of the block at a predicts the token at a + i: the target's distribution at a + i - 1
        rows = anchors[:, :, None] + torch.arange(Bs - 1) # [n, nb, Bs-1] positions a+i-1
        label_ids = ids.gather(1, rows.reshape(n, -1)[:, :, None].expand(-1, -1, ids.shape[-1])).view(n, nb, Bs - 1, -1)
        label_p = p.gather(1, rows.reshape(n, -1)[:, :, None].expand(-1, -1, p.shape[-1])).view(n, nb, Bs - 1, -1)
        return hidden, anchors, block_tokens, self.labels(label_ids, label_p)

    def labels(self, ids, p):
        """Target top-K over the target vocabulary -> (draft ids [.., K], probabilities renormalised
        over the draft vocabulary [.., K], the target's top-1 as a draft id or -1)."""
        d = self.t2d[ids]
        p = torch.where(d >= 0, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return d.clamp_min(0), p, self.t2d[ids[..., 0]]


def row_weights(block: int) -> torch.Tensor:
    gamma = block / 2
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def block_loss(net: DFlashNet, hidden, anchors, block_tokens, labels, top1_weight: float = 0.0):
    """(weighted loss, per-row accuracy [Bs-1], mean accepted length of greedy drafts).
    `top1_weight` w > 0: (1 - w) * the soft loss + w * the cross-entropy against the target's
    top-1, each block row's averaged over the rows that have one, with the same row weights."""
    d_ids, d_p, top1 = labels
    logits = net(hidden, anchors, block_tokens)  # [n, nb, Bs-1, Vd]
    lp = F.log_softmax(logits.float(), dim=-1)
    ce = -(lp.gather(-1, d_ids) * d_p).sum(-1)  # [n, nb, Bs-1]
    w = row_weights(block_tokens.shape[-1])
    loss = (ce * w).mean(dim=(0, 1)).sum() / w.sum()
    if top1_weight > 0:
        hard, ok = top1_cross_entropy(lp, top1)
        hard = hard.sum(dim=(0, 1)) / ok.sum(dim=(0, 1)).clamp_min(1)  # [Bs-1]
        loss = (1 - top1_weight) * loss + top1_weight * (hard * w).sum() / w.sum()
    with torch.no_grad():
        right = (logits.argmax(-1) == top1) & (top1 >= 0)
        acc = right.float().mean(dim=(0, 1))
        accepted = right.long().cumprod(-1).sum(-1).float().mean() + 1
    return loss, acc.tolist(), float(accepted)


def init_from_target(net: DFlashNet, target_path: str, d2t: np.ndarray) -> None:
    rows = target_tensor(target_path, "output.weight")
    if rows is None:
        rows = target_tensor(target_path, "token_embd.weight")
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        net.lm_head.weight.copy_(rows[torch.from_numpy(d2t)])
        norm = target_tensor(target_path, "output_norm.weight")
        if norm is not None:
            net.out_norm.weight.copy_(norm)


def evaluate(net, batches: Batches, docs: list, n: int = 16, seed: int = 0) -> tuple[list[float], float]:
    rng_state = batches.rng
    batches.rng = np.random.default_rng(seed)
    net.eval()
    accs, accepted, k = None, 0.0, max(1, n // 8)
    with torch.no_grad():
        for _ in range(k):
            _, acc, acc_len = block_loss(net, *batches.batch(8, docs))
            accs = np.array(acc) if accs is None else accs + np.array(acc)
            accepted += acc_len
    net.train()
    batches.rng = rng_state
    return (accs / k).tolist(), accepted / k


def train(cfg: DFlashConfig, embed: torch.Tensor, target_path: str, data_dir: str, *, total_steps: int, batch: int = 4,
          window: int = 256, blocks: int = 16, lr: float = 6e-4, save_every: int = 100, seed: int = 0, mix: tuple = (),
          always: list[int] = (), log=print, progress: bool = True, time_limit: float | None = None, bf16: bool = False,
          init: str | None = None, top1_weight: float = 0.0):
    """Train (or resume) and return (net, d2t, held-out per-row accuracy, held-out mean accepted
    length, steps done). Stops early after `time_limit` seconds with a checkpoint, so a later run
    continues. `bf16`: matmuls in bfloat16 under autocast (weights and optimizer stay float32).
    `init`: a trained drafter to start from (its weights and draft vocabulary) instead of the
    target's rows and random ones, when there is no checkpoint yet."""
    from tqdm import tqdm

    shards = Shards([data_dir, *mix])  # the checkpoint stays in data_dir
    train_docs, held = split(shards.documents())
    ckpt_path = Path(data_dir) / CHECKPOINT
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None and state["cfg"] != cfg:
        raise ValueError(f"{ckpt_path} holds a drafter of another shape ({state['cfg']}); "
                         "train with the same options or move the checkpoint away")
    torch.manual_seed(seed)
    net = DFlashNet(cfg, embed)
    if state is not None:
        d2t = state["d2t"]
    elif init is not None:
        d2t = init_from_head(net.gguf_modules(), init)
        log(f"starting from {init}")
    else:
        d2t = draft_vocabulary(shards, train_docs, cfg.n_draft_vocab, cfg.n_target_vocab, list(always))
        init_from_target(net, target_path, d2t)
    t2d = target_to_draft(d2t, cfg.n_target_vocab)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    warmup = min(100, total_steps // 10 + 1)
    sched = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps)))))
    mask = cfg.mask_token_id
    batches = Batches(shards, train_docs, t2d, window, cfg.block_size, blocks, mask, seed + start)
    held_docs = held or train_docs[:8]
    held_batches = Batches(shards, held_docs, t2d, window, cfg.block_size, blocks, mask, seed)

    def save(step):
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step, "d2t": d2t, "cfg": cfg}, tmp)
        os.replace(tmp, ckpt_path)

    t0 = time.time()
    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train dflash", disable=not progress)
    step = start
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * sched(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, acc, accepted = block_loss(net, *batches.batch(batch), top1_weight=top1_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{accepted:.2f}", acc="/".join(f"{a:.2f}" for a in acc[:3]))
        if (step + 1) % save_every == 0:
            save(step + 1)
            h_acc, h_tau = evaluate(net, held_batches, held_docs)
            log(f"step {step + 1}: loss {loss.item():.3f}, train acc {[round(a, 3) for a in acc]}, "
                f"held-out acc {[round(a, 3) for a in h_acc]}, accepted length {h_tau:.2f}")
        if time_limit is not None and time.time() - t0 > time_limit:
            step += 1
            log(f"time limit: stopped at step {step} of {total_steps}, rerun to continue")
            break
    else:
        step = total_steps
    save(step)
    acc, tau = evaluate(net, held_batches, held_docs, n=64)
    return net, d2t, acc, tau, step
