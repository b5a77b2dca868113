"""The job's config: validation (`validate_config`, `ConfigError`) and the model it names.

A bad value raises `ConfigError` with a one-line message naming it, before
anything is read or written (`jaxdp.training.preparation.prepare` calls
`validate_config` first).

`config.model.family` picks the architecture, and with it the fields of
`config.model` (see `MODEL_FIELDS`): "gpt2" (`jaxdp.models.gpt2`,
`experiments/configs/default.py`) or "llama" (`jaxdp.models.llama`,
`experiments/configs/llama_tiny.py`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import jax
from flax import nnx

from jaxdp.accounting import accountant as accounting
from jaxdp.clipping import norms as norms_lib
from jaxdp.models.gemma import FAMILIES as GEMMA_FAMILIES
from jaxdp.models.gemma import Gemma, GemmaConfig
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.models.remat import REMAT_POLICIES
from jaxdp.noise import draws as noise_lib
from jaxdp.noise import seeds
from jaxdp.sampling.poisson import OVERFLOW_MODES
from jaxdp.sharding.dp_step import METHODS, check_mesh_strategy


class ConfigError(ValueError):
    """A bad config value or input; the message is one line naming the problem."""


# ------------------------------------------------------------------ the model family

MODEL_FAMILIES = ("gpt2", "llama", *GEMMA_FAMILIES)
PRIVACY_UNITS = ("window", "document", "user")
NOISE_MECHANISMS = ("dpsgd", "bandmf", "blt", "auto")  # config.dp.mechanism (`jaxdp.training.noise_choice`)
MF_INSTALL = "pip install 'jaxdp[mf]'"  # BLT's strategy optimiser: jax-privacy==2.0.0


def has_jax_privacy() -> bool:
    """Whether jax_privacy (the optional extra jaxdp[mf], BLT's optimiser) can be imported; nothing is imported
    (a module set to None in sys.modules, as an import blocker does, counts as absent)."""
    import importlib.util
    try:
        return importlib.util.find_spec("jax_privacy") is not None
    except (ImportError, ValueError):
        return False

# The fields of `config.model` for each family, besides `family` itself.
MODEL_FIELDS = {
    "gpt2": ("n_layer", "n_head", "d_model", "mlp_ratio", "max_seq_len"),
    "llama": ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len",
              "rope_theta", "rope_scaling", "tie_embeddings"),
}
# Fields of `config.model` that may be absent, and their value then: LlamaConfig's switches (Mistral's window,
# Qwen2's q/k/v biases, Qwen3's q/k norms and head width), set by fine-tuning from the checkpoint's config.json.
# scan_layers (both): the blocks stacked and run by lax.scan (`jaxdp.models.layers`); False when absent.
MODEL_OPTIONAL = {"gpt2": {"scan_layers": False},
                  "llama": {"head_dim": None, "qkv_bias": False, "qk_norm": False, "sliding_window": None,
                            "scan_layers": False}}
# Gemma 2 / 3 (`jaxdp.models.gemma`, family "gemma2" | "gemma3_text"): every field of its `GemmaConfig` but the
# compute settings (seq_len as max_seq_len), all set by fine-tuning from the checkpoint's config.json.
GEMMA_FIELDS = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim", "max_seq_len", "query_pre_attn_scalar",
                "rope_theta", "rope_local_theta", "rope_scaling", "rms_norm_eps", "sliding_window", "layer_types",
                "attn_softcap", "final_softcap", "qk_norm", "tie_embeddings")
MODEL_FIELDS.update({family: GEMMA_FIELDS for family in GEMMA_FAMILIES})
MODEL_OPTIONAL.update({family: {} for family in GEMMA_FAMILIES})


def model_config(model: Mapping, vocab_size: int, *, dtype: str,
                 remat: bool | str) -> GPT2Config | LlamaConfig:
    """The `GPT2Config` / `LlamaConfig` of `config.model` (a ConfigDict, or its dict from config.json)."""
    if model["family"] in GEMMA_FAMILIES:
        return gemma_config(model, vocab_size, dtype=dtype, remat=remat)
    common = dict(vocab_size=vocab_size, seq_len=model["max_seq_len"], n_layer=model["n_layer"],
                  n_head=model["n_head"], d_model=model["d_model"], dtype=dtype, remat=remat,
                  scan_layers=model.get("scan_layers", False))
    if model["family"] == "gpt2":
        return GPT2Config(mlp_ratio=model["mlp_ratio"], **common)
    switches = {name: model.get(name, default) for name, default in MODEL_OPTIONAL["llama"].items()
                if name != "scan_layers"}
    return LlamaConfig(n_kv_head=model["n_kv_head"], d_ff=model["d_ff"], rope_theta=float(model["rope_theta"]),
                       rope_scaling=model["rope_scaling"], tie_embeddings=model["tie_embeddings"], **switches,
                       **common)


def gemma_config(model: Mapping, vocab_size: int, *, dtype: str, remat: bool | str) -> GemmaConfig:
    """The `GemmaConfig` of a gemma2 / gemma3_text `config.model`; ValueError for a bad field."""
    fields = {name: model[name] for name in GEMMA_FIELDS if name != "max_seq_len"}
    return GemmaConfig(vocab_size=vocab_size, seq_len=model["max_seq_len"], family=model["family"], dtype=dtype,
                       remat=remat, **fields)


def build_model(config: GPT2Config | LlamaConfig, seed: int) -> nnx.Module:
    """A freshly initialised `GPT2` or `Llama`; `seed`: any int >= 0 (`jaxdp.noise.draws.key_from_seed`)."""
    cls = GPT2 if isinstance(config, GPT2Config) else Gemma if isinstance(config, GemmaConfig) else Llama
    return cls(config, rngs=nnx.Rngs(noise_lib.key_from_seed(seed)))


def mesh_size(config) -> int:
    return config.mesh.data * config.mesh.seq


def runs_sharded_step(config) -> bool:
    """Whether the job trains with `ShardedDPStep` (a mesh of several devices, or
    `dp.method="two_pass"`, which only it implements) instead of the single-device step."""
    return mesh_size(config) > 1 or (config.dp.enabled and config.dp.method == "two_pass")


# ------------------------------------------------------------------ validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def _positive_int(config, name: str) -> None:
    value = _get(config, name)
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"config.{name} must be an integer >= 1, got {value!r}")


def _validate_model(config) -> None:
    m = config.model
    family = m.get("family")
    _require(family in MODEL_FAMILIES, f"config.model.family must be one of {MODEL_FAMILIES}, got {family!r}")
    fields = MODEL_FIELDS[family]
    missing = [f for f in fields if f not in m]
    _require(not missing, f"config.model.family={family!r} needs config.model.{{{', '.join(missing)}}} "
                          f"(start from experiments/configs/{'default' if family == 'gpt2' else 'llama_tiny'}.py)")
    extra = sorted(set(m.keys()) - set(fields) - set(MODEL_OPTIONAL[family]) - {"family"})
    _require(not extra, f"config.model.{{{', '.join(extra)}}} does not apply to config.model.family={family!r}")
    if family in GEMMA_FAMILIES:  # GemmaConfig checks its fields; the run's windows must fit its positions
        try:
            gemma_config(m, 1, dtype="float32", remat=False)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"config.model: {e}") from None
        _require(config.seq_len <= m.max_seq_len,
                 f"config.seq_len ({config.seq_len}) is longer than the model's maximum sequence "
                 f"length config.model.max_seq_len ({m.max_seq_len})")
        return
    for name in fields:
        if name not in ("rope_theta", "rope_scaling", "tie_embeddings"):
            _positive_int(config, f"model.{name}")
    _require(config.seq_len <= m.max_seq_len,
             f"config.seq_len ({config.seq_len}) is longer than the model's maximum sequence "
             f"length config.model.max_seq_len ({m.max_seq_len})")
    head_dim = m.get("head_dim")
    for name in ("head_dim", "sliding_window"):
        _require(m.get(name) is None or (isinstance(m[name], int) and not isinstance(m[name], bool) and m[name] >= 1),
                 f"config.model.{name} must be None or an integer >= 1, got {m.get(name)!r}")
    for name in ("qkv_bias", "qk_norm", "scan_layers"):
        _require(isinstance(m.get(name, False), bool), f"config.model.{name} must be True or False, got {m.get(name)!r}")
    _require(head_dim is not None or m.d_model % m.n_head == 0,
             f"config.model.d_model ({m.d_model}) must be divisible by config.model.n_head ({m.n_head})")
    if family == "llama":
        _require(m.n_head % m.n_kv_head == 0,
                 f"config.model.n_head ({m.n_head}) must be divisible by config.model.n_kv_head ({m.n_kv_head})")
        head_dim = head_dim or m.d_model // m.n_head
        _require(head_dim % 2 == 0, f"config.model's head width ({head_dim}: head_dim, or d_model // n_head) must "
                                    "be even for RoPE")
        _require(isinstance(m.rope_theta, (int, float)) and m.rope_theta > 0 and math.isfinite(m.rope_theta),
                 f"config.model.rope_theta must be > 0, got {m.rope_theta!r}")
        _require(m.rope_scaling is None or (isinstance(m.rope_scaling, (int, float)) and m.rope_scaling >= 1),
                 f"config.model.rope_scaling must be None or >= 1, got {m.rope_scaling!r}")
        _require(isinstance(m.tie_embeddings, bool),
                 f"config.model.tie_embeddings must be True or False, got {m.tie_embeddings!r}")


def _validate_mechanism(config) -> None:
    """config.dp.mechanism and config.dp.bands (what needs N, e.g. bands x batch_size <= N, is checked by
    `jaxdp.training.noise_choice.choose`)."""
    dp = config.dp
    mechanism, bands = dp.get("mechanism", "dpsgd"), dp.get("bands")
    buffers, budget = dp.get("blt_buffers", 3), dp.get("noise_buffer_gb")
    _require(mechanism in NOISE_MECHANISMS,
             f"config.dp.mechanism must be one of {NOISE_MECHANISMS}, got {mechanism!r}")
    _require(mechanism != "blt" or not dp.enabled or has_jax_privacy(),
             f"config.dp.mechanism='blt' needs jax_privacy for its strategy: {MF_INSTALL}")
    _require(bands is None or (isinstance(bands, int) and not isinstance(bands, bool) and bands >= 0),
             f"config.dp.bands must be None or 0 (the planner picks), or an integer >= 1, got {bands!r}")
    _require(mechanism != "dpsgd" or not bands,
             f"config.dp.bands = {bands!r} applies to config.dp.mechanism='bandmf', 'blt' or 'auto'; DP-SGD has "
             "no bands (leave config.dp.bands None)")
    _require(not bands or bands <= config.steps,
             f"config.dp.bands = {bands} exceeds config.steps = {config.steps}: the cyclic sampler's groups (BandMF's "
             "bands, BLT's min separation) must be at most the steps")
    _require(isinstance(buffers, int) and not isinstance(buffers, bool) and 1 <= buffers <= 10,
             f"config.dp.blt_buffers must be an integer in [1, 10], got {buffers!r}")
    _require(budget is None or (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                                and 0 <= budget < math.inf),
             f"config.dp.noise_buffer_gb must be None (no limit) or a number of GiB >= 0, got {budget!r}")
    _require(mechanism in ("dpsgd", "blt") or bands or config.memory_budget_gb is None or not dp.enabled,
             f"config.memory_budget_gb counts the noise buffers, whose number the planner would choose "
             f"(config.dp.mechanism={mechanism!r}, config.dp.bands None): set config.dp.bands")
    _require(mechanism != "auto" or not dp.enabled or dp.noise_multiplier is None,
             "config.dp.mechanism='auto' calibrates sigma for each mechanism it compares: leave "
             f"config.dp.noise_multiplier None (got {dp.noise_multiplier!r}), or name the mechanism")


def check_compilation_cache_dir(value) -> None:
    """config.compilation_cache_dir: None (the default directory), "" (off) or a directory's path
    (`jaxdp.training.compilation_cache`)."""
    _require(value is None or isinstance(value, str),
             f"config.compilation_cache_dir must be a directory's path, \"\" (off) or None, got {value!r}")
    path = os.path.expanduser(value or "")
    _require(not value or not os.path.exists(path) or os.path.isdir(path),
             f"config.compilation_cache_dir {value} exists and is not a directory")


def validate_config(config) -> None:
    """Range checks of every numeric / enum field; raises ConfigError naming the first bad one."""
    check_compilation_cache_dir(config.get("compilation_cache_dir"))
    for name in ("steps", "checkpoint_every", "log_every", "eval_every", "eval_windows",
                 "eval_batch_size", "batch_size", "accumulation_steps", "seq_len"):
        _positive_int(config, name)
    _require(config.seed is None or (isinstance(config.seed, int) and not isinstance(config.seed, bool)
                                     and config.seed >= 0),
             f"config.seed must be None (a secret seed) or an integer >= 0, got {config.seed!r}")
    _require(config.checkpoint_every % config.log_every == 0,
             f"config.checkpoint_every ({config.checkpoint_every}) must be a multiple of "
             f"config.log_every ({config.log_every})")
    _validate_model(config)
    _require(config.learning_rate > 0 and math.isfinite(config.learning_rate),
             f"config.learning_rate must be > 0, got {config.learning_rate!r}")
    _require(0 <= config.min_lr_ratio <= 1, f"config.min_lr_ratio must be in [0, 1], got {config.min_lr_ratio!r}")
    _require(isinstance(config.warmup_steps, int) and config.warmup_steps >= 0,
             f"config.warmup_steps must be an integer >= 0, got {config.warmup_steps!r}")
    _require(config.weight_decay >= 0, f"config.weight_decay must be >= 0, got {config.weight_decay!r}")
    for name in ("b1", "b2"):
        _require(0 <= _get(config, name) < 1, f"config.{name} must be in [0, 1), got {_get(config, name)!r}")
    _require(config.remat in REMAT_POLICIES or isinstance(config.remat, bool),
             f"config.remat must be one of {REMAT_POLICIES}, got {config.remat!r}")
    for name in ("mesh.data", "mesh.seq"):
        _positive_int(config, name)
    _require(config.mesh.zero_stage in (0, 1, 2, 3),
             f"config.mesh.zero_stage must be 0, 1, 2 or 3, got {config.mesh.zero_stage!r}")
    if seeds.several_processes():  # hosts.py: one sharded step over every process's devices
        _require(mesh_size(config) == jax.device_count(),
                 f"on {jax.process_count()} processes config.mesh.data * config.mesh.seq must be the number of "
                 f"devices of all of them, {jax.device_count()}, got {mesh_size(config)}")
    if mesh_size(config) > 1:
        _require(mesh_size(config) <= jax.device_count(),
                 f"config.mesh.data * config.mesh.seq = {mesh_size(config)} exceeds the "
                 f"{jax.device_count()} devices available")
        _require(config.dp.enabled and config.dp.strategy != "reference",
                 "a mesh of more than one device runs the DP step (dp.enabled=True, dp.strategy != 'reference')")
        _require(config.seq_len % config.mesh.seq == 0,
                 f"config.seq_len ({config.seq_len}) must be divisible by config.mesh.seq ({config.mesh.seq})")
    if runs_sharded_step(config):
        why = "a mesh of more than one device" if mesh_size(config) > 1 else "config.dp.method='two_pass'"
        _require(config.accumulation_steps == 1, f"{why} needs config.accumulation_steps == 1")
        try:
            check_mesh_strategy(config.dp.strategy)
        except ValueError as e:
            raise ConfigError(f"config.dp.strategy: {e} ({why} runs ShardedDPStep)") from None
    _require(config.dtype in ("float32", "bfloat16"),
             f"config.dtype must be 'float32' or 'bfloat16', got {config.dtype!r}")
    _require(config.accountant in accounting.ACCOUNTANTS,
             f"config.accountant must be one of {accounting.ACCOUNTANTS}, got {config.accountant!r}")
    _require(0 < config.data.validation_fraction < 1,
             f"config.data.validation_fraction must be in (0, 1), got {config.data.validation_fraction!r}")
    _require(isinstance(config.workdir, str) and config.workdir.strip() != "",
             "config.workdir must be a non-empty path")
    sample = config.sample
    _require(isinstance(sample.num, int) and not isinstance(sample.num, bool) and sample.num >= 0,
             f"config.sample.num must be an integer >= 0, got {sample.num!r}")
    _positive_int(config, "sample.tokens")
    _require(sample.prompts is None or (isinstance(sample.prompts, (tuple, list)) and len(sample.prompts) > 0
                                        and all(isinstance(t, str) and t.strip() for t in sample.prompts)),
             "config.sample.prompts must be None (the built-in public prompts) or a non-empty tuple of "
             f"non-empty strings, e.g. \"('The', 'We')\", got {sample.prompts!r}")
    unit, k_unit = config.privacy.unit, config.privacy.windows_per_unit
    _require(unit in PRIVACY_UNITS, f"config.privacy.unit must be one of {PRIVACY_UNITS}, got {unit!r}")
    _positive_int(config, "privacy.windows_per_unit")
    if config.privacy.get("num_units_bound") is not None:
        _positive_int(config, "privacy.num_units_bound")
    _require(unit != "window" or k_unit == 1,
             f"config.privacy.windows_per_unit must be 1 with config.privacy.unit='window', got {k_unit!r}")
    _require(unit != "user" or config.data.id_field is not None,
             "config.privacy.unit='user' needs config.data.id_field, the jsonl field naming each document's "
             "user (e.g. --config.data.id_field=user_id)")
    _require(config.data.id_field is None or (isinstance(config.data.id_field, str) and config.data.id_field),
             f"config.data.id_field must be None or a jsonl field name, got {config.data.id_field!r}")
    _require(unit == "window" or not runs_sharded_step(config),
             f"config.privacy.unit={unit!r} runs on the single-device step (bookkeeping); a mesh of more than "
             "one device or config.dp.method='two_pass' needs config.privacy.unit='window'")
    budget = config.memory_budget_gb
    _require(budget is None or (isinstance(budget, (int, float)) and budget > 0 and math.isfinite(budget)),
             f"config.memory_budget_gb must be None or a number > 0, got {budget!r}")
    _require(budget is None or not runs_sharded_step(config),
             "config.memory_budget_gb sizes micro-batches of the single-device step; a mesh or "
             "config.dp.method='two_pass' needs it None")
    mb = config.max_batch_size
    _require(mb is None or (isinstance(mb, int) and mb >= config.accumulation_steps),
             f"config.max_batch_size must be None or an integer >= accumulation_steps, got {mb!r}")
    dp = config.dp
    _require(dp.l2_norm_clip > 0 and math.isfinite(dp.l2_norm_clip),
             f"config.dp.l2_norm_clip must be > 0, got {dp.l2_norm_clip!r}")
    _require(dp.clipping in ("flat", "per_layer"),
             f"config.dp.clipping must be 'flat' or 'per_layer', got {dp.clipping!r}")
    _require(dp.clip_fn in ("abadi", "automatic"),
             f"config.dp.clip_fn must be 'abadi' or 'automatic', got {dp.clip_fn!r}")
    strategies = norms_lib.STRATEGIES + ("reference",)
    _require(dp.strategy in strategies,
             f"config.dp.strategy must be one of {strategies}, got {dp.strategy!r}")
    _require(dp.method in METHODS, f"config.dp.method must be one of {METHODS}, got {dp.method!r}")
    _require(not config.model.get("scan_layers", False) or (dp.method != "two_pass" and dp.strategy != "reference"),
             f"config.model.scan_layers=True needs config.dp.method='bookkeeping' and a config.dp.strategy other than "
             f"'reference', got {dp.method!r} / {dp.strategy!r}: the two-pass norms and the vmap baseline do not see "
             "a scanned model's layers apart; or set config.model.scan_layers=False")
    if dp.method == "two_pass":
        _require(dp.clipping == "flat",
                 f"config.dp.method='two_pass' needs config.dp.clipping='flat', got {dp.clipping!r}")
        _require(dp.strategy != "reference",
                 "config.dp.method='two_pass' cannot run with config.dp.strategy='reference' (the vmap baseline)")
        _require(config.dtype == "float32",
                 f"config.dp.method='two_pass' needs config.dtype='float32', got {config.dtype!r}: below float32 "
                 "its second pass rounds differently from the norms and the clip no longer bounds one unit's "
                 "contribution (jaxdp.clipping.two_pass); use config.dp.method='bookkeeping' for bfloat16")
    _require(isinstance(dp.secure_noise, bool),
             f"config.dp.secure_noise must be True or False, got {dp.secure_noise!r}")
    _require(dp.overflow in OVERFLOW_MODES,
             f"config.dp.overflow must be one of {OVERFLOW_MODES}, got {dp.overflow!r}")
    _validate_mechanism(config)
    if dp.enabled:
        _require(dp.target_epsilon is not None and dp.target_epsilon > 0 and math.isfinite(dp.target_epsilon),
                 f"config.dp.target_epsilon must be a finite number > 0, got {dp.target_epsilon!r}")
        _require(dp.noise_multiplier is None or (dp.noise_multiplier > 0 and math.isfinite(dp.noise_multiplier)),
                 f"config.dp.noise_multiplier must be None (calibrate) or > 0, got {dp.noise_multiplier!r}")
        _require(dp.delta is None or 0 < dp.delta < 1,
                 f"config.dp.delta must be None (min(10^-(digits of N + 1), 1e-5)) or in (0, 1), got {dp.delta!r}")
