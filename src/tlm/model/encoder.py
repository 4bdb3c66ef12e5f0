"""The bidirectional encoder (J&M ch. 11; Devlin et al. 2019, "BERT"): the blocks of ch. 9
without the causal mask, and a masked-language-model head.

Every position attends to every other one (padding aside), so a token's representation
reads its left and its right context alike (§11.1). The input adds a segment embedding to
the token and position embeddings, which tells the two sentences of a pair apart (§11.2.2),
and BERT normalises the sum before the first block:

    X = LayerNorm(E[w] + P[pos] + S[seg])                the input, [B,T,d]
    H = Blocks(X)                                        no causal mask: all-to-all
    u = LayerNorm(act(H W_T + b_T)) E^T + b_U            the MLM head (§11.2.1)
    y = softmax(tanh(h_CLS W_P + b_P) W_N + b_N)         with `nsp`: is B the sentence
                                                         that follows A? (§11.2.2)

The head's transform (W_T, b_T and its LayerNorm) sits between the last block and the
unembedding, which is tied to E as in the causal model (§9.5), with a bias b_U of its own;
`unembed` is that whole head, so the logit lens reads an encoder's layers through it.

Fine-tuning (§11.4) replaces the MLM head with a task's (`config.task`, its `labels`):

    y = softmax(tanh(h_CLS W_P + b_P) W_C + b_C)          classify: the [CLS] position,
                                                          through BERT's pooler
    y_i = softmax(h_i W_C + b_C)                          tag: every token

The parameter names are the book's; `interop/bert.py` maps them to BERT's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.functional import ACTIVATIONS, linear
from tlm.model.hooks import HookPoint, name_hook_points
from tlm.model.layers import BLOCKS, Embedding, LayerNorm

SEGMENTS = 2  # sentence A and sentence B of a pair (BERT's type_vocab_size)


def key_padding(attention_mask: Tensor | None) -> Tensor | None:
    """attention_mask [B,T], 1 for tokens, 0 for padding -> bool [B,1,1,T]: the keys every
    query may see (all of a row's tokens, none of its padding)."""
    return None if attention_mask is None else attention_mask.bool()[:, None, None, :]


class Encoder(nn.Module):
    """input_ids [B,T] (segments [B,T], attention_mask [B,T]) -> MLM logits [B,T,V] (a
    fine-tuned head's: [B,labels] or [B,T,labels]).

    Hook points as the causal model's (`embed`, `blocks.{l}.*`, `final`, `logits`), the
    attention pattern all-to-all.
    """

    def __init__(self, config: ModelConfig, init: bool = True) -> None:
        """`init=False` leaves the weights unset, for a loader that fills every one of them."""
        super().__init__()
        if config.model_type != "encoder":
            raise ValueError(f"Encoder needs model_type='encoder', got {config}")
        d, eps, bias = config.d_model, config.layer_norm_eps, config.bias
        self.config = config
        self.embedding = Embedding(config)
        self.S = nn.Parameter(torch.empty(SEGMENTS, d))  # segment embeddings
        self.ln_embed = LayerNorm(d, eps, bias)
        self.drop = nn.Dropout(config.embd_dropout_p)
        self.embed = HookPoint()
        block = BLOCKS[config.norm]
        layers = range(config.n_layers)
        self.blocks = nn.ModuleList(block(config, layer, causal=False) for layer in layers)
        pre = config.norm == "pre"  # a pre-norm stack ends with a LayerNorm (post-norm: normed)
        self.ln_f = LayerNorm(d, eps, bias) if pre else nn.Identity()
        self.final = HookPoint()
        self.act = ACTIVATIONS[config.activation]
        if config.task == "classify" or config.nsp:  # BERT's pooler, on [CLS]
            self.W_P, self.b_P = nn.Parameter(torch.empty(d, d)), nn.Parameter(torch.zeros(d))
        if config.nsp:  # next-sentence prediction: IsNext (0) or NotNext (1), as BERT's
            self.W_N, self.b_N = nn.Parameter(torch.empty(d, 2)), nn.Parameter(torch.zeros(2))
        if config.task is None:  # the MLM head: its transform, then the unembedding
            self.W_T = nn.Parameter(torch.empty(d, d))
            self.b_T = nn.Parameter(torch.zeros(d)) if bias else None
            self.ln_T = LayerNorm(d, eps, bias)
            untied = not config.tie_embeddings
            self.W_U = nn.Parameter(torch.empty(d, config.vocab_size)) if untied else None
            self.b_U = nn.Parameter(torch.zeros(config.vocab_size))
        else:  # a task's head: [CLS] through the pooler (classify), or each token (tag)
            n = len(config.labels)
            self.W_C, self.b_C = nn.Parameter(torch.empty(d, n)), nn.Parameter(torch.zeros(n))
        self.logits = HookPoint()
        name_hook_points(self)
        if init:
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """BERT's initialisation: every matrix and embedding (E, P, S) N(0, 0.02²), biases
        and β 0, γ 1."""
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            with torch.no_grad():
                if leaf.startswith("W_") or leaf in ("E", "P", "S"):
                    param.normal_(0.0, 0.02, generator=generator)
                elif leaf == "gamma":
                    param.fill_(1.0)
                else:  # b_*, beta
                    param.zero_()

    def hidden(
        self,
        input_ids: Tensor,
        segments: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """input_ids [B,T] -> H [B,T,d], each position's contextual embedding (§11.3).
        `segments` [B,T] is 0 for sentence A, 1 for B (all 0 if None); `attention_mask`
        [B,T] hides right padding (0) from every query."""
        T = input_ids.shape[1]
        if T > self.config.context_length:
            raise ValueError(
                f"input has {T} tokens; context_length is {self.config.context_length}"
            )
        positions = torch.arange(T, device=input_ids.device)  # [T]
        x = self.embedding(input_ids, positions)  # E[w] + P[pos]  [B,T,d]
        x = x + (self.S[0] if segments is None else self.S[segments])  # + S[seg]
        x = self.embed(self.drop(self.ln_embed(x)))
        mask = key_padding(attention_mask)
        for block in self.blocks:
            x = block(x, positions, mask)  # bidirectional: no causal mask, padding hidden
        return self.final(self.ln_f(x))

    def unembed(self, h: Tensor) -> Tensor:
        """The head on hidden states [..., d]: the MLM head's LayerNorm(act(h W_T + b_T))
        E^T + b_U -> [..., V]; a tagger's h W_C + b_C -> [..., labels]."""
        if self.config.task is not None:
            return linear(h, self.W_C, self.b_C)
        t = self.ln_T(self.act(linear(h, self.W_T, self.b_T)))
        head = self.embedding.E.t() if self.W_U is None else self.W_U
        return linear(t, head, self.b_U)

    def forward(
        self,
        input_ids: Tensor,
        segments: Tensor | None = None,
        attention_mask: Tensor | None = None,
        only: Tensor | None = None,
        next_sentence: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids [B,T] -> logits: the MLM head's [B,T,V], at each position the scores
        of the token that belongs there (what a masked position is trained to predict); a
        tagger's [B,T,labels]; a classifier's [B,labels], of the whole input. With `only`
        (bool [B,T]), the logits of those positions alone, [M,·]: the head runs on them.
        With `next_sentence` (an `nsp` model), (those logits, the NSP head's [B,2])."""
        h = self.hidden(input_ids, segments, attention_mask)
        if self.config.task == "classify":
            return self.logits(linear(self.pool(h), self.W_C, self.b_C))  # [B,labels]
        logits = self.logits(self.unembed(h if only is None else h[only]))
        if next_sentence:
            return logits, linear(self.pool(h), self.W_N, self.b_N)  # [B,2]
        return logits

    def pool(self, h: Tensor) -> Tensor:
        """BERT's pooler on H [B,T,d]: tanh(h_CLS W_P + b_P) [B,d], the input as a whole."""
        return torch.tanh(linear(h[:, 0], self.W_P, self.b_P))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
