"""Parameter and FLOP counts of a `ModelConfig`, computed from the shapes alone.

A test holds `parameter_counts(config)["total"]` equal to the sum over
`model.parameters()`; the book's estimate N ≈ 12·n_layers·d² (eq. 10.55) is reported beside.
"""

from __future__ import annotations

from tlm.config import ModelConfig


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters by part. `non_embedding` leaves out E, P and an untied W_U (Kaplan et al.);
    an encoder's segment embeddings count with the positions, its MLM head with the head."""
    d, d_attn, d_ff, L = config.d_model, config.d_attn, config.d_ff, config.n_layers
    bias = int(config.bias)
    embedding = config.vocab_size * d
    positions = config.context_length * d if config.position == "learned" else 0
    one_attention = 4 * d * d_attn + bias * (3 * d_attn + d)  # W_Q W_K W_V W_O (+ b)
    one_ffn = 2 * d * d_ff + bias * (d_ff + d)  # W_1 W_2 (+ b_1 b_2)
    pre = config.norm == "pre"  # a pre-norm stack ends with one more LayerNorm
    if config.model_type == "encoder-decoder":  # decoder blocks add cross-attention
        L_enc = config.n_encoder_layers
        attentions, ffns, n_norms = L_enc + 2 * L, L_enc + L, 2 * L_enc + 3 * L + 2 * pre
    else:
        attentions, ffns, n_norms = L, L, 2 * L + pre
    head = 0 if config.tie_embeddings else config.vocab_size * d
    if config.model_type == "encoder":  # S, the input's LayerNorm, the head (model/encoder.py)
        positions += 2 * d  # segments
        n_norms += 1  # ln_embed
        if config.task is None:  # the MLM head: W_T (+ b_T), ln_T, b_U
            head += d * d + bias * d + config.vocab_size
            head += (d * d + d + 2 * d + 2) * config.nsp  # the pooler and W_N, b_N
            n_norms += 1
        else:  # W_C, b_C (+ the pooler W_P, b_P), and no unembedding
            head = (d + 1) * len(config.labels) + (d * d + d) * (config.task == "classify")
    attention, ffn = attentions * one_attention, ffns * one_ffn
    norms = n_norms * d * (1 + bias)  # gamma (+ beta)
    total = embedding + positions + attention + ffn + norms + head
    return {
        "embedding": embedding,
        "positions": positions,
        "attention": attention,
        "ffn": ffn,
        "norms": norms,
        "head": head,
        "total": total,
        "non_embedding": attention + ffn + norms,
        "estimate_12Ld2": 12 * L * d * d,  # eq. 10.55, with d_attn = d_ff/4 = d
    }


def flops_per_token(config: ModelConfig, seq_len: int | None = None, training: bool = False) -> int:
    """Matmul FLOPs to process one token in a window of `seq_len` (context length by default);
    for an encoder-decoder, one source token and one target token, both of that length.

    Forward: 2 FLOPs per multiply-add for every weight matrix (attention, FFN, LM head) plus
    2·2·seq_len·d_attn per layer for QKᵀ and αV over the whole window (the usual convention,
    not halved for the causal mask). Training (forward + backward) is 3x the forward.
    """
    T = config.context_length if seq_len is None else seq_len
    d, d_attn, d_ff, L = config.d_model, config.d_attn, config.d_ff, config.n_layers
    weights = L * (4 * d * d_attn + 2 * d * d_ff) + config.vocab_size * d
    forward = 2 * weights + L * 4 * T * d_attn
    if config.model_type == "encoder-decoder":  # a source token and a target token, S = T:
        L_enc = config.n_encoder_layers  # + the encoder, + cross-attention (4 products)
        forward += 2 * L_enc * (4 * d * d_attn + 2 * d * d_ff) + L_enc * 4 * T * d_attn
        forward += 2 * L * 4 * d * d_attn + L * 4 * T * d_attn
    return 3 * forward if training else forward


def training_compute(n_params, tokens):
    """C ≈ 6ND (Kaplan et al. 2020, §2.1): training N parameters on D tokens costs about 2N
    FLOPs a token forward and 4N backward. Numbers or numpy arrays."""
    return 6 * n_params * tokens


def tokens_for_compute(compute, n_params):
    """D = C / 6N: the tokens a budget of C FLOPs buys a model of N parameters."""
    return compute / (6 * n_params)
