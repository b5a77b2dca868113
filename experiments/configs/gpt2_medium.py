"""GPT-2 medium (GPU): seq 1024, GPT-2 BPE, lr 6e-4 cosine to 6e-5, weight decay 0.1 (FlashDP appendix D)."""

from experiments.configs._gpu import gpu_config


def get_config():
    return gpu_config(n_layer=24, n_head=16, d_model=1024, name="gpt2_medium")
