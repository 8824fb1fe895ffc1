"""Stand-ins, generated offline, for the hub data set and metric that accelerate's example
scripts load: ``load_dataset("nyu-mll/glue", "mrpc")`` and ``evaluate.load("glue", "mrpc")``.

**The data set is not MRPC.** It is generated here with MRPC's shape: the splits' sizes
(train 3,668, validation 408, test 1,725), its columns and features (``sentence1``,
``sentence2``, ``label`` as ``ClassLabel(["not_equivalent", "equivalent"])``, ``idx``), its
share of "equivalent" pairs (67.4% in train: a constant guess scores 0.67-0.68), and English-
like sentences of made-up words. It is *learnable by design*: ``sentence2`` rewrites
``sentence1`` (about a third of its words swapped for a fixed synonym, two words moved),
and a pair is "not_equivalent" exactly when ``sentence2`` holds one of the
:data:`NEGATIONS` words. A model that reaches accuracy 0.82 on it (the bar of accelerate's
``test_performance``) has learned to spot those words, nothing about paraphrase.

The data set is written, as ``datasets`` itself would after a download, into the
``datasets`` cache (``HF_DATASETS_CACHE``): with ``HF_HUB_OFFLINE=1`` ``load_dataset``
falls back to that cache without patching. The metric is our own code (accuracy and F1
of the positive class, what GLUE's metric returns for MRPC; other GLUE configs are refused
by name), written into ``evaluate``'s modules cache (``HF_MODULES_CACHE``) where
``evaluate.load`` looks when the hub cannot be reached (``HF_EVALUATE_OFFLINE=1``).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 0
#: MRPC's split sizes (the hub's nyu-mll/glue, config mrpc)
SPLITS = {"train": 3668, "validation": 408, "test": 1725}
#: MRPC's share of "equivalent" pairs (train: 2,474 of 3,668)
POSITIVE = 2474 / 3668
#: a pair is "not_equivalent" exactly when its sentence2 holds one of these
NEGATIONS = ("not", "never", "neither", "without")
_FILLERS = ("the", "a", "of", "and", "to", "in", "was", "for", "on", "with", "said", "that")


def content_words() -> list[tuple[str, str]]:
    """200 made-up words, each with a fixed made-up synonym (word, synonym)."""
    rng = random.Random(SEED)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    seen: set[str] = set(_FILLERS) | set(NEGATIONS)
    words: list[str] = []
    while len(words) < 400:
        w = "".join(rng.choices(syllables, k=rng.randint(2, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return list(zip(words[::2], words[1::2], strict=True))


def vocabulary(*, cased: bool) -> list[str]:
    """A WordPiece vocabulary in which every generated word is one token: BERT's special
    tokens, punctuation, the words, and (cased) each word with a capital first letter."""
    words = [w for pair in content_words() for w in pair] + list(_FILLERS) + list(NEGATIONS)
    if cased:
        words += [w.capitalize() for w in words]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", *words]


def _sentence(rng: random.Random, pairs: list[tuple[str, str]]) -> list[str]:
    out = []
    for _ in range(rng.randint(9, 18)):
        out.append(rng.choice(_FILLERS) if rng.random() < 0.3 else rng.choice(pairs)[0])
    return out


def _rewrite(rng: random.Random, words: list[str], synonym: dict[str, str]) -> list[str]:
    out = [synonym[w] if w in synonym and rng.random() < 0.35 else w for w in words]
    for _ in range(2):  # move two words
        out.insert(rng.randrange(len(out) + 1), out.pop(rng.randrange(len(out))))
    return out


def _text(words: list[str]) -> str:
    return " ".join(words).capitalize() + " ."


def pair(rng: random.Random, equivalent: bool) -> tuple[str, str]:
    """One generated pair: sentence2 rewrites sentence1 (``equivalent``) or rewrites another
    sentence that keeps three of sentence1's words (not equivalent)."""
    pairs = content_words()
    synonym = dict(pairs)
    s1 = _sentence(rng, pairs)
    if equivalent:
        s2 = _rewrite(rng, s1, synonym)
    else:
        other = _sentence(rng, pairs)
        for w in rng.sample(s1, 3):
            other.insert(rng.randrange(len(other) + 1), w)
        s2 = _rewrite(rng, other, synonym)
    return _text(s1), _text(s2)


def rows(split: str) -> dict[str, list]:
    """The generated split ``split`` as columns (deterministic)."""
    rng = random.Random(f"{SEED}-{split}")
    cols: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(SPLITS[split]):
        label = int(rng.random() < POSITIVE)
        s1, s2 = pair(rng, bool(label))
        cols["sentence1"].append(s1)
        cols["sentence2"].append(s2)
        cols["label"].append(label if split != "test" else -1)  # the hub's test has no labels
        cols["idx"].append(i)
    return cols


def source_stamp() -> str:
    """A hash of this module's source: a changed generator rebuilds what it made."""
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()


def _replace_dir(build_into, final: Path) -> None:
    """Builds into a fresh temporary directory beside ``final`` and renames it into place
    (several processes may build at once: the first rename wins)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    build_into(tmp)
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)


def build_glue_mrpc(datasets_cache: Path) -> Path:
    """Writes the generated MRPC stand-in as ``nyu-mll/glue``, config ``mrpc``, into the
    ``datasets`` cache ``datasets_cache`` (skipped when this module's source is unchanged)."""
    import datasets  # type: ignore[import-not-found]  # PEERS_DIR/site

    stamp = source_stamp()
    final = datasets_cache / "nyu-mll___glue"
    if (final / STAMP).is_file() and (final / STAMP).read_text() == stamp:
        return final

    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": datasets.Value("int32"),
        }
    )

    class Glue(datasets.GeneratorBasedBuilder):
        BUILDER_CONFIGS = [  # noqa: RUF012  (datasets reads the class attribute)
            datasets.BuilderConfig(name="mrpc", version=datasets.Version("0.0.0"))
        ]

        def _info(self):
            return datasets.DatasetInfo(
                description="zeroshard's generated MRPC stand-in", features=features
            )

        def _split_generators(self, dl_manager):
            return [datasets.SplitGenerator(name=s, gen_kwargs={"split": s}) for s in SPLITS]

        def _generate_examples(self, split):
            cols = rows(split)
            for i in range(SPLITS[split]):
                yield i, {k: v[i] for k, v in cols.items()}

    def into(tmp: Path) -> None:
        builder = Glue(
            cache_dir=str(tmp / "cache"),
            config_name="mrpc",
            dataset_name="glue",
            repo_id="nyu-mll/glue",
            hash=stamp[:16],
        )
        builder.download_and_prepare()
        # the builder wrote tmp/cache/nyu-mll___glue/mrpc/0.0.0/<hash>: keep its top
        for entry in (tmp / "cache" / "nyu-mll___glue").iterdir():
            os.rename(entry, tmp / entry.name)
        shutil.rmtree(tmp / "cache")
        (tmp / STAMP).write_text(stamp)

    _replace_dir(into, final)
    return final


STAMP = "zeroshard-standin.sha256"

_GLUE_METRIC = '''"""zeroshard's stand-in for the hub's GLUE metric (evaluate-metric/glue), MRPC only:
accuracy and the F1 score of the positive class ("equivalent"), as GLUE reports for MRPC.
Our own code, written by tests/peers/peers_data.py; any other GLUE config is refused."""

import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name != "mrpc":
            raise KeyError(
                f"zeroshard's GLUE metric stand-in computes config 'mrpc' only, not {self.config_name!r}"
            )
        return evaluate.MetricInfo(
            description="accuracy and F1 (positive class 1) of predictions against references",
            citation="",
            inputs_description="predictions, references: lists of 0 / 1",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        tp = sum(1 for p, r in pairs if p == 1 and r == 1)
        fp = sum(1 for p, r in pairs if p == 1 and r != 1)
        fn = sum(1 for p, r in pairs if p != 1 and r == 1)
        accuracy = sum(1 for p, r in pairs if p == r) / len(pairs)
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        return {"accuracy": float(accuracy), "f1": float(f1)}
'''


def build_glue_metric(modules_cache: Path) -> Path:
    """Writes the GLUE metric stand-in where ``evaluate.load("glue", ...)`` finds a cached
    module when the hub cannot be reached: ``HF_MODULES_CACHE/evaluate_modules/metrics/
    evaluate-metric--glue/<hash>/glue.py``."""
    root = modules_cache / "evaluate_modules"
    final = root / "metrics" / "evaluate-metric--glue"
    digest = hashlib.sha256(_GLUE_METRIC.encode()).hexdigest()
    if (final / digest / "glue.py").is_file():
        return final

    def into(tmp: Path) -> None:
        (tmp / digest).mkdir()
        (tmp / digest / "__init__.py").write_text("")
        (tmp / digest / "glue.py").write_text(_GLUE_METRIC)
        (tmp / "__init__.py").write_text("")

    for d in (root, root / "metrics"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").touch()
    _replace_dir(into, final)
    return final
