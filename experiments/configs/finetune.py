"""DP fine-tuning of pretrained GPT-2 or Llama weights: `python -m experiments.finetune --config.finetune.init=<dir>`.

`default.py` (every training field: steps, batch, dp, privacy, ...) plus a
`finetune` section. The model shape and the tokenizer come from
`finetune.init` (`config.model` and `data.tokenizer` stay "init"; config.json
records what they resolved to). The data is the Rotten Tomatoes sentiment
jsonl of `python -m experiments.rotten_tomatoes` (`jaxdp.data.tasks`), or any
corpus `data.path` takes. One snippet is one privacy unit (a document).
"""

from ml_collections import config_dict

from experiments.configs import default


def get_config() -> config_dict.ConfigDict:
    c = default.get_config()
    with c.unlocked():
        c.workdir = "runs/finetune"          # run directory; rerunning the same command resumes it
        c.steps = 100                        # logical (optimizer) steps
        c.checkpoint_every = 25
        c.eval_every = 25
        c.batch_size = 64                    # EXPECTED logical batch size in snippets
        c.seq_len = 128                      # tokens per window: a whole snippet and its label (<= 80 GPT-2 tokens)
        c.learning_rate = 2e-3               # peak learning rate of adamw (of the trainable parameters)
        c.model = config_dict.ConfigDict()
        c.model.family = "init"              # taken from finetune.init (leave it)
        c.data.path = "data/rotten_tomatoes.jsonl"  # python -m experiments.rotten_tomatoes writes it
        c.data.tokenizer = "init"            # the init weights' tokenizer: the run's tokenizer/, "gpt2", or the
                                             # HF Llama directory's tokenizer.json (leave it)
        c.data.validation_fraction = 0.1     # snippets held out (val loss and accuracy), split by a hash of the text
        c.data.format = "text"               # "text": a corpus (a jsonl's 'text'); "instruct": a jsonl of {prompt,
                                             # completion} or {messages} records, loss on the completion / assistant
                                             # tokens only (docs/finetuning.md, jaxdp.data.instructions)
        c.privacy.unit = "document"          # one snippet (with its label) is one unit
        c.sample.num = 0                     # samples.txt: continuations of public prompts (0: none)

        c.finetune = config_dict.ConfigDict()
        c.finetune.init = config_dict.placeholder(str)  # REQUIRED: a pretrain_gpt2 run directory, or a local HF
                                             # GPT-2 / Llama / Mistral / Qwen2 / Qwen3 checkpoint directory
                                             # (config.json + model.safetensors; all but GPT-2 also tokenizer.json).
                                             # prompt, side, reversible: GPT-2 only
        c.finetune.method = "lora"           # full | lora | adapter | bitfit | prompt | side | reversible
        c.finetune.rank = 8                  # LoRA rank r (lora, reversible)
        c.finetune.alpha = config_dict.placeholder(float)  # LoRA scale alpha / r; None: alpha = r
        c.finetune.lora_targets = config_dict.placeholder(tuple)  # projections LoRA wraps (path suffixes);
                                             # None: GPT-2 ('attn/c_attn',), Llama ('attn/q_proj', 'attn/v_proj')
        c.finetune.bottleneck = 64           # adapter width (adapter; reversible's G)
        c.finetune.adapter_targets = config_dict.placeholder(tuple)  # projections adapters follow; None:
                                             # GPT-2 ('attn/c_proj', 'mlp/c_proj'), Llama ('attn/o_proj', 'mlp/down_proj')
        c.finetune.train_layer_norms = True  # adapter: layer norms train too
        c.finetune.prompt_length = 20        # prompt: soft-prompt embeddings; seq_len + prompt_length above the
                                             # model's positions shortens seq_len to fit (a note; config.json)
        c.finetune.side_reduction = 8        # side: side-network width = d_model / side_reduction
        c.finetune.rev_alpha = 0.1           # reversible: stream scales (MEFT's)
        c.finetune.rev_beta = 0.1
        c.finetune.rev_keep_streams_every = config_dict.FieldReference(2, field_type=int)  # reversible: keep the streams every k layers (None: invert all)
        c.finetune.loss_after = "\nSentiment:"  # the loss counts only the text after its last occurrence in a
                                             # window (the label); '' (--config.finetune.loss_after=): all text
        c.finetune.accuracy_examples = 1000  # held-out snippets scored after training (summary.json; 0: none)
    c.lock()
    return c
