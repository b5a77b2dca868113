"""CPU config: DP-Adam pretraining of a ~2.4M-parameter Llama on the bundled corpus.

The run settings of `default.py` (same steps, batch, learning rate, epsilon
budget, BPE-2048 tokenizer, seq 128) with a Llama model of about the default
GPT-2's size: 4 blocks, width 192, 6 query / 2 key-value heads (grouped-query
attention), SwiGLU width 512, RoPE, untied output head. Every field can be
overridden on the command line, e.g. `--config.model.n_kv_head=6 --config.mesh.seq=2`.
"""

from ml_collections import config_dict

from experiments.configs import default


def llama_model(*, n_layer: int, n_head: int, n_kv_head: int, d_model: int, d_ff: int, max_seq_len: int,
                rope_theta: float, rope_scaling: float | None, tie_embeddings: bool) -> config_dict.ConfigDict:
    """The `config.model` section of a Llama (`jaxdp.models.llama.LlamaConfig`)."""
    m = config_dict.ConfigDict()
    m.family = "llama"                   # "gpt2" | "llama": the fields below are Llama's
    m.n_layer = n_layer                  # transformer blocks
    m.n_head = n_head                    # query heads
    m.n_kv_head = n_kv_head              # key / value heads (grouped-query attention; divides n_head)
    m.d_model = d_model                  # residual width (d_model / n_head must be even: RoPE)
    m.d_ff = d_ff                        # SwiGLU hidden width
    m.max_seq_len = max_seq_len          # the model's maximum sequence length (RoPE has no learned positions)
    m.rope_theta = rope_theta            # RoPE base frequency
    m.rope_scaling = config_dict.FieldReference(rope_scaling, field_type=float)  # None: plain RoPE; else Llama 3.1's factor
    m.tie_embeddings = tie_embeddings    # output head = token embedding (Llama 3.2 1B / 3B) or its own matrix
    m.scan_layers = False                # True: blocks stacked, run by lax.scan (compiles one block; same math)
    return m


def get_config() -> config_dict.ConfigDict:
    c = default.get_config()
    with c.unlocked():
        c.workdir = "runs/pretrain_llama_tiny"
        c.model = llama_model(n_layer=4, n_head=6, n_kv_head=2, d_model=192, d_ff=512, max_seq_len=128,
                              rope_theta=10000.0, rope_scaling=None, tie_embeddings=False)
    return c
