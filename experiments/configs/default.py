"""Default CPU config: DP-Adam pretraining of a ~2M-parameter GPT-2 on the bundled corpus.

Measured on 2 CPU cores: see WORKSPACE.md. Every field can be overridden on
the command line, e.g. `--config.steps=100 --config.dp.target_epsilon=2`.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.workdir = "runs/pretrain_gpt2"     # run directory; rerunning the same command resumes it
    c.seed = config_dict.placeholder(int)  # root of all randomness; None: secret (OS entropy), kept in checkpoints only
    c.steps = 150                        # logical (optimizer) steps; sigma is calibrated for them
    c.checkpoint_every = 50              # steps between checkpoints (one is also written at the end)
    c.log_every = 5                      # steps between metrics.jsonl lines (checkpoint_every % log_every == 0)
    c.eval_every = 25                    # steps between validation evaluations (on logged steps)
    c.eval_windows = 256                 # validation windows evaluated (evenly spaced)
    c.eval_batch_size = 64               # windows per evaluation batch

    c.batch_size = 48                    # EXPECTED logical batch size q * N in privacy units (Poisson sampling)
    c.max_batch_size = config_dict.placeholder(int)  # padded batch size; None: the smallest whose sampling slack <= delta / 10
    c.accumulation_steps = 1             # micro-batches per logical batch (max_batch_size is split)
    c.memory_budget_gb = config_dict.placeholder(float)  # None: as set; a number: at least accumulation_steps
                                         # micro-batches, doubled until the compiled step fits this many GiB
    c.seq_len = 128                      # tokens per window (a DP record has seq_len + 1 tokens)

    c.learning_rate = 3e-3               # peak learning rate of adamw
    c.min_lr_ratio = 0.1                 # cosine decays to min_lr_ratio * learning_rate at `steps`
    c.warmup_steps = 10                  # linear warmup steps
    c.weight_decay = 0.0                 # adamw decoupled weight decay
    c.b1 = 0.9                           # adam beta1
    c.b2 = 0.95                          # adam beta2
    c.dtype = "float32"                  # compute dtype: "float32" | "bfloat16" (params stay float32)
    c.remat = "none"                     # per-block activation checkpointing (DP-safe): "none" | "dots" | "full"
    c.accountant = "pld"                 # privacy accountant: "pld" (tighter, default) | "rdp"
    c.compilation_cache_dir = config_dict.placeholder(str)  # compiled programs, reused by a resume; None:
                                         # $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxdp/xla; "": off

    c.model = config_dict.ConfigDict()
    c.model.family = "gpt2"              # "gpt2" | "llama" (fields: experiments/configs/llama_tiny.py)
    c.model.n_layer = 4                  # transformer blocks
    c.model.n_head = 6                   # attention heads
    c.model.d_model = 192                # residual width
    c.model.mlp_ratio = 4                # MLP hidden = mlp_ratio * d_model
    c.model.max_seq_len = 128            # learned positions (the model's maximum sequence length)
    c.model.scan_layers = False          # True: blocks stacked, run by lax.scan (compiles one block; same math)

    c.mesh = config_dict.ConfigDict()
    c.mesh.data = 1                      # devices sharding the examples (data parallel)
    c.mesh.seq = 1                       # devices sharding the tokens (context parallel); data * seq > 1: ShardedDPStep
    c.mesh.zero_stage = 0                # 0-3: shard optimizer state (1), + gradients (2), + parameters (3) over `data`

    c.data = config_dict.ConfigDict()
    c.data.path = config_dict.placeholder(str)  # None: bundled State of the Union corpus; or .txt / dir / .jsonl
    c.data.tokenizer = "bpe2048"         # "gpt2", "bpe<N>" (trained on the corpus) or a tokenizer directory
    c.data.validation_fraction = 0.05    # documents held out for validation (split by document)
    c.data.cache_dir = config_dict.placeholder(str)  # token cache; None: $JAXDP_CACHE_DIR or ~/.cache/jaxdp/tokens
    c.data.id_field = config_dict.placeholder(str)  # jsonl field naming each document's unit ("user_id", "doc_id");
                                         # None: each document is its own unit. Splits train / validation by unit

    c.privacy = config_dict.ConfigDict()  # what one DP record is (README: "What is protected")
    c.privacy.unit = "window"            # "window" | "document" | "user" (user needs data.id_field)
    c.privacy.windows_per_unit = 1       # k: windows a sampled document / user gives per step (drawn without
                                         # replacement); its clip bounds their summed gradient. 1 for "window"
    c.privacy.num_units_bound = config_dict.placeholder(int)  # a public bound B > N: q = batch_size / B, sigma,
                                         # the max batch and delta from B, so the run does not reveal N (None: from N)

    c.sample = config_dict.ConfigDict()  # samples.txt: continuations of PUBLIC prompts (never private text)
    c.sample.num = 3                     # samples written (0: no samples.txt)
    c.sample.tokens = 48                 # tokens generated per sample
    c.sample.prompts = config_dict.placeholder(tuple)  # None: jaxdp.training.DEFAULT_PROMPTS ("The", "In the", "We", ...)

    c.dp = config_dict.ConfigDict()
    c.dp.enabled = True                  # False: the identical non-DP baseline
    c.dp.target_epsilon = 8.0            # privacy budget; training stops before exceeding it
    c.dp.delta = config_dict.placeholder(float)  # total delta, sampling slack included; None: min(10^-(digits
                                         # of N + 1), 1e-5) < 1/(10 N), revealing only N's order of magnitude
    c.dp.noise_multiplier = config_dict.placeholder(float)  # None: calibrate sigma to target_epsilon
    c.dp.l2_norm_clip = 1.0              # C, the bound on each privacy unit's gradient
    c.dp.clipping = "flat"               # "flat" | "per_layer"
    c.dp.clip_fn = "abadi"               # "abadi" | "automatic"
    c.dp.strategy = "auto"               # "auto" | "ghost" | "instantiate" | "store" | "pallas"; "reference": vmap baseline
    c.dp.method = "bookkeeping"          # "bookkeeping" (one backward) | "two_pass" (norms, then a clip-weighted backward; flat only)
    c.dp.overflow = "truncate"           # Poisson draw above max_batch_size: "truncate" | "resample" | "error"
    c.dp.secure_noise = False            # True: noise of 4 draws per value and the noisy sum snapped to a grid
                                         # (against floating-point attacks on released noisy sums; jaxdp.noise.draws)
    c.dp.mechanism = "dpsgd"             # "dpsgd" (independent noise) | "bandmf" (correlated noise, cyclic Poisson
                                         # sampling over `bands` groups) | "blt" (BLT, b-min-separated cyclic
                                         # sampling, needs jaxdp[mf]) | "auto" (the planner's least-noise choice)
    c.dp.bands = config_dict.placeholder(int)  # the cyclic groups b: BandMF's bands, BLT's min separation; None (or
                                         # 0): the planner's b ("bandmf", "auto"), units // batch_size ("blt")
    c.dp.blt_buffers = 3                 # BLT's buffers (float32 copies of the trainable parameters), 1-10
    c.dp.noise_buffer_gb = config_dict.placeholder(float)  # most GiB per device for the noise buffers: the
                                         # planner skips candidates over it; None: no limit
    c.lock()
    return c
