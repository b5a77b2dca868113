"""Llama 3.2 1B shape (GPU): seq 1024, GPT-2 BPE, lr 6e-4 cosine to 6e-5, weight decay 0.1 (as gpt2_small.py).

The shape is `jaxdp.models.llama.LlamaConfig.preset("1B")` (16 blocks, width 2048, 32
query / 8 key-value heads, SwiGLU 8192, tied embeddings, RoPE theta 5e5 with
the Llama 3.1 scaling factor 32). The vocabulary is the tokenizer's (GPT-2
BPE, 50,257), not Llama 3's 128,256, so the model has about 1.07B parameters
instead of 1.24B.

Memory (not measured on a GPU): flat clipping keeps every linear layer's input
and output gradient until all per-example norms are known, on paper 1.4 GB per
1024-token window in bf16 (16 blocks x 44k values per token), plus the
float32 parameters, adamw state and accumulators (~20 GiB). Hence
accumulation_steps=64 (micro-batches of ~10 windows) and remat="dots" (the
T x T attention weights are recomputed, not kept). A mesh run needs
accumulation_steps=1: lower batch_size so that batch_size / mesh.data stays
near 10 windows per device, or use mesh.seq to split the windows' tokens.
"""

from experiments.configs import llama_tiny
from experiments.configs._gpu import gpu_base
from jaxdp.models.llama import LlamaConfig


def get_config():
    c = gpu_base("llama_1b")
    p = LlamaConfig.preset("1B")
    with c.unlocked():
        c.model = llama_tiny.llama_model(
            n_layer=p.n_layer, n_head=p.n_head, n_kv_head=p.n_kv_head, d_model=p.d_model, d_ff=p.d_ff,
            max_seq_len=1024, rope_theta=p.rope_theta, rope_scaling=p.rope_scaling,
            tie_embeddings=p.tie_embeddings)
    c.accumulation_steps = 64
    c.remat = "dots"
    return c
