"""Tiny stand-ins, built from code, for the hub models the peers' suites name.

The peers' tests call ``from_pretrained("sshleifer/tiny-gpt2")`` and the like (and
accelerate's scripts ``load_dataset("nyu-mll/glue", "mrpc")``: peers_data.py). Nothing is
downloaded here: :func:`build` writes each stand-in (a config, random weights from a fixed
seed, a tokenizer where the test needs one) into a Hugging Face hub cache laid out as the
hub client expects (``models--org--name/snapshots/<rev>/...`` and ``refs/main``), and the
runner points ``HF_HUB_CACHE`` at it with ``HF_HUB_OFFLINE=1``. transformers then resolves
the hub names from that cache, in the test process and in every subprocess it launches,
without any patching.

Each entry of :data:`STANDINS` says what the stand-in is and how it differs from the hub's.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peers_data import (  # type: ignore[import-not-found]  # beside this file
    build_glue_metric,
    build_glue_mrpc,
    pair,
    source_stamp,
    vocabulary,
)

#: the revision name written into every stand-in's ``refs/main``
REVISION = "0" * 40


@dataclass(frozen=True, kw_only=True)
class Standin:
    """One hub name and the tiny model (or config) that replaces it."""

    name: str
    """the hub id the tests pass to ``from_pretrained``"""
    what: str
    """what the stand-in is, for the README's list"""
    build: Callable[[Path], None]
    """writes the files into a snapshot directory"""
    uses_data: bool = False
    """built from ``peers_data``'s generator (its source joins the stamp)"""


def _save_model(config, auto_cls: str, out: Path, seed: int = 0) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto_cls).from_config(config)
    model.save_pretrained(out)
    config.save_pretrained(out)


def _gpt2(out: Path, *, vocab: int, n_embd: int, n_layer: int, n_head: int, positions: int) -> None:
    from transformers import GPT2Config

    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_positions=positions,
    )
    _save_model(cfg, "AutoModelForCausalLM", out)


def _gptj(out: Path) -> None:
    from transformers import GPTJConfig

    cfg = GPTJConfig(vocab_size=1000, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=512)
    _save_model(cfg, "AutoModelForCausalLM", out)


def _qwen_moe(out: Path) -> None:
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    _save_model(cfg, "AutoModelForCausalLM", out)


def _mobilevit_config(out: Path) -> None:
    from transformers import MobileViTConfig

    MobileViTConfig(
        hidden_sizes=[64, 80, 96], neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 320]
    ).save_pretrained(out)


def _sentencepiece_model(out: Path, vocab: int) -> Path:
    """A unigram sentencepiece model trained in-process on generated English-like text."""
    import random

    import sentencepiece as spm  # type: ignore[import-not-found]  # PEERS_DIR/site

    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(2000)]
    prefix = out / "spiece"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    (out / "spiece.vocab").unlink()
    return prefix.with_suffix(".model")


def _t5(out: Path) -> None:
    from transformers import T5Config, T5Tokenizer

    spiece = _sentencepiece_model(out, vocab=96)
    tok = T5Tokenizer(vocab_file=str(spiece), extra_ids=100)
    tok.save_pretrained(out)
    cfg = T5Config(
        vocab_size=len(tok),
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,  # type: ignore[call-arg]  # the hub model's (T5 starts decoding at the pad token)
    )
    _save_model(cfg, "AutoModelForSeq2SeqLM", out)


def _llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaTokenizer

    spiece = _sentencepiece_model(out, vocab=96)
    LlamaTokenizer(vocab_file=str(spiece)).save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=32000,  # the hub model's: accelerate's script feeds token ids up to 228
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    _save_model(cfg, "AutoModelForCausalLM", out)


def _bert_tokenizer(out: Path, cls_name: str, *, cased: bool) -> int:
    """A WordPiece tokenizer over peers_data's generated words (each one token); returns
    the vocabulary size."""
    import transformers

    words = vocabulary(cased=cased)
    tok = getattr(transformers, cls_name)(
        vocab={w: i for i, w in enumerate(words)}, do_lower_case=not cased, model_max_length=512
    )
    tok.save_pretrained(out)
    return len(words)


#: the bert-base-cased stand-in's pretraining: BERT's next-sentence objective on
#: generated pairs (steps, batch, AdamW learning rate)
BERT_PRETRAIN = (300, 32, 1e-3)


def _bert_cased(out: Path) -> None:
    """A tiny BERT *pretrained in code*: accelerate's scripts fine-tune bert-base-cased on
    MRPC at lr 2e-5 and assert accuracy >= 0.82, which a randomly initialised encoder cannot
    reach at that learning rate (it stays on the majority class). As the hub's BERT is
    pretrained with a next-sentence head on its pooled output, this one is pretrained
    with the same head (BertForPreTraining's ``seq_relationship``) to tell a generated
    pair whose second sentence rewrites the first from one that rewrites another sentence
    (peers_data.pair, its own random stream, not the data set's rows). The classification
    head that fine-tuning trains is new, initialised by transformers at load."""
    import random

    import torch
    from transformers import AutoTokenizer, BertConfig, BertForPreTraining

    vocab = _bert_tokenizer(out, "BertTokenizerFast", cased=True)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    steps, batch, lr = BERT_PRETRAIN
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random("bert-pretraining")
    for _ in range(steps):
        related = [rng.random() < 0.5 for _ in range(batch)]
        pairs = [pair(rng, r) for r in related]
        enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
        logits = model(**enc).seq_relationship_logits  # BERT: label 0 = "B follows A"
        loss = torch.nn.functional.cross_entropy(
            logits, torch.tensor([int(not r) for r in related])
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    cfg.save_pretrained(out)


def _distilbert_uncased(out: Path) -> None:
    from transformers import DistilBertConfig

    vocab = _bert_tokenizer(out, "DistilBertTokenizerFast", cased=False)
    cfg = DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    _save_model(cfg, "AutoModelForMaskedLM", out)


STANDINS: tuple[Standin, ...] = (
    Standin(
        name="sshleifer/tiny-gpt2",
        what="GPT-2, vocab 50257, n_embd 2, 2 layers, 2 heads (the hub's shape), random weights",
        build=lambda d: _gpt2(d, vocab=50257, n_embd=2, n_layer=2, n_head=2, positions=1024),
    ),
    Standin(
        name="hf-internal-testing/tiny-random-gpt2",
        what="GPT-2, vocab 1000, n_embd 32, 2 layers, 4 heads, random weights",
        build=lambda d: _gpt2(d, vocab=1000, n_embd=32, n_layer=2, n_head=4, positions=512),
    ),
    Standin(
        name="gpt2",
        what="GPT-2 with the hub's vocab (50257) but n_embd 32, 2 layers: not the 124M model",
        build=lambda d: _gpt2(d, vocab=50257, n_embd=32, n_layer=2, n_head=4, positions=512),
    ),
    Standin(
        name="hf-internal-testing/tiny-random-gptj",
        what="GPT-J, vocab 1000, n_embd 32, 2 layers, rotary_dim 4, random weights",
        build=_gptj,
    ),
    Standin(
        name="patrickvonplaten/t5-tiny-random",
        what="T5, d_model 16, 2+2 layers, with a 96-piece sentencepiece tokenizer trained "
        "in-process (+100 extra ids), random weights",
        build=_t5,
    ),
    Standin(
        name="peft-internal-testing/tiny-random-qwen-1.5-MoE",
        what="Qwen2-MoE, hidden 32, 2 layers, 4 experts (top-2) + shared expert, random weights",
        build=_qwen_moe,
    ),
    Standin(
        name="apple/mobilevit-xx-small",
        what="MobileViT config only (hidden_sizes [64, 80, 96], as the hub's); no weights",
        build=_mobilevit_config,
    ),
    Standin(
        name="hf-internal-testing/tiny-random-LlamaForCausalLM",
        what="Llama, vocab 32000 (the hub's), hidden 16, 2 layers, 4 heads, with a 96-piece "
        "sentencepiece tokenizer trained in-process, random weights",
        build=_llama,
    ),
    Standin(
        name="bert-base-cased",
        what="BERT, hidden 64, 2 layers, 4 heads, a cased WordPiece vocabulary of the "
        "generated MRPC stand-in's words, *pretrained in code* ({} steps of BERT's "
        "next-sentence objective on generated pairs, batch {}, AdamW {}); not the 110M "
        "model".format(*BERT_PRETRAIN),
        build=_bert_cased,
        uses_data=True,
    ),
    Standin(
        name="distilbert-base-uncased",
        what="DistilBERT, dim 32, 2 layers, 4 heads, an uncased WordPiece vocabulary of the "
        "generated MRPC stand-in's words, random weights",
        build=_distilbert_uncased,
        uses_data=True,
    ),
)


STAMP = "zeroshard-standin.sha256"  # the builder's source: a changed builder rebuilds


def _stamp(s: Standin) -> str:
    source = inspect.getsource(s.build) + inspect.getsource(_save_model)
    if s.uses_data:
        source += inspect.getsource(_bert_tokenizer) + repr(BERT_PRETRAIN) + source_stamp()
    return hashlib.sha256(source.encode()).hexdigest()


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _repo_dir(cache: Path, name: str) -> Path:
    return cache / ("models--" + name.replace("/", "--"))


def build(cache: Path) -> Path:
    """Write every stand-in into the hub cache ``cache`` (skipping those already there);
    returns ``cache``. Safe to call from several processes: each stand-in is written to a
    temporary directory and renamed into place."""
    cache.mkdir(parents=True, exist_ok=True)
    for s in STANDINS:
        repo = _repo_dir(cache, s.name)
        stamp = _stamp(s)
        if (repo / "refs" / "main").is_file() and _read(repo / STAMP) == stamp:
            continue
        shutil.rmtree(repo, ignore_errors=True)  # absent, or built by older code
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
        snap = tmp / "snapshots" / REVISION
        snap.mkdir(parents=True)
        s.build(snap)
        (tmp / "refs").mkdir()
        (tmp / "refs" / "main").write_text(REVISION)
        (tmp / STAMP).write_text(stamp)
        try:
            os.rename(tmp, repo)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    build_glue_mrpc(cache / DATASETS)
    build_glue_metric(cache / MODULES)
    return cache


#: under the hub cache: the ``datasets`` cache and ``evaluate``'s modules cache that hold
#: the data set and metric stand-ins (peers_data.py)
DATASETS, MODULES = "zeroshard-datasets", "zeroshard-modules"

DATA_STANDINS = (
    "- dataset `nyu-mll/glue`, config `mrpc`: generated, not MRPC: MRPC's splits' sizes, "
    "columns and share of positives, sentences of made-up words; label 1 exactly when "
    "sentence2 rewrites sentence1 (synonym swaps, two words moved), 0 when it rewrites "
    "another sentence that keeps 3 of sentence1's words (tests/peers/peers_data.py)",
    "- metric `glue` (`evaluate-metric/glue`), config `mrpc`: our own code, accuracy and "
    "F1 of the positive class; other configs refused",
)


def listing() -> str:
    """The stand-ins as Markdown list lines (for RESULTS.md and the README)."""
    return "\n".join([*(f"- `{s.name}`: {s.what}" for s in STANDINS), *DATA_STANDINS])


def env(cache: Path) -> dict[str, str]:
    """The environment that makes transformers, datasets and evaluate read the hub from
    ``cache`` only."""
    return {
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(cache / DATASETS),  # load_dataset falls back to it offline
        "HF_MODULES_CACHE": str(cache / MODULES),  # where evaluate.load looks offline
        "HF_EVALUATE_OFFLINE": "1",
    }


if __name__ == "__main__":  # python tests/peers/peers_hub.py DIR: build and list
    import sys

    out = build(Path(sys.argv[1]))
    print(json.dumps({"cache": str(out)}))
    print(listing())
