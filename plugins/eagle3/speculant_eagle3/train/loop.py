"""Training a head on collected data: draft vocabulary, the training-time-test loss, checkpoints.

* Draft vocabulary: the `n_draft_vocab` tokens the target predicts most often (top-1) on the
  training documents, with the target's end-of-generation tokens always in; `d2t` maps them.
* Loss: at unrolled step j the logits of anchor p are trained against the target's
  distribution of the token at p + j + 2 (its top-K, renormalised over the draft vocabulary),
  cross-entropy weighted 0.8^j; accuracy = the head's argmax equals the target's top-1.
  `top1_weight` w > 0 mixes in the cross-entropy against the target's top-1 alone:
  (1 - w) * soft + w * hard. Greedy drafting is accepted only where the head's argmax is the
  target's, which the soft loss pursues only indirectly.
* The head starts from the target where the shapes allow it: lm_head rows from the target's
  output head, output_norm from the target's; the rest is random (std 0.02).
* Held-out: every 20th document (by a hash of its index) is never trained on; its per-step
  accuracy is reported at each checkpoint and at the end.
* Checkpoints (`ckpt.pt` in the data directory: weights, optimizer, step, vocabulary) every
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

from speculant import training
from speculant.training import Shards, draft_vocabulary, split, target_to_draft, top1_cross_entropy

from speculant_eagle3.layout import HeadConfig
from speculant_eagle3.train.net import GGUF_TO_NET, Eagle3Net

STEP_WEIGHT = 0.8


class Batches:
    """Random windows of `window` rows (each within one document) with their labels. Each
    window's document is drawn uniformly, or with `by_rows` in proportion to its rows, so that
    a few long documents among many short ones give their share of the long windows."""

    def __init__(self, shards: Shards, docs: list, t2d: torch.Tensor, window: int, steps: int, seed: int, by_rows: bool = False):
        self.shards, self.t2d, self.window, self.steps = shards, t2d, window, steps
        self.docs = [d for d in docs if d[2] - d[1] >= steps + 8]
        self.rng = np.random.default_rng(seed)
        rows = np.array([b - a for _, a, b in self.docs], dtype=np.float64)
        self.weights = rows / rows.sum() if by_rows and len(rows) else None

    def window_of(self, doc) -> tuple[torch.Tensor, ...]:
        s, a, b = doc
        sh = self.shards.shards[s]
        T = min(self.window, b - a - self.steps - 1)
        start = a + int(self.rng.integers(0, b - a - self.steps - T)) if b - a - self.steps - T > 0 else a
        # anchors p = start .. start+T-1; step j's token input t_{p+j+1}; its label: the target's
        # distribution at position p + j + 1
        tokens = torch.from_numpy(np.asarray(sh["tokens"][start + 1 : start + 1 + T + self.steps], dtype=np.int64))
        taps = torch.from_numpy(np.asarray(sh["hidden"][start : start + T], dtype=np.float32))
        ids = torch.from_numpy(np.asarray(sh["top_ids"][start + 1 : start + 1 + T + self.steps], dtype=np.int64))
        p = torch.from_numpy(np.asarray(sh["top_p"][start + 1 : start + 1 + T + self.steps], dtype=np.float32))
        return tokens, taps, ids, p, T

    def batch(self, n: int, docs=None):
        if docs is None and self.weights is not None:
            picks = [self.docs[int(i)] for i in self.rng.choice(len(self.docs), n, p=self.weights)]
        else:
            docs = docs or self.docs
            picks = [docs[int(i)] for i in self.rng.integers(0, len(docs), n)]
        items = [self.window_of(d) for d in picks]
        T = min(it[4] for it in items)
        tokens = torch.stack([it[0][: T + self.steps] for it in items])
        taps = torch.stack([it[1][:T] for it in items])
        ids = torch.stack([it[2][: T + self.steps] for it in items])
        p = torch.stack([it[3][: T + self.steps] for it in items])
        return tokens, taps, self.labels(ids, p)

    def labels(self, ids, p):
        """Target top-K over the target vocabulary -> (draft ids [.., K], probabilities renormalised
        over the draft vocabulary [.., K], the target's top-1 as a draft id or -1)."""
        d = self.t2d[ids]
        p = torch.where(d >= 0, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return d.clamp_min(0), p, self.t2d[ids[..., 0]]


def step_losses(net: Eagle3Net, tokens, taps, labels, steps: int, top1_weight: float = 0.0):
    d_ids, d_p, top1 = labels
    outs = net.unrolled(tokens, taps, steps)
    losses, accs = [], []
    T = taps.shape[1]
    for j, logits in enumerate(outs):
        lp = F.log_softmax(logits.float(), dim=-1)
        ids, p, t1 = d_ids[:, j : j + T], d_p[:, j : j + T], top1[:, j : j + T]
        loss = -(lp.gather(-1, ids) * p).sum(-1).mean()
        ok = t1 >= 0
        if top1_weight > 0:
            ce, _ = top1_cross_entropy(lp, t1)
            loss = (1 - top1_weight) * loss + top1_weight * ce.sum() / ok.sum().clamp_min(1)
        losses.append(loss)
        accs.append(((logits.argmax(-1) == t1) & ok).sum().item() / max(1, ok.sum().item()))
    return losses, accs


def init_from_target(net: Eagle3Net, target_path: str, d2t: np.ndarray) -> None:
    """A new head: the target's output rows of the draft vocabulary and its final norm, the
    other matrices drawn small."""
    rows = training.target_tensor(target_path, "output.weight")
    if rows is None:  # tied embeddings
        rows = training.target_tensor(target_path, "token_embd.weight")
    with torch.no_grad():
        net.lm_head.weight.copy_(rows[torch.from_numpy(d2t)])
        net.out_norm.weight.copy_(training.target_tensor(target_path, "output_norm.weight"))
        for name, p in net.named_parameters():
            if p.dim() == 2 and not name.startswith("lm_head"):
                p.normal_(0.0, 0.02)


def init_from_head(net: Eagle3Net, head_path: str) -> np.ndarray:
    """Load a trained head's weights into `net` and return its draft vocabulary: fine-tuning
    starts where that head's training ended. Its shapes must be the net's."""
    return training.init_from_head({name: getattr(net, module) for name, module in GGUF_TO_NET.items()}, head_path)


def evaluate(net, batches: Batches, held: list, steps: int, n: int = 16, seed: int = 0) -> list[float]:
    rng_state = batches.rng
    batches.rng = np.random.default_rng(seed)
    net.eval()
    accs = np.zeros(steps)
    with torch.no_grad():
        for _ in range(max(1, n // 8)):
            tokens, taps, labels = batches.batch(8, held)
            accs += np.array(step_losses(net, tokens, taps, labels, steps)[1])
    net.train()
    batches.rng = rng_state
    return (accs / max(1, n // 8)).tolist()


def train(cfg: HeadConfig, embed: torch.Tensor, target_path: str, data_dir: str, *, total_steps: int, batch: int = 4,
          window: int = 256, steps: int = 3, lr: float = 3e-4, save_every: int = 100, seed: int = 0, mix: tuple = (),
          always: list[int] = (), log=print, progress: bool = True, time_limit: float | None = None, bf16: bool = False,
          init: str | None = None, top1_weight: float = 0.0, by_rows: bool = False):
    """Train (or resume) and return (net, d2t, held-out accuracies, steps done). Stops early
    after `time_limit` seconds with a checkpoint, so a later run continues. `bf16`: matmuls in
    bfloat16 under autocast (weights and optimizer stay float32), 3-4x faster where the CPU
    has AVX-512 BF16 or AMX. `init`: a trained head to start from (its weights and draft
    vocabulary) instead of the target's rows, when there is no checkpoint yet. `by_rows`: draw
    the training windows' documents in proportion to their rows (see Batches)."""
    from tqdm import tqdm

    shards = Shards([data_dir, *mix])  # the checkpoint stays in data_dir
    train_docs, held = split(shards.documents())
    ckpt_path = Path(data_dir) / "ckpt.pt"
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    torch.manual_seed(seed)
    net = Eagle3Net(cfg, embed)
    if state is not None:
        d2t = state["d2t"]
    elif init is not None:
        d2t = init_from_head(net, init)
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
    batches = Batches(shards, train_docs, t2d, window, steps, seed + start, by_rows=by_rows)
    held_batches = Batches(shards, held or train_docs[:8], t2d, window, steps, seed)

    def save(step):
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step, "d2t": d2t, "cfg": cfg}, tmp)
        os.replace(tmp, ckpt_path)

    t0 = time.time()
    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train eagle3", disable=not progress)
    step = start
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * sched(step)
        tokens, taps, labels = batches.batch(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses, accs = step_losses(net, tokens, taps, labels, steps, top1_weight)
            loss = sum(STEP_WEIGHT ** j * l for j, l in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        if (step + 1) % save_every == 0:
            save(step + 1)
            log(f"step {step + 1}: loss {loss.item():.3f}, train acc {[round(a, 3) for a in accs]}, "
                f"held-out acc {[round(a, 3) for a in evaluate(net, held_batches, held or train_docs[:8], steps)]}")
        if time_limit is not None and time.time() - t0 > time_limit:
            step += 1
            log(f"time limit: stopped at step {step} of {total_steps}, rerun to continue")
            break
    else:
        step = total_steps
    save(step)
    acc = evaluate(net, held_batches, held or train_docs[:8], steps, n=64)
    return net, d2t, acc, step
