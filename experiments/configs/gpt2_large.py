"""GPT-2 large (GPU): seq 1024, GPT-2 BPE, lr 6e-4 cosine to 6e-5, weight decay 0.1 (FlashDP appendix D)."""

from experiments.configs._gpu import gpu_config


def get_config():
    return gpu_config(n_layer=36, n_head=20, d_model=1280, name="gpt2_large")
