"""Character and token language models: sentiment-discovery's multiplicative LSTM and
a small decoder-only transformer in the style of nanoGPT.

Both read ``--seq-len`` tokens and predict the next token at every position; the
vocabulary is ``--classes`` (256 for bytes, as sentiment-discovery reads text).

- ``mlstm`` (Krause et al., 2016, "Multiplicative LSTM for sequence modelling"): the
  hidden state is first multiplied with an input-dependent projection,
  ``m = (W_mx x) * (W_mh h)``, and the LSTM's gates read ``m`` instead of ``h``.
  sentiment-discovery (Radford et al. 2017's model, NVIDIA's reproduction) uses a 64-wide
  byte embedding and one layer of 4096 units: ``--width 4096 --classes 256``. The
  default here is 256 units, a CPU's size.
- ``gpt``: token and position embeddings, ``--depth`` pre-LayerNorm blocks of causal
  self-attention (64-wide heads) and a 4x MLP with GELU, a final LayerNorm and a linear
  head. ``--width`` is the embedding (default 128), ``--depth`` the blocks (default 2).
  No dropout (nanoGPT's default for small runs); the head is not tied to the embedding,
  so every parameter is one tensor with one gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from psring.errors import ConfigError
from psring.zoo.base import MODELS, Inputs, ModelSettings

EMBED = 64  # sentiment-discovery's byte embedding


class MLSTMLayer(nn.Module):
    def __init__(self, cin: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.wx = nn.Linear(cin, 4 * hidden)               # input -> gates (with bias)
        self.wm = nn.Linear(hidden, 4 * hidden, bias=False)  # m -> gates
        self.wmx = nn.Linear(cin, hidden, bias=False)        # input -> m
        self.wmh = nn.Linear(hidden, hidden, bias=False)     # h -> m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        gx, mx = self.wx(x), self.wmx(x)  # every position's input terms at once
        h = x.new_zeros(b, self.hidden)
        c = x.new_zeros(b, self.hidden)
        outs = []
        for i in range(t):
            m = mx[:, i] * self.wmh(h)
            gi, gf, go, gu = (gx[:, i] + self.wm(m)).chunk(4, dim=1)
            c = torch.sigmoid(gf) * c + torch.sigmoid(gi) * torch.tanh(gu)
            h = torch.sigmoid(go) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, dim=1)


class MLSTM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, EMBED)
        self.rnn = nn.ModuleList(MLSTMLayer(EMBED if i == 0 else hidden, hidden)
                                 for i in range(layers))
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.rnn:
            x = layer(x)
        return self.decoder(x)


@MODELS.register("mlstm")
def mlstm(s: ModelSettings):
    return (MLSTM(s.classes, s.width or 256, s.depth or 1),
            Inputs.tokens(s.seq_len, s.classes))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, width: int, depth: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, max(1, width // 64)) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        for m in self.modules():  # nanoGPT's initialization
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@MODELS.register("gpt")
def gpt(s: ModelSettings):
    width = s.width or 128
    heads = max(1, width // 64)
    if width % heads:
        raise ConfigError(f"model gpt splits --width into 64-wide heads; use a multiple "
                          f"of 64 or a width below 128 (got {width}).")
    return GPT(s.classes, s.seq_len, width, s.depth or 2), Inputs.tokens(s.seq_len, s.classes)
