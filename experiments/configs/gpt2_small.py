"""GPT-2 small (GPU): seq 1024, GPT-2 BPE, lr 6e-4 cosine to 6e-5, weight decay 0.1 (FlashDP appendix D)."""

from experiments.configs._gpu import gpu_config


def get_config():
    return gpu_config(n_layer=12, n_head=12, d_model=768, name="gpt2_small")
