"""Instruction data (jaxdp.data.chat, jaxdp.data.instructions, jaxdp.core.losses.instruction_losses) and the
fine-tuning job on it (config.data.format='instruct').

Properties: with a chat template (ChatML, in a tokenizer_config.json beside a tokenizer.json built here) a
system / user / assistant conversation's counted tokens decode to exactly the assistant turns (content and
end of turn), the rest to the context, and together to the template's whole rendering; a planted error (the
prompt's tokens counted) is caught by that check; prompt / completion records and the plain template count
the completion and the end-of-text token; bad records are one error naming the line; the loss equals a
float64 NumPy NLL over the counted targets only (counting all targets is told apart); the job trains DP-LoRA
on instruction data from a tiny HF Llama checkpoint, one record one unit, and bad input is one line, exit
status 2, before the workdir is touched.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from dp_testing import tiny_llama
from flax import nnx
from job_testing import REPO, with_settings

from experiments.configs import finetune as finetune_config
from jaxdp import training
from jaxdp.core.losses import instruction_losses, lm_losses
from jaxdp.data import chat, instructions
from jaxdp.data.tokenizer import Tokenizer
from jaxdp.models.hf import save_hf
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.training import finetune_job

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = "the cat sat on a mat and then it ran to see how you are doing today with my dog".split()
CONVERSATION = {"messages": [{"role": "system", "content": "you are a cat"},
                             {"role": "user", "content": "how are you"},
                             {"role": "assistant", "content": "the cat sat on a mat"},
                             {"role": "user", "content": "and then"},
                             {"role": "assistant", "content": "it ran to see my dog"}]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with ChatML's special tokens and the template in tokenizer_config.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("tokenizer")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                         "chat_template": CHATML}))
    return d


def decoded_parts(tokenizer, stored):
    """(text of the counted tokens, text of the context tokens, text of all) of one record's stored tokens."""
    ids = instructions.token_ids(stored[None])[0]
    return (tokenizer.decode(ids[stored >= 0]), tokenizer.decode(ids[stored <= -2]), tokenizer.decode(ids))


def assert_mask_on_assistant_turns(tokenizer, template, record, stored):
    """The counted tokens are exactly the assistant turns as the template renders them (content + end of turn,
    in order) and the context tokens exactly the rest: worked out here from the rendered text alone."""
    whole = template.render(record["messages"])
    assistant = "".join(f"{m['content']}<|im_end|>\n" for m in record["messages"] if m["role"] == "assistant")
    context = whole
    for m in record["messages"]:
        if m["role"] == "assistant":
            context = context.replace(f"{m['content']}<|im_end|>\n", "", 1)
    counted, rest, everything = decoded_parts(tokenizer, stored)
    assert everything == whole
    assert counted == assistant, (counted, assistant)
    assert rest == context


def test_the_mask_is_exactly_on_the_assistant_tokens(tokenizer_dir, monkeypatch):
    tokenizer, template = Tokenizer.load(tokenizer_dir), chat.ChatTemplate.from_directory(tokenizer_dir)
    assert template is not None and template.special_tokens == (("bos_token", "<s>"), ("eos_token", "</s>"))
    [stored] = instructions.encode_records([CONVERSATION], tokenizer, template, max_tokens=200)
    assert_mask_on_assistant_turns(tokenizer, template, CONVERSATION, stored)
    assert (stored <= -2).any() and (stored >= 0).any() and not (stored == -1).any()

    real = chat.segments  # planted: the user's turns counted too (loss on prompt tokens)

    def prompt_counted(record, tpl):
        return [(text, counted or "user\n" in str(text)) for text, counted in real(record, tpl)]
    monkeypatch.setattr(instructions, "segments", prompt_counted)
    [planted] = instructions.encode_records([CONVERSATION], tokenizer, template, max_tokens=200)
    with pytest.raises(AssertionError):
        assert_mask_on_assistant_turns(tokenizer, template, CONVERSATION, planted)


def test_generation_blocks_and_a_template_that_rewrites_earlier_turns(tokenizer_dir):
    tokenizer = Tokenizer.load(tokenizer_dir)
    tagged = chat.ChatTemplate(CHATML.replace("message['content'] + '<|im_end|>' + '\\n' }}",
                                              "message['content'] + '<|im_end|>' + '\\n' }}{% generation %}"
                                              "{% endgeneration %}"))
    [stored] = instructions.encode_records([CONVERSATION], tokenizer, tagged, max_tokens=200)
    assert_mask_on_assistant_turns(tokenizer, tagged, CONVERSATION, stored)
    # the last assistant turn rendered apart from the others (as reasoning templates do): refused, not guessed
    rewrites = chat.ChatTemplate("{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}: "
                                 "{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match=r"line 3: the chat template does not render this conversation prefix "
                                         r"by prefix \(turns \[0, 2\]"):
        instructions.encode_records([CONVERSATION], tokenizer, rewrites, max_tokens=200, lines=[3])
    failing = chat.ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="record 0: the chat template fails on this record .*roles must alternate"):
        instructions.encode_records([CONVERSATION], tokenizer, failing, max_tokens=200)


def test_prompt_completion_and_the_plain_template(tokenizer_dir):
    tokenizer = Tokenizer.load(tokenizer_dir)
    pair = {"prompt": "how are you", "completion": " doing today"}
    [stored] = instructions.encode_records([pair], tokenizer, None, max_tokens=64)
    assert decoded_parts(tokenizer, stored)[:2] == (" doing today</s>", "how are you")
    [plain] = instructions.encode_records([CONVERSATION], tokenizer, None, max_tokens=200)
    counted, context, _ = decoded_parts(tokenizer, plain)
    # " the": the header's space and the content's first word are one token, counted (it holds completion text)
    assert counted == " the cat sat on a mat</s> it ran to see my dog</s>"
    assert context == ("System: you are a cat\n\nUser: how are you\n\nAssistant:\n\nUser: and then\n\n"
                       "Assistant:\n\n")


@pytest.mark.parametrize("line,needle", [
    ({"prompt": "how"}, "field 'completion' must be a string, got nothing"),
    ({"prompt": "how", "completion": "  "}, "field 'completion' is empty"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     r"messages\[1\]: role must be one of \('system', 'user', 'assistant'\), got 'bot'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' has no assistant turn"),
    ({"text": "how are you"}, "found neither"),
    ("not json", "invalid JSON"),
])
def test_a_bad_record_is_named_by_its_line(tmp_path, line, needle):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    path.write_text(f"{good}\n\n{good}\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(ValueError, match=f"data.jsonl:4: (.* )?{needle}") as e:
        instructions.read_records(path)
    assert "how are you" not in str(e.value)  # never the record's text


def test_a_record_longer_than_a_window_is_refused(tokenizer_dir):
    tokenizer = Tokenizer.load(tokenizer_dir)
    with pytest.raises(ValueError, match=r"line 7: the record is \d+ tokens, more than one window of seq_len \+ 1 "
                                         r"= 8; records are never cut"):
        instructions.encode_records([CONVERSATION], tokenizer, None, max_tokens=8, lines=[7])


def test_the_loss_counts_the_completion_targets_only(tokenizer_dir):
    tokenizer, template = Tokenizer.load(tokenizer_dir), chat.ChatTemplate.from_directory(tokenizer_dir)
    records = [CONVERSATION, {"prompt": "how are you", "completion": " doing"}, {"prompt": "", "completion": "a"}]
    encoded = instructions.encode_records(records, tokenizer, template, max_tokens=128)
    windows = np.full((4, 128), -1, np.int32)
    for i, e in enumerate(encoded):
        windows[i, :e.size] = e
    windows[3] = windows[0]
    batch = {"tokens": windows, "mask": np.array([True, True, True, False])}
    model = tiny_llama(3, vocab_size=tokenizer.vocab_size, seq_len=128)
    got = np.asarray(nnx.jit(instruction_losses)(model, batch), np.float64)

    ids = instructions.token_ids(windows)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, np.maximum(ids[:, :-1], 0)), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    counted = instructions.counted_targets(windows)
    want = np.array([-np.mean([logp[b, t, ids[b, t + 1]] for t in np.flatnonzero(counted[b])]) if b < 3 else 0.0
                     for b in range(4)])
    tol = 20 * np.finfo(np.float32).eps * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    everything = np.asarray(nnx.jit(lm_losses)(model, {"tokens": np.where(windows <= -2, -2 - windows, windows),
                                              "mask": batch["mask"]}))
    assert np.abs(everything - want).max() > 1e3 * tol  # the loss on every target (a planted error) differs


@pytest.fixture(scope="module")
def instruct_init(tokenizer_dir, tmp_path_factory):
    """A tiny HF Llama checkpoint with the ChatML tokenizer, and an instruction jsonl (16 users' records)."""
    d = tmp_path_factory.mktemp("instruct")
    hf = d / "llama"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((tokenizer_dir / name).read_bytes())
    vocab = Tokenizer.load(hf).vocab_size
    config = LlamaConfig(vocab_size=vocab, seq_len=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32)
    save_hf(Llama(config, rngs=nnx.Rngs(0)), hf)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(48):
        words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
        record = ({"prompt": words(4), "completion": " " + words(3)} if i % 2 else
                  {"messages": [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4)}]})
        lines.append(json.dumps(dict(record, user=f"u{i % 16}")))
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    return hf, d / "train.jsonl"


SETTINGS = {"seed": 0, "steps": 2, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 8,
            "eval_batch_size": 8, "batch_size": 6, "seq_len": 40, "learning_rate": 1e-2, "warmup_steps": 1,
            "data.validation_fraction": 0.2, "finetune.rank": 4, "data.format": "instruct"}


def instruct_config(instruct_init, workdir, **overrides):
    hf, data = instruct_init
    return with_settings(finetune_config.get_config(), dict(SETTINGS, **{
        "workdir": str(workdir), "data.path": str(data), "finetune.init": str(hf),
        "data.cache_dir": str(workdir.parent / "cache")}), overrides)


def test_the_job_trains_on_instruction_data(instruct_init, tmp_path):
    c = instruct_config(instruct_init, tmp_path / "run", **{"data.id_field": "user", "privacy.unit": "user"})
    p = finetune_job.prepare(c)
    assert p.loss_fn is instruction_losses and p.num_units == p.train.num_units <= 16
    assert isinstance(p.train, instructions.InstructionWindows) and p.train.num_windows + p.valid.num_windows == 48
    summary = training.train(p.config, prepared=p, verbose=False)
    assert summary["steps"] == 2 and np.isfinite(summary["val_loss"])
    assert json.loads((p.workdir / "config.json").read_text())["data"]["format"] == "instruct"
    assert finetune_job.add_accuracy(p) is None  # sentiment accuracy: not for instruction data


def test_bad_instruction_input_is_one_line_exit_2(instruct_init, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n")
    hf, _ = instruct_init
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "experiments.finetune", f"--config.workdir={workdir}",
                          f"--config.finetune.init={hf}", f"--config.data.path={bad}", "--config.data.format=instruct",
                          "--config.seq_len=40"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: config.data") and "bad.jsonl:1: field 'completion'" in lines[0]
    assert not workdir.exists()
    with pytest.raises(training.ConfigError, match=r"config.data.format must be one of \('text', 'instruct'\)"):
        finetune_job.prepare(instruct_config(instruct_init, tmp_path / "r2", **{"data.format": "chat"}))
    with pytest.raises(training.ConfigError, match="loss_after .* applies to text data"):
        finetune_job.prepare(instruct_config(instruct_init, tmp_path / "r3", **{"finetune.loss_after": "A:"}))
