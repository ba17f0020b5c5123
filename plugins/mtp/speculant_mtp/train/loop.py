"""Training an MTP block on collected data (speculant.training's shards of the target's final
hidden state): the unrolled loss, held-out accuracy, checkpoints.

* Rows: a window of rows q of one document, each (x_q, h_{q-1}); `steps` unrolled draft steps
  (train/net.py). Step j at anchor q is trained against the target's distribution of x_{q+j+1}
  (its top-K at position q+j, renormalised over the training vocabulary), cross-entropy weighted
  0.8^j; accuracy: the block's argmax equals the target's top-1.
* Training vocabulary: the softmax of the loss runs over the `n_train_vocab` tokens the target
  predicts most often (top-1) on the training documents, the end-of-generation tokens always in
  (the full vocabulary's lm_head costs 10x more here on a 150k-token target). The sidecar names
  it as its draft vocabulary (speculant.mtp.draft_vocab): speculant drafts from those rows of the
  target's lm_head (--spec-mtp-full-vocab: all of them, as llama.cpp's graph does).
* Start: the attention block and FFN from the target's last layer where the shapes allow (the
  FFN's first n_ff neurons), shared_head_norm from the target's output_norm, eh_proj random
  (std 0.02). Embedding and lm_head are the target's, frozen.
* Held-out: every 20th document is never trained on; its per-step accuracy is reported at each
  checkpoint and at the end.
* Checkpoints (`mtp-ckpt.pt` in the data directory: weights, optimizer, step, vocabulary) every
  `save_every` steps and at the end; a rerun resumes from it.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speculant.training import Shards, split, target_tensor, top1_cross_entropy

from speculant_mtp.layout import MtpConfig
from speculant_mtp.train.net import MtpNet

STEP_WEIGHT = 0.8
CKPT = "mtp-ckpt.pt"


def train_vocabulary(shards: Shards, docs: list, n: int, n_vocab: int, always: list[int]) -> np.ndarray | None:
    """The `n` most frequent target top-1 tokens of `docs` (plus `always`), sorted; None: all."""
    if not n or n >= n_vocab:
        return None
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s, a, b in docs:
        np.add.at(counts, np.asarray(shards.shards[s]["top_ids"][a:b, 0]), 1)
    counts[[t for t in always if 0 <= t < n_vocab]] = counts.max() + 1
    return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int64)


class Batches:
    """Random windows of rows (each within one document) with their labels."""

    def __init__(self, shards: Shards, docs: list, t2v: torch.Tensor | None, window: int, steps: int, seed: int):
        self.shards, self.t2v, self.window, self.steps = shards, t2v, window, steps
        self.docs = [d for d in docs if d[2] - d[1] >= steps + 8]
        self.rng = np.random.default_rng(seed)

    def window_of(self, doc):
        s, a, b = doc
        sh = self.shards.shards[s]
        T = min(self.window, b - a - self.steps)
        room = b - a - self.steps - T
        q = a + 1 + (int(self.rng.integers(0, room + 1)) if room > 0 else 0)
        # rows q .. q+T-1: x_q with h_{q-1}; then steps-1 more tokens; labels at q .. q+T+steps-2
        tokens = torch.from_numpy(np.asarray(sh["tokens"][q : q + T + self.steps - 1], dtype=np.int64))
        hidden = torch.from_numpy(np.asarray(sh["hidden"][q - 1 : q - 1 + T], dtype=np.float32))
        ids = torch.from_numpy(np.asarray(sh["top_ids"][q : q + T + self.steps - 1], dtype=np.int64))
        p = torch.from_numpy(np.asarray(sh["top_p"][q : q + T + self.steps - 1], dtype=np.float32))
        return tokens, hidden, ids, p, T

    def batch(self, n: int, docs=None):
        docs = docs or self.docs
        items = [self.window_of(docs[int(i)]) for i in self.rng.integers(0, len(docs), n)]
        T = min(it[4] for it in items)
        k = self.steps - 1
        tokens = torch.stack([it[0][: T + k] for it in items])
        hidden = torch.stack([it[1][:T] for it in items])
        ids = torch.stack([it[2][: T + k] for it in items])
        p = torch.stack([it[3][: T + k] for it in items])
        return tokens, hidden, self.labels(ids, p)

    def labels(self, ids, p):
        """Target top-K -> (ids in the training vocabulary [.., K], probabilities renormalised over
        it, the target's top-1 there or -1)."""
        if self.t2v is None:
            return ids, p / p.sum(-1, keepdim=True).clamp_min(1e-9), ids[..., 0]
        d = self.t2v[ids]
        p = torch.where(d >= 0, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return d.clamp_min(0), p, self.t2v[ids[..., 0]]


def step_losses(net: MtpNet, tokens, hidden, labels, steps: int, top1_weight: float = 0.0):
    """Per unrolled step, the loss and the top-1 accuracy; the net's lm_head rows are the
    labels' columns (the training vocabulary's rows, or all). `top1_weight` w > 0: (1 - w) *
    the soft loss + w * the cross-entropy against the target's top-1 (rows whose top-1 is
    outside the training vocabulary left out of it)."""
    v_ids, v_p, top1 = labels
    outs = net.unrolled(tokens, hidden, steps)
    losses, accs = [], []
    T = hidden.shape[1]
    for j, logits in enumerate(outs):
        lp = F.log_softmax(logits.float(), dim=-1)
        ids, p, t1 = v_ids[:, j : j + T], v_p[:, j : j + T], top1[:, j : j + T]
        loss = -(lp.gather(-1, ids) * p).sum(-1).mean()
        ok = t1 >= 0
        if top1_weight > 0:
            ce, _ = top1_cross_entropy(lp, t1)
            loss = (1 - top1_weight) * loss + top1_weight * ce.sum() / ok.sum().clamp_min(1)
        losses.append(loss)
        accs.append(((logits.argmax(-1) == t1) & ok).sum().item() / max(1, ok.sum().item()))
    return losses, accs


def init_from_target(net: MtpNet, target_path: str) -> None:
    """The block from the target's last layer where shapes allow, the head norm from output_norm."""
    c = net.cfg
    last = f"blk.{c.n_trunk - 1}."
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        pairs = {"attn_norm.weight": net.attn_norm.weight, "attn_q.weight": net.q.weight, "attn_k.weight": net.k.weight,
                 "attn_v.weight": net.v.weight, "attn_output.weight": net.o.weight,
                 f"{c.ffn_norm}.weight": net.ffn_norm.weight}
        if net.q.bias is not None:
            pairs.update({"attn_q.bias": net.q.bias, "attn_k.bias": net.k.bias, "attn_v.bias": net.v.bias})
        if net.q_norm is not None:
            pairs.update({"attn_q_norm.weight": net.q_norm.weight, "attn_k_norm.weight": net.k_norm.weight})
        for name, p in pairs.items():
            w = target_tensor(target_path, last + name)
            if w is not None and tuple(w.shape) == tuple(p.shape):
                p.copy_(w)
        for name, p, rows in (("ffn_gate.weight", net.gate.weight, True), ("ffn_up.weight", net.up.weight, True),
                              ("ffn_down.weight", net.down.weight, False)):
            w = target_tensor(target_path, last + name)
            if w is not None:
                w = w[: p.shape[0]] if rows else w[:, : p.shape[1]]
                if tuple(w.shape) == tuple(p.shape):
                    p.copy_(w)
        norm = target_tensor(target_path, "output_norm.weight")
        if norm is not None:
            net.head_norm.weight.copy_(norm)


def evaluate(net, batches: Batches, held: list, steps: int, n: int = 16, seed: int = 0) -> list[float]:
    rng_state = batches.rng
    batches.rng = np.random.default_rng(seed)
    net.eval()
    accs = np.zeros(steps)
    with torch.no_grad():
        for _ in range(max(1, n // 8)):
            tokens, hidden, labels = batches.batch(8, held)
            accs += np.array(step_losses(net, tokens, hidden, labels, steps)[1])
    net.train()
    batches.rng = rng_state
    return (accs / max(1, n // 8)).tolist()


def train(cfg: MtpConfig, embed: torch.Tensor, lm_head: torch.Tensor, target_path: str, data_dir: str, *, total_steps: int,
          batch: int = 4, window: int = 256, steps: int = 3, lr: float = 3e-4, n_train_vocab: int = 16384,
          save_every: int = 100, seed: int = 0, mix: tuple = (), always: list[int] = (), bias: bool = True, log=print,
          progress: bool = True, time_limit: float | None = None, bf16: bool = False, top1_weight: float = 0.0):
    """Train (or resume) and return (net, training vocabulary or None, held-out accuracies per
    step, steps done). Stops early after `time_limit` seconds with a checkpoint, so a later run
    continues."""
    from tqdm import tqdm

    shards = Shards([data_dir, *mix])  # the checkpoint stays in data_dir
    train_docs, held = split(shards.documents())
    ckpt_path = Path(data_dir) / CKPT
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None:
        vocab_np = state["vocab"]
    else:
        vocab_np = train_vocabulary(shards, train_docs, n_train_vocab, cfg.n_vocab, list(always))
    vocab = t2v = None
    if vocab_np is not None:
        vocab = torch.from_numpy(vocab_np)
        t2v = torch.full((cfg.n_vocab,), -1, dtype=torch.long)
        t2v[vocab] = torch.arange(len(vocab))
    torch.manual_seed(seed)
    # only the training vocabulary's rows of the lm_head, in its order (the labels' column ids)
    net = MtpNet(cfg, embed, lm_head if vocab is None else lm_head[vocab].contiguous(), bias=bias)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    else:
        init_from_target(net, target_path)
    warmup = min(100, total_steps // 10 + 1)
    sched = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps)))))
    batches = Batches(shards, train_docs, t2v, window, steps, seed + start)
    held_batches = Batches(shards, held or train_docs[:8], t2v, window, steps, seed)
    held = held_batches.docs or batches.docs[:8]

    def save(step):
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step, "vocab": vocab_np, "cfg": cfg}, tmp)
        os.replace(tmp, ckpt_path)

    t0 = time.time()
    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train mtp", disable=not progress)
    step = start
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * sched(step)
        tokens, hidden, labels = batches.batch(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses, accs = step_losses(net, tokens, hidden, labels, steps, top1_weight)
            loss = sum(STEP_WEIGHT ** j * l for j, l in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        if (step + 1) % save_every == 0:
            save(step + 1)
            log(f"step {step + 1}: loss {loss.item():.3f}, train acc {[round(a, 3) for a in accs]}, "
                f"held-out acc {[round(a, 3) for a in evaluate(net, held_batches, held, steps)]}")
        if time_limit is not None and time.time() - t0 > time_limit:
            step += 1
            log(f"time limit: stopped at step {step} of {total_steps}, rerun to continue")
            break
    else:
        step = total_steps
    save(step)
    acc = evaluate(net, held_batches, held, steps, n=64)
    return net, vocab_np, acc, step
