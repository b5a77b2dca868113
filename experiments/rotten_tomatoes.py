"""The Rotten Tomatoes sentiment task as a jsonl for the fine-tuning job (`jaxdp.data.tasks`).

    python -m experiments.rotten_tomatoes                          # pip download, convert: data/rotten_tomatoes.jsonl
    python -m experiments.rotten_tomatoes --source=vaderSentiment-3.3.2.tar.gz   # an sdist already here
    python -m experiments.rotten_tomatoes --source=movieReviewSnippets_GroundTruth.txt
    python -m experiments.rotten_tomatoes --domains=amazon,nyt,tweets --out=data/other_sentiment.jsonl

Without --source it runs `pip download vaderSentiment==3.3.2 --no-deps --no-binary :all:` into a
temporary directory (the sdist holds the 10,605 rated snippets; nothing is installed). `--domains`
picks the sdist's rated snippets (`jaxdp.data.tasks.DOMAINS`: movie, amazon, nyt, tweets); with more than
one, an id is "<domain>:<id>".
"""

import glob
import subprocess
import sys
import tempfile

from absl import app, flags

_SOURCE = flags.DEFINE_string("source", None, "the vaderSentiment sdist, its hutto_ICWSM_2014.tar.gz, or the "
                                              "extracted movieReviewSnippets_GroundTruth.txt; None: pip download")
_OUT = flags.DEFINE_string("out", "data/rotten_tomatoes.jsonl", "the jsonl written")
_DOMAINS = flags.DEFINE_list("domains", ["movie"], "the rated snippets written: movie (the task), amazon, nyt, "
                                                   "tweets (public text of other domains)")


def main(argv):
    del argv
    from jaxdp.data import tasks
    domains = _DOMAINS.value
    if not domains or any(d not in tasks.DOMAINS for d in domains) or len(set(domains)) < len(domains):
        print(f"error: --domains must name distinct domains of {sorted(tasks.DOMAINS)}, got {domains}", file=sys.stderr)
        return 2
    if len(domains) > 1 and _SOURCE.value and not _SOURCE.value.endswith((".tar.gz", ".tgz")):
        print(f"error: --source={_SOURCE.value} is one extracted file: give one domain, got {domains}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        source = _SOURCE.value
        if source is None:
            subprocess.run([sys.executable, "-m", "pip", "download", tasks.SDIST, "--no-deps", "--no-binary",
                            ":all:", "-d", tmp], check=True)
            source = glob.glob(f"{tmp}/vaderSentiment-*.tar.gz")[0]
        try:
            snippets = []
            for domain in domains:
                rows = tasks.read_snippets(source, domain)
                snippets += [(f"{domain}:{i}", *rest) for i, *rest in rows] if len(domains) > 1 else rows
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    n = tasks.write_sentiment_jsonl(snippets, _OUT.value)
    print(f"{_OUT.value}: {n} labelled snippets ({len(snippets) - n} neutral dropped) from {len(snippets)}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
