"""Shared GPU settings (FlashDP appendix D): seq 1024, GPT-2 BPE, lr 6e-4 cosine to 6e-5, wd 0.1."""

from experiments.configs import default


def gpu_base(name: str):
    """The GPU run settings on top of `default`, with its (GPT-2) model section."""
    c = default.get_config()
    c.workdir = f"runs/pretrain_{name}"
    c.steps = 2000
    c.checkpoint_every = 200
    c.log_every = 10
    c.eval_every = 200
    c.eval_windows = 512
    c.eval_batch_size = 16
    c.batch_size = 512
    c.accumulation_steps = 8
    # JAX takes 75% of an 80 GB GPU (XLA_PYTHON_CLIENT_MEM_FRACTION): the compiled step must fit in less
    # (issue 13: micro-batch 512 / 8 = 64 asked for 58 GiB on an H100). Printed before the first step.
    c.memory_budget_gb = 50.0
    c.seq_len = 1024
    c.learning_rate = 6e-4
    c.min_lr_ratio = 0.1
    c.warmup_steps = 100
    c.weight_decay = 0.1
    c.dtype = "bfloat16"
    c.data.tokenizer = "gpt2"
    c.remat = "none"         # "dots" / "full" trade recompute for activation memory (exact under DP)
    c.mesh.data = 1          # e.g. 8 on one 8-GPU host (accumulation_steps must then be 1)
    c.mesh.seq = 1           # context parallel degree (long sequences)
    c.mesh.zero_stage = 0    # 1-3 shard optimizer state / gradients / parameters over `data`
    return c


def gpu_config(n_layer: int, n_head: int, d_model: int, name: str):
    """A GPT-2 of the given shape with the GPU run settings."""
    c = gpu_base(name)
    c.model.n_layer, c.model.n_head, c.model.d_model = n_layer, n_head, d_model
    c.model.max_seq_len = 1024
    return c
