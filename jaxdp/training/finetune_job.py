"""The fine-tuning job: the pretraining job (`jaxdp.training`) started from pretrained weights.

`prepare(config)` (config: `experiments/configs/finetune.py`) resolves
`config.finetune.init`, a run directory of `experiments.pretrain_gpt2` or a
local Hugging Face checkpoint directory (GPT-2, or Llama, Mistral, Qwen2, Qwen3:
`jaxdp.models.hf_checkpoint.MODEL_TYPES`, these four as `config.model.family`
"llama" with their switches; Gemma 2 / 3 text as "gemma2" / "gemma3_text"), into the run's model
shape (`config.model`) and tokenizer (`config.data.tokenizer`, the one the
weights were trained with: the init run's `tokenizer/`, "gpt2" for HF GPT-2
weights, the checkpoint directory's `tokenizer.json` for Llama), checks the
method and its arguments on an abstract model, then calls
`jaxdp.training.prepare` and sets `Prepared.build_model`: the pretrained model
with `jaxdp.finetune.methods.prepare(model, method, options=...)` applied. `jaxdp.training.train`
then runs it like any job: Poisson sampling, DP step on the trainable
`nnx.Param`s only (frozen parameters get no gradient, no optimizer state, no
update), accounting, budget stop, checkpoints, resume, metrics, plots,
`privacy.json`. Every check runs before the workdir is touched (`ConfigError`,
one line).

`config.json` of the run records the resolved `model` and `data.tokenizer`;
`model/params.npz` holds the trained parameters only (`load_finetuned` puts
them on the init weights). `add_accuracy` scores held-out snippets of a
sentiment jsonl (`jaxdp.data.tasks`) after training: the validation split of the
run (by the same hash of each unit id), never seen by training.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib

import jax
import numpy as np
from flax import nnx
from ml_collections import config_dict

from jaxdp.core import losses
from jaxdp.data import chat, instructions, tasks
from jaxdp.data import windows as data_lib
from jaxdp.finetune import methods as finetune
from jaxdp.finetune import settings as finetune_settings
from jaxdp.finetune import targets as family_targets
from jaxdp.models import hf_checkpoint, hf_gemma, hf_gpt2, hf_llama, layers
from jaxdp.models.gemma import GemmaConfig
from jaxdp.models.llama import LlamaConfig
from jaxdp.noise import draws as noise_lib
from jaxdp.noise import seeds
from jaxdp.training import config as config_lib
from jaxdp.training import hosts, init_weights, preparation
from jaxdp.training.config import ConfigError
from jaxdp.training.preparation import Prepared
from jaxdp.training.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    MODEL_DIR,
    PARAMS_FILE,
    SUMMARY_FILE,
    TOKENIZER_DIR,
    latest_checkpoint_meta,
    read_json,
    read_trained,
)

FROM_INIT = "init"  # config.model.family / config.data.tokenizer of the finetune config: taken from init
HF_FAMILIES = hf_checkpoint.MODEL_TYPES  # the model_type values of an HF checkpoint the job loads
# config.finetune fields that make the method's `jaxdp.finetune.settings` value (the others: init, method,
# loss_after, accuracy_examples).
METHOD_ARGS = finetune_settings.FLAT_NAMES
# summary.json's heldout_accuracy (`tasks.sentiment_accuracy`) and `accuracy_rows`' copy of it
ACCURACY_FIELDS = ("accuracy", "examples", "label_positive_fraction", "predicted_positive_fraction",
                   "majority_class_accuracy")


def _init_kind(init) -> str:
    """"run" (a pretrain_gpt2 run directory) or "hf" (an HF GPT-2 or Llama checkpoint directory)."""
    if not isinstance(init, str) or not init.strip():
        raise ConfigError("config.finetune.init is required: a pretrain_gpt2 run directory or a local Hugging "
                          f"Face GPT-2 or Llama checkpoint directory, got {init!r}")
    path = pathlib.Path(init).expanduser()
    if not path.is_dir():
        raise ConfigError(f"config.finetune.init {init!r} is not a directory (a pretrain_gpt2 run directory or a "
                          "local Hugging Face GPT-2 or Llama checkpoint directory)")
    if (path / TOKENIZER_DIR / "tokenizer.json").is_file() and (path / CONFIG_FILE).is_file():
        return "run"
    if (path / hf_checkpoint.CONFIG_FILE).is_file() and ((path / hf_checkpoint.WEIGHTS_FILE).is_file()
                                                         or (path / hf_checkpoint.INDEX_FILE).is_file()):
        return "hf"
    raise ConfigError(f"config.finetune.init {init!r} is neither a pretrain_gpt2 run directory ({CONFIG_FILE} and "
                      f"{TOKENIZER_DIR}/) nor an HF checkpoint ({hf_checkpoint.CONFIG_FILE} and "
                      f"{hf_checkpoint.WEIGHTS_FILE})")


def _init_model_and_tokenizer(init: str, kind: str) -> tuple[dict, str]:
    """(config.model of the init weights, config.data.tokenizer they were trained with)."""
    path = pathlib.Path(init).expanduser()
    if kind == "run":
        try:
            run = json.loads((path / CONFIG_FILE).read_text())
            model = dict({"family": "gpt2"}, **run["model"])  # run directories from before `family` are GPT-2
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"config.finetune.init: {path / CONFIG_FILE} is not a run's config ({e!r})") from None
        if "finetune" in run:  # one line, not a KeyError deeper down
            raise ConfigError(f"config.finetune.init {init!r} is a fine-tuning run (its {MODEL_DIR}/ holds only the "
                              "parameters its method trained): fine-tune from its own finetune.init "
                              f"({run['finetune'].get('init')!r}) instead")
        if not (path / MODEL_DIR / PARAMS_FILE).is_file() and latest_checkpoint_meta(path / CHECKPOINT_DIR) is None:
            raise ConfigError(f"config.finetune.init {init!r} has no parameters yet (neither {MODEL_DIR}/{PARAMS_FILE} "
                              f"nor a checkpoint in {CHECKPOINT_DIR}/)")
        model.pop("scan_layers", None)  # fine-tuning trains the unrolled layout; `_pretrained` reads either
        return model, str((path / TOKENIZER_DIR).resolve())
    source = str(path / hf_checkpoint.CONFIG_FILE)
    try:
        hf = hf_checkpoint.read_config(str(path))
        family = hf.get("model_type")
        if family not in HF_FAMILIES:
            raise ValueError(f"{source}: model_type must be one of {HF_FAMILIES}, got {family!r}")
        reader = hf_gpt2 if family == "gpt2" else hf_gemma if family in hf_gemma.MODEL_TYPES else hf_llama
        c = reader.config_from_hf(hf, source)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.finetune.init: {e}") from None
    if family == "gpt2":
        return {"family": "gpt2", "n_layer": c.n_layer, "n_head": c.n_head, "d_model": c.d_model,
                "mlp_ratio": c.mlp_ratio, "max_seq_len": c.seq_len}, "gpt2"
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"config.finetune.init {init!r}: a {family} checkpoint needs the tokenizer it was trained "
                          "with as tokenizer.json (HF's fast tokenizer, saved beside the weights)")
    if isinstance(c, GemmaConfig):
        fields = {name: getattr(c, name) for name in config_lib.GEMMA_FIELDS if name != "max_seq_len"}
        return dict(fields, family=c.family, max_seq_len=c.seq_len, layer_types=list(c.layer_types)), str(path.resolve())
    return {"family": "llama", "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
            "d_model": c.d_model, "d_ff": c.d_ff, "max_seq_len": c.seq_len, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling, "tie_embeddings": c.tie_embeddings, "head_dim": c.head_dim,
            "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "sliding_window": c.sliding_window}, str(path.resolve())


def method_options(config):
    """The method's settings (`jaxdp.finetune.settings`; None for "full" and "bitfit") from config.finetune.
    ValueError naming the field for a bad value."""
    ft = config.finetune
    return finetune_settings.from_flat(ft.method, {name: ft[name] for name in METHOD_ARGS})


def _trainable_parameters(config, mc) -> int:
    """The parameters the method trains (the noise buffers' size), counted on shapes."""
    try:
        model = nnx.eval_shape(lambda: finetune.prepare(config_lib.build_model(mc, 0), config.finetune.method,
                                                        rngs=nnx.Rngs(0), options=method_options(config)))
    except ValueError as e:
        raise ConfigError(f"config.finetune: {e}") from None
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def data_format(config) -> str:
    """config.data.format: "text" (a corpus, as pretraining reads) or "instruct" (`jaxdp.data.instructions`);
    "text" where the config has no such field (runs from before it)."""
    fmt = config.data.get("format", "text")
    if fmt not in instructions.FORMATS:
        raise ConfigError(f"config.data.format must be one of {instructions.FORMATS}, got {fmt!r}")
    return fmt


def resolve(config):
    """A copy of `config` whose `model` and `data.tokenizer` are those of `config.finetune.init` (and without
    `data.format` when it is "text": a text run's config.json is the one it wrote before the field existed, so
    such runs still resume)."""
    ft = config.finetune
    kind = _init_kind(ft.init)
    if config.model.get("family") != FROM_INIT or len(config.model) != 1:
        raise ConfigError(f"config.model is taken from config.finetune.init: leave it {{'family': '{FROM_INIT}'}}")
    if config.data.tokenizer != FROM_INIT:
        raise ConfigError(f"config.data.tokenizer must be '{FROM_INIT}': fine-tuning uses the tokenizer the init "
                          f"weights were trained with, got {config.data.tokenizer!r}")
    model, tokenizer = _init_model_and_tokenizer(ft.init, kind)
    resolved = copy.deepcopy(config)
    with resolved.unlocked():
        resolved.model = config_dict.ConfigDict(model)
        resolved.data.tokenizer = tokenizer
        if "format" in resolved.data and data_format(config) == "text":
            del resolved.data["format"]
    resolved.lock()
    return resolved, kind


def _pretrained(init: str, kind: str, model_config) -> nnx.Module:
    """The model of `init` with the compute settings (dtype, remat) of `model_config`."""
    if kind == "hf":
        load = (hf_llama.load_hf_llama if isinstance(model_config, LlamaConfig) else hf_gemma.load_hf_gemma
                if isinstance(model_config, GemmaConfig) else hf_gpt2.load_hf_gpt2)
        return load(init, dtype=model_config.dtype, remat=model_config.remat)
    path = pathlib.Path(init).expanduser()
    # built in the init run's layout (its checkpoint holds that one), then unrolled: the methods change blocks
    scanned = bool(json.loads((path / CONFIG_FILE).read_text())["model"].get("scan_layers", False))
    if scanned:  # (a family without the switch never recorded it)
        model_config = dataclasses.replace(model_config, scan_layers=True)
    model = config_lib.build_model(model_config, 0)  # overwritten by the run's parameters
    if not read_trained(path, model):
        raise ConfigError(f"config.finetune.init {init!r} has no parameters ({MODEL_DIR}/ or a checkpoint)")
    return layers.unrolled(model)


def prepare(config, *, progress=None, notice=None) -> Prepared:
    """`jaxdp.training.prepare` of the resolved config, with `build_model` the pretrained model after
    `jaxdp.finetune.methods.prepare`; writes nothing. Train with `jaxdp.training.train(p.config, prepared=p)`.

    `method="prompt"` whose soft prompt and `config.seq_len` tokens overflow the model's positions runs
    with `config.seq_len` shortened to fit (`fit_prompt`): `p.config.seq_len`, which config.json records;
    `notice` (a callable, e.g. printing to stderr) gets a one-line message saying so once every check has
    passed. A prompt that leaves no position for a token is a ConfigError.
    """
    ft = config.finetune
    if ft.method not in finetune.METHODS:
        raise ConfigError(f"config.finetune.method must be one of {finetune.METHODS}, got {ft.method!r}")
    ae = ft.accuracy_examples
    if not isinstance(ae, int) or isinstance(ae, bool) or ae < 0:
        raise ConfigError(f"config.finetune.accuracy_examples must be an integer >= 0, got {ae!r}")
    if hosts.launched_as_one_of_several():
        raise ConfigError("fine-tuning runs in one process on one device: unset JAX_COORDINATOR_ADDRESS (several "
                          "hosts run experiments.pretrain_gpt2 only)")
    fmt = data_format(config)
    resolved, kind = resolve(config)
    if resolved.memory_budget_gb is not None or config_lib.runs_sharded_step(resolved):
        raise ConfigError("fine-tuning runs on the single-device step: config.memory_budget_gb must be None, "
                          "config.mesh.data = config.mesh.seq = 1 and config.dp.method='bookkeeping'")
    try:
        finetune.check_method(ft.method, resolved.model.family)
    except ValueError as e:
        raise ConfigError(f"config.finetune.method: {e}") from None
    if ft.method == "prompt" and resolved.sample.num > 0:
        raise ConfigError("config.sample.num must be 0 with config.finetune.method='prompt' (samples.txt's windows "
                          "are the model's full length, which the soft prompt would overflow)")
    message = None
    if ft.method == "prompt":
        resolved, message = fit_prompt(resolved)
    la = ft.loss_after
    if la is not None and not isinstance(la, str):
        raise ConfigError(f"config.finetune.loss_after must be a string ('' or None: the whole text), got {la!r}")
    _check_targets(ft, resolved.model.family)
    windows = None
    if fmt == "instruct":
        if la not in (None, "", tasks.PROMPT):  # the sentiment default is the config's: not the user's choice
            raise ConfigError(f"config.finetune.loss_after ({la!r}) applies to text data; instruction data "
                              "(config.data.format='instruct') counts its completion tokens: leave it unset")
        la, windows = None, _instruction_windows(resolved, ft.init)
    p = preparation.prepare(resolved, progress=progress, windows=windows,
                            trainable_parameters=lambda mc: _trainable_parameters(resolved, mc))
    if kind == "hf" and _hf_vocab(ft.init) != p.tokenizer.vocab_size:
        raise ConfigError(f"config.finetune.init: the checkpoint's vocab_size ({_hf_vocab(ft.init)}) differs from "
                          f"its tokenizer's ({p.tokenizer.name}: {p.tokenizer.vocab_size})")
    mc = p.model_config
    try:  # the method and its arguments, on shapes only
        options = method_options(resolved)
        nnx.eval_shape(lambda: finetune.prepare(config_lib.build_model(mc, 0), ft.method, rngs=nnx.Rngs(0),
                                                options=options))
    except ValueError as e:
        raise ConfigError(f"config.finetune: {e}") from None

    try:  # read and checked now, before the job writes anything (a corrupt or non-finite weight is one line)
        pretrained = _pretrained(ft.init, kind, mc)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.finetune.init: {e}") from None

    def build(seed: int) -> nnx.Module:
        model = nnx.clone(pretrained)
        return finetune.prepare(model, ft.method, rngs=nnx.Rngs(noise_lib.key_from_seed(seed)), options=options)
    loss_fn = losses.instruction_losses if fmt == "instruct" else _completion_loss(p, la) if la else p.loss_fn
    if message and notice is not None:  # the run will start: no note before a one-line error
        notice(message)
    return dataclasses.replace(p, build_model=build, loss_fn=loss_fn)


def _check_targets(ft, family: str) -> None:
    """The LoRA / adapter targets the config names, against the family's projections
    (`jaxdp.finetune.targets`), named by their config field."""
    fields = {"lora": ("lora_targets",), "reversible": ("lora_targets",), "adapter": ("adapter_targets",)}
    for field in fields.get(ft.method, ()):
        if ft[field] is not None:
            try:
                family_targets.check_targets(family, ft[field], f"config.finetune.{field}")
            except ValueError as e:
                raise ConfigError(str(e)) from None


def _instruction_windows(config, init: str):
    """`windows(tokenizer)` for `preparation.prepare`: the instruction jsonl of config.data.path, rendered with
    the chat template beside the tokenizer (config.data.tokenizer's directory, else the init's), if any."""
    where = pathlib.Path(config.data.tokenizer)
    where = where if where.is_dir() else pathlib.Path(init).expanduser()
    try:
        template = chat.ChatTemplate.from_directory(where)
        if template is not None:
            chat.check_jinja()
    except (ValueError, ImportError) as e:
        raise ConfigError(f"config.finetune.init: {e}") from None

    def windows(tokenizer):
        return instructions.instruction_windows(
            config.data.path, tokenizer, template, config.seq_len, id_field=config.data.id_field,
            validation_fraction=config.data.validation_fraction, cache_dir=config.data.cache_dir)
    return windows


def fit_prompt(config):
    """(`config`, None) when its soft prompt (`config.finetune.prompt_length`) and `config.seq_len` tokens fit
    the model's `config.model.max_seq_len` positions; else (a copy with `seq_len = max_seq_len -
    prompt_length`, a one-line message saying so). A prompt of `max_seq_len` or more: ConfigError."""
    seq_len, length, positions = config.seq_len, config.finetune.prompt_length, config.model.max_seq_len
    if not isinstance(length, int) or seq_len + length <= positions:
        return config, None  # a bad prompt_length is named by jaxdp.finetune.methods's own check
    if length >= positions:
        raise ConfigError(f"config.finetune.prompt_length ({length}) leaves no position for a token: the model has "
                          f"{positions} positions, set prompt_length < {positions}")
    fitted = copy.deepcopy(config)
    with fitted.unlocked():
        fitted.seq_len = positions - length
    fitted.lock()
    return fitted, (f"config.seq_len {seq_len} + config.finetune.prompt_length {length} exceed the model's "
                    f"{positions} positions: this run uses config.seq_len={positions - length} (recorded in "
                    "config.json)")


def _completion_loss(p: Prepared, loss_after: str):
    """`jaxdp.core.losses.completion_losses` of the tokens of `loss_after`; ConfigError when no training window
    has a target it counts (the job would train on nothing)."""
    marker = tuple(p.tokenizer.encode(loss_after))
    windows = p.train.get(np.arange(min(len(p.train), 4096)))
    if not bool(losses.completion_targets(windows, marker).any()):
        raise ConfigError(f"config.finetune.loss_after {loss_after!r} is followed by no target in any training "
                          f"window of config.data.path (checked {len(windows)}): set it to the text before each "
                          "label, or to '' to train on the whole text")
    return losses.completion_losses(marker)


def _hf_vocab(init: str) -> int:
    return int(hf_checkpoint.read_config(str(pathlib.Path(init).expanduser())).get("vocab_size", -1))


def load_finetuned(p: Prepared) -> nnx.Module:
    """The run's trained model: the init weights, the method's modules, and `model/params.npz` (or the
    latest checkpoint, for an interrupted run) for the trained parameters."""
    model = p.build_model(p.derive_seed(seeds.INIT))  # trainable values are overwritten below
    if not read_trained(p.workdir, model):
        raise ConfigError(f"{p.workdir} has no checkpoint yet")
    return model


def untrained_model(run_config: dict, model_config, workdir) -> nnx.Module:
    """A fine-tuning run's model before its trained parameters are read (`read_trained`): the init weights of
    its config.json (`run_config`) with its method applied; `model_config` the run's (compute settings may
    differ). ConfigError when the init weights are not where the run read them, or not the weights it read
    (`jaxdp.training.init_weights.init_sha256`, kept in config.json; older runs kept `tree_sha256` of the
    directory, still accepted, or lack it). `full` trains every parameter: no init."""
    ft = config_dict.ConfigDict(run_config["finetune"])
    if ft.method == "full":
        return config_lib.build_model(model_config, 0)
    why = (f"this is a fine-tuning run: its {MODEL_DIR}/{PARAMS_FILE} holds only the parameters its method "
           f"({ft.method}) trained, which go on its init weights")
    try:
        kind = _init_kind(ft.init)
    except ConfigError as e:
        raise ConfigError(f"{why}; {e}") from None
    kept = ft.get("init_sha256")
    if kept is not None and not init_weights.matches(kept, ft.init, exclude=workdir):
        raise ConfigError(f"{why}; the files under config.finetune.init ({ft.init}) are not those the run trained "
                          "from (their SHA-256 differs): restore them")
    model = _pretrained(ft.init, kind, model_config)
    return finetune.prepare(model, ft.method, rngs=nnx.Rngs(0),
                            options=method_options(config_dict.ConfigDict(run_config)))


def heldout_documents(config) -> list[str]:
    """The documents of the run's validation split (`jaxdp.data.windows.split_documents`, as the job splits)."""
    docs, ids = data_lib.load_corpus(config.data.path, id_field=config.data.id_field)
    _, valid = data_lib.split_documents(docs if ids is None else ids, config.data.validation_fraction)
    return [docs[i] for i in valid]


def add_accuracy(p: Prepared, model: nnx.Module | None = None) -> dict | None:
    """Scores `config.finetune.accuracy_examples` held-out sentiment documents (`jaxdp.data.tasks`; evenly spaced
    over the validation split) with the trained model and adds the result (`tasks.sentiment_accuracy`'s
    accuracy, examples, label and predicted positive fractions, majority-class accuracy) to summary.json as
    `heldout_accuracy`; returns it (None when accuracy_examples is 0 or the corpus has no such documents).

    A summary.json that already holds `heldout_accuracy` (a rerun of a finished run; the training job writes
    a new summary.json, without it, whenever it trains) is left untouched and its accuracy is returned
    (`stored_accuracy`).

    Runs after training, on the validation split: nothing here feeds back into training. Like the
    validation loss it is computed on private text and lies outside the guarantee (privacy.json).
    """
    config = p.config
    n = config.finetune.accuracy_examples
    if n == 0 or data_format(config) == "instruct":  # sentiment snippets only
        return None
    summary = read_json(p.workdir / SUMMARY_FILE) or {}
    if "heldout_accuracy" in summary:
        return stored_accuracy(summary["heldout_accuracy"])
    documents = [d for d in heldout_documents(config) if tasks.split_text(d) is not None]
    if not documents:
        return None
    # evenly spaced over the split (a corpus may be sorted by label: the vaderSentiment file nearly is)
    documents = [documents[i] for i in np.unique(np.linspace(0, len(documents) - 1, min(n, len(documents)))
                                                  .astype(np.int64))]
    model = model if model is not None else load_finetuned(p)
    result = tasks.sentiment_accuracy(model, p.tokenizer, documents, seq_len=config.seq_len,
                                      batch_size=config.eval_batch_size)
    summary["heldout_accuracy"] = result
    (p.workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return result


def stored_accuracy(accuracy: dict) -> dict:
    """A summary.json's `heldout_accuracy` with `tasks.sentiment_accuracy`'s fields. One written before the
    fields were named for what they count ({"accuracy", "examples", "positive_fraction"}: of the labels)
    gets `label_positive_fraction` and `majority_class_accuracy` from it and `predicted_positive_fraction`
    None (not recorded)."""
    if "positive_fraction" not in accuracy or "label_positive_fraction" in accuracy:
        return dict(accuracy)
    positive = accuracy["positive_fraction"]
    return {"accuracy": accuracy["accuracy"], "examples": accuracy["examples"], "label_positive_fraction": positive,
            "predicted_positive_fraction": None, "majority_class_accuracy": max(positive, 1.0 - positive)}


def accuracy_rows(run_dirs) -> list[dict]:
    """One row per finished fine-tuning run directory with a held-out accuracy (`add_accuracy`):
    {"run", "method", "dp", "epsilon" (math.inf without DP), "noise_multiplier", "steps", "val_loss"} and
    `ACCURACY_FIELDS` (`stored_accuracy`). A directory without summary.json or accuracy: ValueError."""
    rows = []
    for d in map(pathlib.Path, run_dirs):
        summary, config = read_json(d / SUMMARY_FILE), read_json(d / CONFIG_FILE)
        if not summary or not config or "heldout_accuracy" not in summary:
            raise ValueError(f"{d}: not a finished fine-tuning run with a held-out accuracy "
                             f"({SUMMARY_FILE} with heldout_accuracy, {CONFIG_FILE})")
        acc = stored_accuracy(summary["heldout_accuracy"])
        rows.append({"run": str(d), "method": config["finetune"]["method"], "dp": summary["dp"],
                     "epsilon": summary["epsilon"] if summary["dp"] else math.inf,
                     "noise_multiplier": summary.get("noise_multiplier"), "steps": summary["steps"],
                     "val_loss": summary["val_loss"], **{k: acc[k] for k in ACCURACY_FIELDS}})
    return rows
