"""A small GPT whose attention is chosen by name, trained on tiny Shakespeare: the kernel inside a model.

    from flashref import model
    text = model.load_shakespeare()
    tok = model.CharTokenizer(text)
    train_data, val_data = model.split(tok.encode(text))
    gpt = model.GPT(model.GPTConfig(vocab_size=tok.vocab_size, attention="flashref")).cuda()
    log = model.train(gpt, model.Batches(train_data, batch_size=64, seq_len=256, seed=0), steps=1000)

nanoGPT's shape: token and position embeddings, pre-norm blocks (LayerNorm, causal self-attention, LayerNorm,
MLP), a final LayerNorm and a head tied to the token embedding. :data:`ATTENTIONS` names the attention
variants: ``"plain"`` (PyTorch operations, S and P materialized), ``"sdpa"`` (PyTorch's fused backends),
``"flashref"`` (the Triton kernels, through the custom op of :mod:`flashref.triton.custom_op` so that
``torch.compile`` sees no graph break), and two approximations, ``"local"`` (a sliding window) and
``"performer"`` (random features) from :mod:`flashref.torch_attention`. On a GPU the training loop runs
in bf16 autocast; on a CPU in fp32 (``"flashref"`` then runs in Triton's interpreter: tiny configs only).
Notebook ``11_attention_in_a_model``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashref import torch_attention, validation

ATTENTIONS = ("plain", "sdpa", "flashref", "local", "performer")
EXACT = ("plain", "sdpa", "flashref")  # the attentions a KV cache (exact attention) reproduces
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")


def load_shakespeare() -> str:
    """Tiny Shakespeare (karpathy/char-rnn, public domain), shipped with the package: no download."""
    with open(DATA, encoding="utf-8") as f:
        return f.read()


class CharTokenizer:
    """One token per character of the text's alphabet (65 for tiny Shakespeare), ids in sorted order."""

    def __init__(self, text: str):
        if not text:
            raise ValueError("text must be non-empty: the alphabet is read from it")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self._id = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._id[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"text has a character outside the tokenizer's alphabet: {e.args[0]!r}") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def split(ids: torch.Tensor, val_fraction: float = 0.1):
    """``(train, val)``: the first 90% of the text for training, the rest for validation (nanoGPT's split)."""
    n = int(len(ids) * (1 - val_fraction))
    return ids[:n], ids[n:]


class Batches:
    """Random windows of ``seq_len + 1`` tokens: inputs and next-token targets, ``(batch_size, seq_len)``
    each. The offsets come from a generator seeded with ``seed``, so two loaders with the same seed give the
    same batches in the same order (every attention variant trains on the same data)."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if len(data) <= seq_len:
            raise ValueError(f"seq_len ({seq_len}) must be shorter than the data ({len(data)} tokens)")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, device="cpu"):
        starts = torch.randint(len(self.data) - self.seq_len, (self.batch_size,), generator=self.generator)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[rows]
        return window[:, :-1].to(device), window[:, 1:].to(device)


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256   # the longest sequence: the size of the position embedding
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384       # head dimension n_embd / n_head = 64
    attention: str = "flashref"
    window: int = 128       # "local": keys per query
    features: int = 64      # "performer": random features per head
    seed: int = 0           # the performer's random features (the weights follow torch.manual_seed)

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


def attend(name: str, q, k, v, window=128, features=None):
    """Causal attention of ``(B, H, T, d)`` tensors by the variant ``name`` (one of :data:`ATTENTIONS`)."""
    if name == "plain":
        return torch_attention.plain_attention(q, k, v, causal=True)
    if name == "sdpa":
        return torch_attention.sdpa_attention(q, k, v, causal=True)
    if name == "flashref":
        from flashref.triton.custom_op import attention

        return attention(q, k, v, causal=True)
    if name == "local":
        return torch_attention.local_attention(q, k, v, window=window)
    if name == "performer":
        return torch_attention.performer_attention(q, k, v, features, causal=True)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {name!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        if cfg.attention == "performer":
            g = torch.Generator().manual_seed(1000 * cfg.seed + layer)
            W = torch_attention.performer_features(cfg.n_embd // cfg.n_head, cfg.features, generator=g)
            self.register_buffer("features", W, persistent=False)  # fixed, not trained
        else:
            self.features = None

    def forward(self, x, cache=None):
        """``x`` ``(B, T, C)``. With a ``cache`` (:class:`flashref.triton.decode.KVCache`: this layer's keys
        and values of the tokens before these T) the new keys and values are appended to it and the T
        queries attend to everything cached, causal aligned bottom-right (:meth:`KVCache.attend`)."""
        B, T, C = x.shape
        H = self.cfg.n_head
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if cache is None:
            o = attend(self.cfg.attention, q, k, v, self.cfg.window, self.features)
        else:
            cache.append(k.to(cache.k_cache.dtype), v.to(cache.k_cache.dtype), check_finite=False)  # no waits
            o = cache.attend(q.to(cache.k_cache.dtype), causal=True, check_finite=False).to(q.dtype)
        return self.proj(o.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, layer)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The model. ``forward(idx, targets=None) -> (logits, loss)``; ``loss`` is the mean cross-entropy of
    the next character when ``targets`` are given."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual projections scaled down with depth (GPT-2)
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets=None, caches=None):
        """``idx`` ``(B, T)``: logits ``(B, T, vocab)`` and the loss when ``targets`` are given. ``caches``
        (one :class:`flashref.triton.decode.KVCache` per layer, from :meth:`make_caches`): these T tokens
        follow the ones cached, so their positions start at the cache's length."""
        B, T = idx.shape
        start = 0 if caches is None else caches[0].lengths[0]
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(start, start + T, device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(-1))
        return logits, loss

    def make_caches(self, batch: int, dtype=None, device=None) -> list:
        """One empty :class:`flashref.triton.decode.KVCache` per layer for ``batch`` sequences of up to
        ``block_size`` tokens: ``(batch, n_head, block_size, n_embd / n_head)`` keys and values each, in
        ``dtype`` (default: bf16 on a GPU, where the model runs in bf16 autocast; fp32 on a CPU)."""
        from flashref.triton.decode import KVCache

        device = torch.device(device) if device is not None else next(self.parameters()).device
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        d = self.cfg.n_embd // self.cfg.n_head
        return [KVCache(batch, self.cfg.n_head, self.cfg.block_size, d, dtype=dtype, device=device)
                for _ in self.blocks]

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, temperature: float = 1.0, top_k: int | None = None, generator=None,
                 kv_cache: bool = False):
        """Sample ``new_tokens`` characters after ``idx`` ``(B, T)``, each from the model's distribution of the
        next one (scaled by ``temperature``, cut to the ``top_k`` likeliest), drawn on the CPU with
        ``generator``.

        ``kv_cache=False``: every step runs the model on the whole context again (its last ``block_size``
        tokens): step t costs attention over t tokens for each of t queries. ``kv_cache=True``: the prompt
        runs once (its keys and values kept, :meth:`make_caches`), then each step runs the model on ONE new
        token, whose query attends to the cached keys with flash-decoding (notebook
        ``13_beyond_one_gpu_and_decoding``): the same distribution, up to rounding, for a fraction of the
        work. It needs an exact attention (``plain``, ``sdpa`` or ``flashref``: the cache computes exact
        attention) and ``T + new_tokens <= block_size`` (positions are absolute: no sliding context)."""
        validation.check_bool("kv_cache", kv_cache)
        if kv_cache:
            if self.cfg.attention not in EXACT:
                raise ValueError(f"kv_cache=True computes exact attention, but this model's attention is "
                                 f"{self.cfg.attention!r}: use one of {EXACT}")
            if idx.shape[1] + new_tokens > self.cfg.block_size:
                raise ValueError(f"new_tokens: {idx.shape[1]} prompt tokens + {new_tokens} new ones exceed "
                                 f"block_size {self.cfg.block_size} (kv_cache=True does not slide the context)")
        caches = self.make_caches(idx.shape[0], device=idx.device) if kv_cache else None
        step_in = idx  # what the model reads this step: everything, or (with the cache) what it has not seen
        for _ in range(new_tokens):
            if caches is None:
                step_in = idx[:, -self.cfg.block_size:]
            with autocast(idx.device):
                logits, _ = self(step_in, caches=caches)
            logits = logits[:, -1].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
            step_in = nxt
        return idx


def make_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1):
    """AdamW, nanoGPT's way: weight decay on matrices only (not on LayerNorm weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99), fused=fused)


def lr_at(step: int, steps: int, lr: float, warmup: int = 100) -> float:
    """Linear warm-up, then cosine decay to lr / 10 at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * min(t, 1.0)))


def autocast(device):
    """bf16 autocast on a GPU; nothing on a CPU (fp32 there)."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(model, batches: Batches, iters: int = 20) -> float:
    """Mean loss over ``iters`` batches (the model in eval mode, restored after)."""
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    total = 0.0
    for _ in range(iters):
        x, y = batches.next(device)
        with autocast(device):
            total += model(x, y)[1].item()
    model.train(was)
    return total / iters


def train(model, batches: Batches, steps: int, lr: float = 1e-3, warmup: int = 100, grad_clip: float = 1.0,
          val: Batches | None = None, eval_every: int = 0, eval_iters: int = 20, step_fn=None,
          progress: bool = True) -> dict:
    """Train ``model`` for ``steps`` AdamW steps on ``batches``; returns ``{"loss": [...] per step,
    "val": [(step, loss), ...], "ms": [...] wall time of each step}``. ``step_fn`` replaces the
    forward-backward (a compiled one, for example): ``step_fn(x, y) -> loss`` with the backward done."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    opt = make_optimizer(model, lr)
    log = {"loss": [], "val": [], "ms": []}

    def forward_backward(x, y):
        with autocast(device):
            _, loss = model(x, y)
        loss.backward()
        return loss

    step_fn = step_fn or forward_backward
    bar = tqdm(range(steps), disable=not progress, desc=f"train {model.cfg.attention}")
    for step in bar:
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = batches.next(device)
        loss = step_fn(x, y)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["loss"].append(loss.item())  # .item() waits for the GPU: the step's time is its whole time
        log["ms"].append(1e3 * (time.perf_counter() - start))
        if val is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            log["val"].append((step + 1, evaluate(model, val, eval_iters)))
            bar.set_postfix(loss=f"{log['loss'][-1]:.3f}", val=f"{log['val'][-1][1]:.3f}")
    return log
